"""``tether verify optim`` and the learning-signal metrics it checks (measured before the degenerate filter)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from tether.cli import app
from tether.metrics import MetricsRecorder, set_recorder
from tether.pipeline.shaping import Produced, record_production_metrics, signal_before_filter
from tether.types import Group, Trajectory

runner = CliRunner()


def test_signal_before_filter_pins_numbers():
    # [0, 1, 0, 1]: Bessel std √(1/3) = 0.5774; [1, 1, 1, 1]: 0 → mean 0.2887
    # group advantages: ±0.5 / 0.5774 = ±0.866 on 4 samples, 0 on 4 → Bessel std √(4 · 0.75 / 7) = 0.6547
    m = signal_before_filter([[0, 1, 0, 1], [1, 1, 1, 1]], "group")
    assert m["optim/raw_reward_std_within_group"] == pytest.approx(math.sqrt(1 / 3) / 2, abs=1e-6)
    assert m["optim/advantage_std_before_filter"] == pytest.approx(math.sqrt(3 / 7), abs=1e-5)
    # "none" (Dr. GRPO): centred rewards ±0.5 on 4 samples → √(4 · 0.25 / 7) = 0.378
    assert signal_before_filter([[0, 1, 0, 1], [1, 1, 1, 1]], "none")["optim/advantage_std_before_filter"] == (
        pytest.approx(math.sqrt(1 / 7), abs=1e-6))
    # a singleton counts 0; no group at all (every group failed): no signal
    assert signal_before_filter([[1.0], [0, 1]], "group")["optim/raw_reward_std_within_group"] == pytest.approx(
        math.sqrt(0.5) / 2)
    assert signal_before_filter([], "group") == {"optim/raw_reward_std_within_group": 0.0,
                                                 "optim/advantage_std_before_filter": 0.0}


def test_production_metrics_use_the_first_attempts_not_the_trained_groups():
    def group(rewards):
        return Group("t", [Trajectory("t", [1], reward=float(r)) for r in rewards])

    # the first attempt was constant and was resampled into an informative group: the signal before the
    # filter is the first attempt's (0), while the trained group's advantage std would read 0.94
    batch = [Produced(group([0, 1, 0, 1]), 1, 0, first_degenerate=True, first_rewards=[0, 0, 0, 0], resampled=1),
             Produced(group([1, 1, 1, 1]), 1, 1, first_degenerate=True, first_rewards=[1, 1, 1, 1], dropped=True)]
    rec = MetricsRecorder([])
    prev = set_recorder(rec)
    try:
        record_production_metrics(batch, "group")
    finally:
        set_recorder(prev)
    row = rec.flush(1)
    assert row["optim/raw_reward_std_within_group"] == 0.0
    assert row["optim/advantage_std_before_filter"] == 0.0


HEALTHY = {"optim/raw_reward_std_within_group": 0.35, "optim/grad_norm": 0.8, "optim/kl_divergence": 0.004,
           "optim/advantage_std": 0.94, "optim/advantage_std_before_filter": 0.7}


def write_run(tmp_path, rows, config="policy_optimization: {kl_control: {max_kl: 0.05}}\n"):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, **r}) for s, r in enumerate(rows)) + "\n")
    return run


def verify(*args):
    return runner.invoke(app, ["verify", "optim", *map(str, args)], terminal_width=200)


def rows_with(n=6, **changes):
    """Row 0 (the evaluation before training) and ``n`` healthy steps; ``changes``: metric → {step: value}."""
    rows = [{"eval/success_rate": 0.3}] + [dict(HEALTHY) for _ in range(n)]
    for key, at in changes.items():
        for step, value in at.items():
            rows[step]["optim/" + key] = value
    return rows


def test_healthy_run_passes(tmp_path):
    r = verify(write_run(tmp_path, rows_with()))
    assert r.exit_code == 0, r.output
    assert "all 3 criteria checked hold" in r.output and "optim/advantage_std 0.94" in r.output


def test_constant_reward_is_signal_collapse(tmp_path):
    r = verify(write_run(tmp_path, rows_with(raw_reward_std_within_group={s: 0.0 for s in range(1, 7)})))
    assert r.exit_code == 1
    assert "signal collapse" in r.output and "min_reward_std" in r.output and "resample_attempts" in r.output
    assert "tether sft" in r.output
    assert "grad_norm" in r.output and "2 of 3" not in r.output  # only the signal criterion failed


def test_a_quarter_of_the_steps_may_lack_signal_not_more(tmp_path):
    # the demo (16 steps): 2 steps whose first attempts agreed (resampled by the filter), a run that learns
    r = verify(write_run(tmp_path, rows_with(8, raw_reward_std_within_group={3: 0.04, 7: 0.02})))
    assert r.exit_code == 0, r.output
    assert "3, 7 (within the 25% of steps allowed)" in r.output
    r = verify(write_run(tmp_path / "b", rows_with(8, raw_reward_std_within_group={2: 0.04, 3: 0.0, 7: 0.02})))
    assert r.exit_code == 1 and "above the 25% of steps allowed" in r.output and "signal collapse" in r.output


def test_grad_norm_out_of_range_names_the_steps(tmp_path):
    r = verify(write_run(tmp_path, rows_with(grad_norm={2: 0.01, 5: 42.0, 6: float("nan")})))
    assert r.exit_code == 1
    assert "gradient norm out of range" in r.output and "max_grad_norm" in r.output and "optimizer.lr" in r.output
    assert "2, 5, 6" in r.output and "signal collapse" not in r.output


def test_kl_above_max_kl_of_the_run_config(tmp_path):
    rows = rows_with(kl_divergence={3: 0.04, 4: 0.2})
    r = verify(write_run(tmp_path, rows, config="policy_optimization: {kl_control: {max_kl: 0.03}}\n"))
    assert r.exit_code == 1
    assert "max_kl = 0.03" in r.output and "3, 4" in r.output
    assert "clip_ratio" in r.output and "kl_control" in r.output and "distribution shift" in r.output
    assert verify(write_run(tmp_path / "b", rows, config="")).exit_code == 1  # default max_kl 0.05: step 4
    r = verify(write_run(tmp_path / "c", rows, config="policy_optimization: {kl_control: {type: none}}\n"))
    assert r.exit_code == 0 and "no KL bound" in r.output


def test_steps_limits_the_check_to_the_first_n(tmp_path):
    run = write_run(tmp_path, rows_with(grad_norm={5: 50.0}))
    assert verify(run, "--steps", 4).exit_code == 0
    assert verify(run, "--steps", 5).exit_code == 1


def test_bad_input_exits_2(tmp_path):
    assert verify(tmp_path / "nowhere").exit_code == 2
    (tmp_path / "empty").mkdir()
    r = verify(tmp_path / "empty")
    assert r.exit_code == 2 and "metrics.jsonl" in r.output
    run = write_run(tmp_path, rows_with())
    (run / "config.yaml").unlink()
    assert verify(run).exit_code == 2
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "metrics.jsonl").write_text('{"step": 1, "optim/grad_norm"\n')
    (tmp_path / "torn" / "config.yaml").write_text("")
    r = verify(tmp_path / "torn")
    assert r.exit_code == 2 and "metrics.jsonl:1" in r.output


def test_a_real_short_run_records_the_signal_and_is_diagnosed(small_run):
    """The tiny random model never solves a task: most groups are constant (reward 0), and verify says so."""
    rows, _, run_dir = small_run("optim")
    steps = [r for r in rows if r["step"] >= 1]
    assert all("optim/raw_reward_std_within_group" in r and "optim/advantage_std_before_filter" in r for r in steps)
    r = verify(run_dir)
    weak = sum(s["optim/raw_reward_std_within_group"] <= 0.1 for s in steps)
    healthy = weak <= len(steps) / 4 and all(0.1 <= s["optim/grad_norm"] <= 10 for s in steps)
    assert r.exit_code == (0 if healthy else 1), r.output
    assert "optim/raw_reward_std_within_group > 0.1" in r.output and "max_kl = 0.05" in r.output
    if weak > len(steps) / 4:
        assert "signal collapse" in r.output


def test_a_learning_rate_that_makes_kl_explode_is_diagnosed(small_run):
    """lr = 1 on the tiny model: the KL to the reference reaches ≈ 4 nats per token by step 3 (max_kl 0.05)."""
    rows, _, run_dir = small_run("kl", "policy_optimization.optimizer.lr=1.0", "trainer.total_steps=4",
                                 "monitors.patience=2")
    assert max(r.get("optim/kl_divergence", 0.0) for r in rows) > 0.05
    kl = [r.get("optim/kl_divergence", 0.0) > 0.05 for r in rows if r["step"] >= 1]
    # the monitor fails from the second step in a row above max_kl (monitors.patience = 2), and only then
    assert [r["monitor/shift/kl"] for r in rows if r["step"] >= 1] == [
        float(i >= 1 and kl[i - 1] and kl[i]) for i in range(len(kl))]
    assert 1.0 in [r["monitor/shift/kl"] for r in rows if r["step"] >= 1]
    r = verify(run_dir)
    assert r.exit_code == 1
    assert "✗ optim/kl_divergence < max_kl = 0.05" in r.output and "distribution shift" in r.output
    assert "lower policy_optimization.optimizer.lr" in r.output


def test_the_command_trains_briefly_when_given_configs(tmp_path, tiny_model):
    from tests.conftest import SMALL_RUN

    cfg = tmp_path / "small.yaml"
    cfg.write_text(SMALL_RUN)
    r = verify(cfg, "--steps", 2, "--set", f"model.path={tiny_model}")
    assert r.exit_code in (0, 1), r.output
    assert "verify optim: steps 1–2" in r.output and "optim/grad_norm in [0.1, 10]" in r.output
    r = verify(cfg, "--set", "policy_optimization.optimizer.lr=-1")
    assert r.exit_code == 2 and "lr" in r.output
