"""``tether verify async``: passes on a small fully_async run, fails with the right diagnosis on broken rows."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tether.cli import app

runner = CliRunner()

ASYNC = ("rollout.mode=fully_async", "trainer.total_steps=4", "trainer.trigger_parameter_sync_step=2",
         "rollout.scheduler.max_staleness=1")
CONFIG = """rollout: {mode: fully_async, scheduler: {max_staleness: 1}}
trainer: {trigger_parameter_sync_step: 2}
"""


def verify(*args):
    return runner.invoke(app, ["verify", "async", *map(str, args)], terminal_width=200)


def healthy_rows(n=6, every=2):
    """Row 0 and ``n`` steps of a balanced fully_async run that syncs every ``every`` steps."""
    rows = [{"eval/success_rate": 0.3}]
    for s in range(1, n + 1):
        rows.append({"rollout/policy_version_lag_max": float(s % 2), "optim/degenerate_group_ratio": 0.0,
                     "queue/total_produced": 16.0 * s + 8, "queue/total_consumed": 8.0 * s,
                     "queue/dropped_samples": 4.0, "queue/stale_samples": 0.0, "queue/queued_samples": 8.0 * s + 4,
                     "rollout/current_param_version": float(s // every),
                     "perf/trainer_idle_ratio": 0.2, "perf/rollouter_idle_ratio": 0.6})
    return rows


def write_run(tmp_path, rows, config=CONFIG):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, **r}) for s, r in enumerate(rows)) + "\n")
    return run


def test_balanced_rows_pass(tmp_path):
    r = verify(write_run(tmp_path, healthy_rows()))
    assert r.exit_code == 0, r.output
    assert "all 6 criteria checked hold" in r.output and "max_staleness = 1" in r.output


def test_lag_above_max_staleness_fails(tmp_path):
    rows = healthy_rows()
    rows[3]["rollout/policy_version_lag_max"] = 3.0
    r = verify(write_run(tmp_path, rows))
    assert r.exit_code == 1
    assert "older than the staleness bound" in r.output and "step 3: 3" in r.output
    assert "rollout.scheduler.max_staleness" in r.output and "buffer.stale_filter" in r.output
    # one_step_off_policy bounds the lag by min(1, max_staleness)
    rows = healthy_rows()
    cfg = CONFIG.replace("fully_async", "one_step_off_policy").replace("max_staleness: 1", "max_staleness: 4")
    rows[2]["rollout/policy_version_lag_max"] = 2.0
    r = verify(write_run(tmp_path / "b", rows, config=cfg))
    assert r.exit_code == 1 and "max_staleness = 1" in r.output


def test_broken_accounting_fails(tmp_path):
    rows = healthy_rows()
    rows[5]["queue/total_consumed"] += 8  # eight samples consumed that were never produced
    r = verify(write_run(tmp_path, rows))
    assert r.exit_code == 1
    assert "lost or counted twice" in r.output and "step 5: -8" in r.output


def test_version_that_does_not_advance_fails(tmp_path):
    rows = healthy_rows()
    for row in rows[1:]:
        row["rollout/current_param_version"] = 0.0  # the weights never reach the rollouter
    r = verify(write_run(tmp_path, rows))
    assert r.exit_code == 1
    assert "trigger_parameter_sync_step = 2" in r.output and "2, 3, 4, 5, 6" in r.output


def test_degenerate_group_with_the_filter_on_and_idle_sides_fail(tmp_path):
    rows = healthy_rows()
    rows[2]["optim/degenerate_group_ratio"] = 0.5
    for row in rows[1:]:
        row["perf/rollouter_idle_ratio"] = 0.99
    r = verify(write_run(tmp_path, rows))
    assert r.exit_code == 1
    assert "got past the producer's filter" in r.output and "the rollouter waits almost all the time" in r.output
    assert "mean 0.99" in r.output and "2 of 6" in r.output
    off = CONFIG + "policy_optimization: {advantage: {degenerate_group_filter: {enabled: false}}}\n"
    r = verify(write_run(tmp_path / "b", rows, config=off))
    assert "not checked" in r.output and "1 of 5" in r.output


def test_sync_and_bad_input_exit_2(tmp_path, tiny_model):
    sync = tmp_path / "sync.yaml"
    sync.write_text(f"model: {{path: {tiny_model}}}\nrollout: {{mode: sync}}\n")
    r = verify(sync)
    assert r.exit_code == 2 and "rollout.mode is sync" in r.output
    assert verify(write_run(tmp_path, healthy_rows(), config="rollout: {mode: sync}\n")).exit_code == 2
    assert verify(tmp_path / "nowhere.yaml").exit_code == 2


def test_a_small_fully_async_run_passes(small_run):
    _, _, run_dir = small_run("async", *ASYNC)
    r = verify(run_dir)
    assert r.exit_code == 0, r.output
    assert "rollout/current_param_version − ⌊step / 2⌋ = 0" in r.output


def test_the_command_runs_the_pipeline_itself(tmp_path, tiny_model):
    from tests.conftest import SMALL_RUN

    cfg = tmp_path / "small.yaml"
    cfg.write_text(SMALL_RUN)
    r = verify(cfg, "--steps", 3, *[a for kv in [f"model.path={tiny_model}", *ASYNC[2:]] for a in ("--set", kv)],
               "--set", "rollout.mode=fully_async")
    assert r.exit_code == 0, r.output
    assert "verify async (fully_async): steps 1–3" in r.output
