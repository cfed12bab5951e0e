"""Monitors (tether.pipeline.monitors): each check fires on hand-made rows at its threshold, once, after its
patience; every ``monitors.*`` key flipped changes what fires; end to end, a run writes ``monitor/*`` metrics,
the warning and ``parameter sync`` lines in RUN/train.log, and ``on_fail: stop`` stops with exit code 3."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import SMALL_RUN, read_rows
from tether.cli import app
from tether.config import RunConfig
from tether.config.plan import Plan
from tether.pipeline.monitors import Monitors, checks
from tether.types import Group, Trajectory

HEALTHY = {"agent/num_tool_calls": 2.5, "optim/entropy": 0.8, "optim/raw_reward_std_within_group": 0.3,
           "optim/degenerate_group_ratio_before_filter": 0.25, "optim/kl_divergence": 0.001,
           "optim/is_masked_fraction": 0.01, "reward/mean": 0.5, "rollout/success_rate": 0.5}


def cfg(**monitors) -> RunConfig:
    return RunConfig.model_validate({"monitors": monitors})


def monitors_of(c: RunConfig) -> Monitors:
    """The monitors with ``c``'s thresholds and its plan's staleness bound (as ``Run.build`` makes them)."""
    return Monitors(c.monitors, checks(c.monitors, c.policy_optimization, parser=c.tool_parser.name,
                                       max_staleness=Plan.of(c).max_staleness))


def run_rows(monitors: Monitors, rows: list[dict], groups=()) -> list[tuple[int, str]]:
    """Feed ``rows`` as steps 1, 2, …; the (step, check) of every finding."""
    found = []
    for step, row in enumerate(rows, 1):
        found += [(f.step, f.check) for f in monitors.observe(step, {**HEALTHY, **row}, groups)]
    return found


def test_a_healthy_run_is_silent():
    assert run_rows(monitors_of(cfg()), [{}] * 20) == []


@pytest.mark.parametrize("check, metric, bad", [
    ("exploration/entropy", "optim/entropy", 0.1),  # < min_entropy_ratio 0.2 × the first step's 0.8
    ("signal/no_tool_calls", "agent/num_tool_calls", 0.0),
    ("signal/reward_std", "optim/raw_reward_std_within_group", 0.04),  # < 0.05
    ("signal/degenerate_groups", "optim/degenerate_group_ratio_before_filter", 0.95),  # > 0.9
    ("shift/kl", "optim/kl_divergence", 0.06),  # > max_kl 0.05
    ("shift/importance_ratio", "optim/is_masked_fraction", 0.25),  # > 0.2
    ("shift/mismatch", "rollout/logp_abs_diff_mean", 0.2),  # > 0.1 (a sync that failed, TRL #5312)
    ("shift/mismatch_kl", "rollout/mismatch_kl", 0.02),  # > 0.01
])
def test_a_check_fires_once_after_patience_steps_in_a_row(check, metric, bad):
    # ok, bad, bad, ok (streak broken), bad, bad, bad (3rd in a row: fires at step 7), bad (no second warning)
    rows = [{}] + [{metric: bad}] * 2 + [{}] + [{metric: bad}] * 4
    assert run_rows(monitors_of(cfg()), rows) == [(7, check)]


def test_staleness_above_the_bound_fails_at_once():
    c = RunConfig.model_validate({"rollout": {"mode": "fully_async", "scheduler": {"max_staleness": 2}}})
    assert run_rows(monitors_of(c), [{"rollout/policy_version_lag_max": 2.0}] * 3
                    + [{"rollout/policy_version_lag_max": 3.0}]) == [(4, "shift/staleness")]


@pytest.mark.slow
def test_staleness_is_checked_against_the_bound_of_the_mode(tmp_path, tiny_model):
    """one_step_off_policy holds the lag at min(1, max_staleness): the run's monitors (built by Run.build, as the
    trainer uses them) fail at a lag of 2 although rollout.scheduler.max_staleness is 4; fully_async at 4 does not."""
    from tether.config import load_config
    from tether.pipeline.build import Run

    base = tmp_path / "run.yaml"
    base.write_text(SMALL_RUN)
    found = {}
    for mode in ("one_step_off_policy", "fully_async"):
        c = load_config([base], [f"model.path={tiny_model}", f"rollout.mode={mode}",
                                 "rollout.scheduler.max_staleness=4"])
        with Run.build(c, tmp_path / mode, show_progress=False) as run:
            found[mode] = run_rows(run.monitors, [{"rollout/policy_version_lag_max": 1.0},
                                                  {"rollout/policy_version_lag_max": 2.0}])
    assert found == {"one_step_off_policy": [(2, "shift/staleness")], "fully_async": []}


def test_nan_kl_from_skipped_updates_is_not_a_kl_failure():
    assert run_rows(monitors_of(cfg()), [{"optim/kl_divergence": float("nan")}] * 5) == []


def test_reward_up_while_success_flat():
    # window 4: reward 0.2, 0.2 | 0.4, 0.4 → +0.2 ≥ reward_rise 0.1; success 0.5, 0.5 | 0.52, 0.52 → +0.02 < 0.2/4
    rows = [{"reward/mean": r, "rollout/success_rate": s}
            for r, s in [(0.2, 0.5), (0.2, 0.5), (0.4, 0.52), (0.4, 0.52)]]
    assert run_rows(monitors_of(cfg(trend_window=4)), rows) == [(4, "hacking/reward_without_success")]
    # the same rise with success rising by 0.1 (≥ 0.05): learning, not hacking
    learning = [{"reward/mean": r, "rollout/success_rate": s}
                for r, s in [(0.2, 0.5), (0.2, 0.5), (0.4, 0.6), (0.4, 0.6)]]
    assert run_rows(monitors_of(cfg(trend_window=4)), learning) == []
    # the rise of the first case while the flagged fraction falls 0.3 → 0.1: the penalties shrink, no alarm
    unlearning = [{**r, "monitor/hacking_flag_rate": f} for r, f in zip(rows, (0.3, 0.3, 0.1, 0.1))]
    assert run_rows(monitors_of(cfg(trend_window=4)), unlearning) == []


def test_a_rising_flag_rate_is_hacking_a_high_one_from_the_start_is_not():
    rising = [{"monitor/hacking_flag_rate": f} for f in (0.05, 0.05, 0.2, 0.2)]  # +0.15 ≥ hacking_rate_rise 0.1
    assert run_rows(monitors_of(cfg(trend_window=4)), rising) == [(4, "hacking/flags")]
    high = [{"monitor/hacking_flag_rate": f} for f in (0.4, 0.4, 0.35, 0.3)]  # a warm-started policy's flags falling
    assert run_rows(monitors_of(cfg(trend_window=4)), high) == []
    assert run_rows(monitors_of(cfg(trend_window=4, hacking_rate_rise=0.2)), rising) == []  # the key flipped
    # the same rise while reward/mean falls 0.7 → 0.4 (the penalties at work on a policy that got worse): silent
    worse = [{**r, "reward/mean": m} for r, m in zip(rising, (0.7, 0.7, 0.4, 0.4))]
    assert run_rows(monitors_of(cfg(trend_window=4)), worse) == []


def traj(calls: list[str], flags: dict[str, int] | None = None) -> Trajectory:
    msgs = [{"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": c, "arguments": "{}"}}]} for c in calls]
    return Trajectory(task_id="t", prompt_ids=[1], messages=msgs, hacking_flags=flags or {})


def test_distinct_strategies_and_hacking_rate_are_measured_from_the_groups():
    same = Group("a", [traj(["query_inventory"]) for _ in range(4)])  # 1 strategy
    mixed = Group("b", [traj(["query_inventory"]), traj(["check_refund_policy"]),
                        traj(["query_inventory"], {"repeated_tool_calls": 1}), traj(["escalate_to_human"])])  # 3
    m = monitors_of(cfg(patience=1))
    found = [f.check for f in m.observe(1, HEALTHY, [same, mixed])]
    assert m.history[-1]["monitor/distinct_strategies"] == pytest.approx((1 + 3) / 2)  # 2.0 ≥ 1.25: holds
    assert m.history[-1]["monitor/hacking_flag_rate"] == pytest.approx(1 / 8)
    assert found == []
    assert [f.check for f in monitors_of(cfg(patience=1)).observe(1, HEALTHY, [same])] == ["exploration/strategies"]


@pytest.mark.parametrize("key, value, rows, before, after", [
    ("enabled", False, [{}] + [{"optim/entropy": 0.0}] * 3, ["exploration/entropy"], []),
    ("patience", 5, [{}] + [{"optim/entropy": 0.0}] * 3, ["exploration/entropy"], []),
    ("min_entropy_ratio", 0.1, [{}] + [{"optim/entropy": 0.1}] * 3, ["exploration/entropy"], []),  # 0.1 ≥ 0.08
    ("min_reward_std", 0.03, [{"optim/raw_reward_std_within_group": 0.04}] * 3, ["signal/reward_std"], []),
    ("max_degenerate_ratio", 0.99, [{"optim/degenerate_group_ratio_before_filter": 0.95}] * 3,
     ["signal/degenerate_groups"], []),
    ("max_is_masked_fraction", 0.3, [{"optim/is_masked_fraction": 0.25}] * 3, ["shift/importance_ratio"], []),
    ("max_logp_abs_diff", 0.3, [{"rollout/logp_abs_diff_mean": 0.2}] * 3, ["shift/mismatch"], []),
    ("max_mismatch_kl", 0.05, [{"rollout/mismatch_kl": 0.02}] * 3, ["shift/mismatch_kl"], []),
    ("trend_window", 6, [{"reward/mean": r} for r in (0.2, 0.2, 0.4, 0.4)], ["hacking/reward_without_success"], []),
    ("reward_rise", 0.3, [{"reward/mean": r} for r in (0.2, 0.2, 0.4, 0.4)], ["hacking/reward_without_success"], []),
])
def test_every_threshold_key_flipped_changes_what_fires(key, value, rows, before, after):
    base = {"trend_window": 4}
    assert [c for _, c in run_rows(monitors_of(cfg(**base)), rows)] == before
    assert [c for _, c in run_rows(monitors_of(cfg(**{**base, key: value})), rows)] == after


def test_min_distinct_strategies_flipped():
    one = [Group("a", [traj(["query_inventory"]), traj(["query_inventory"])])]
    assert [f.check for f in monitors_of(cfg(patience=1)).observe(1, HEALTHY, one)] == [
        "exploration/strategies"]  # 1 strategy < 1.25
    assert monitors_of(cfg(patience=1, min_distinct_strategies=1.0)).observe(1, HEALTHY, one) == []


def test_the_message_names_the_measurement_the_diagnosis_and_the_remedy_keys():
    m = monitors_of(cfg(patience=1))
    (f,) = m.observe(7, {**HEALTHY, "optim/raw_reward_std_within_group": 0.01})
    assert "step 7" in f.message and "0.01" in f.message and "signal loss" in f.message
    assert "degenerate_group_filter.min_reward_std" in f.message and "resample_attempts" in f.message
    assert "base_rollouts_per_prompt" in f.message


def _write_config(tmp_path, tiny_model, extra: str = ""):
    path = tmp_path / "run.yaml"
    path.write_text(SMALL_RUN + f"model: {{path: {tiny_model}}}\n" + extra)
    return path


@pytest.mark.slow
def test_a_run_records_monitors_logs_syncs_and_stops_on_fail(tmp_path, tiny_model):
    runner = CliRunner()
    path = _write_config(tmp_path, tiny_model)
    # an entropy ratio no entropy can reach (2 × the first step's): the exploration check fails from step 1
    warn = runner.invoke(app, ["train", str(path), "--run-dir", str(tmp_path / "warn"), "--set", "monitors.patience=1",
                               "--set", "monitors.min_entropy_ratio=2"])
    assert warn.exit_code == 0, warn.output
    rows = [r for r in read_rows(tmp_path / "warn") if r["step"] >= 1]
    assert [r["monitor/exploration/entropy"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["monitor/failing"] >= 1 for r in rows) and all("monitor/distinct_strategies" in r for r in rows)
    log = (tmp_path / "warn" / "train.log").read_text()
    assert log.count("monitor exploration/entropy failing") == 1  # warned once
    assert [ln.split("param_version=")[1].split()[0] for ln in log.splitlines() if "parameter sync" in ln] == [
        "1", "2", "3"]
    # on_fail: stop — stops after step 1 with its checkpoint, exit code 3, and says how to go on
    stop = runner.invoke(app, ["train", str(path), "--run-dir", str(tmp_path / "stop"), "--set", "monitors.patience=1",
                               "--set", "monitors.min_entropy_ratio=2", "--set", "monitors.on_fail=stop"])
    assert stop.exit_code == 3, stop.output
    said = " ".join(stop.output.split())  # the random tiny model never succeeds: the signal checks fail too
    assert "stopped by the monitors after step 1 (exploration/entropy, " in said and "signal/reward_std" in said
    assert "signal/no_tool_calls" in said  # the untrained model writes no tool call
    assert (tmp_path / "stop" / "checkpoints" / "step_1").is_dir()
    assert [r["step"] for r in read_rows(tmp_path / "stop")] == [0, 1]
    # the monitors' keys may change on resume without --allow-config-change; the run finishes
    resumed = runner.invoke(app, ["train", str(path), "--run-dir", str(tmp_path / "stop"), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert [r["step"] for r in read_rows(tmp_path / "stop")] == [0, 1, 2, 3]


def test_a_parser_that_never_parses_is_diagnosed_by_verify_env_and_the_monitors(tiny_model):
    """The expert's hermes calls replayed through the real agent loop with tool_parser.name: pythonic (a parser for
    another model family): no call is parsed; verify env names the parser, the monitor fails on zero tool calls."""
    import asyncio
    import random

    from transformers import AutoTokenizer

    from tether.agent.loop import LoopLimits, make_agent_loop
    from tether.agent.replay import action_text, play_actions
    from tether.engine.base import SamplingParams
    from tether.engine.scripted import ScriptedEngine
    from tether.metrics import MetricsRecorder, set_recorder
    from tether.pipeline.rollouter import record_rollout_metrics
    from tether.runtime import env_factory
    from tether.verify.env import check_policy
    from tether.warmstart.demos import EXPERTS

    c = RunConfig.model_validate({"tool_parser": {"name": "pythonic"}})
    make_env, tasks = env_factory(c)
    task = tasks("eval")[0]
    limits = LoopLimits.from_config(c.agent_loop, 4096)
    actions, _ = play_actions(make_env(), task, EXPERTS[c.environment.name](0.0, random.Random(0)), limits)
    assert actions[0]["name"] != "respond_to_user"  # the expert looks something up first: a real tool call
    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = ScriptedEngine(tok, [action_text(a) for a in actions] * limits.max_assistant_turns)
    loop = make_agent_loop("tool_agent", engine=engine, tokenizer=tok, sampling=SamplingParams(max_tokens=256),
                           limits=limits, parser="pythonic")
    traj = asyncio.run(loop.run(task, make_env()))
    assert traj.num_tool_calls == 0 and "<tool_call>" in traj.messages[2]["content"]
    (calls,) = [ch for ch in check_policy(c.environment, c.tool_parser.name, [traj]) if ch.name == "policy/tool calls"]
    assert calls.status == "fail" and "tool_parser.name = pythonic" in calls.diagnosis
    recorder = MetricsRecorder()
    prev = set_recorder(recorder)
    try:
        record_rollout_metrics([traj], None)
        row = recorder.peek()
    finally:
        set_recorder(prev)
    assert row["agent/num_tool_calls"] == 0
    m = monitors_of(c)
    found = [f for step in (1, 2, 3) for f in m.observe(step, {**HEALTHY, **row})]
    assert [(f.step, f.check) for f in found] == [(3, "signal/no_tool_calls")]
    assert "tool_parser.name (now pythonic)" in found[0].message
