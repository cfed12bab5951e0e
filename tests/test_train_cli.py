"""End to end through the real CLI: a few sync GRPO steps change the parameters and write the run
directory; --resume after an interrupted run continues at the right step with no batch trained twice."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from tether.cli import app

CONFIG = """
environment: {num_train_tasks: 20, num_eval_tasks: 4}
engine: {max_tokens: 12, temperature: 1.0}
agent_loop: {max_assistant_turns: 2, max_user_turns: 2}
learner: {batch_size: 8, mini_batch_size: 4, gradient_accumulation_steps: 2, update_frequency: 1}
policy_optimization:
  advantage: {group_size: 4, normalization: group, degenerate_group_filter: {enabled: false}}
  optimizer: {lr: 1e-3, warmup_steps: 0}
trainer: {total_steps: 3, eval_every: 0, save_every: 1, seed: 5, deterministic: true}
metrics: {tensorboard: true}
"""
# deterministic: the step's 2 updates (mini-batches of 4) are fed beside the rollout; in task order, so a resumed run
# makes the uninterrupted run's updates (by arrival, which group makes update 1 follows the engine's timing)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    root, model = tmp_path_factory.mktemp("train"), tiny_model  # the shared tiny model (conftest.py)
    cfg = root / "cfg.yaml"
    cfg.write_text(CONFIG)
    return root, model, cfg


def train(cfg, model, run_dir, *extra):
    result = CliRunner().invoke(app, ["train", str(cfg), "--set", f"model.path={model}", "--run-dir", str(run_dir),
                                      *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def params(folder):
    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def test_train_writes_the_run_directory_and_changes_parameters(setup, monkeypatch):
    root, model, cfg = setup
    monkeypatch.setenv("TETHER_TEST_SECRET", "sk-do-not-leak-123")
    run = root / "full"
    out = train(cfg, model, run)
    assert f"run directory: {run}" in out.output
    metrics = rows(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert "eval/success_rate" in metrics[0] and "eval/success_rate" in metrics[-1]
    sync_loop_metrics = """reward/mean reward/std reward/refund_amount_correct reward/policy_compliance
        reward/response_quality reward/efficiency reward/hacking/repeated_tool_calls reward/hacking/context_stuffing
        optim/loss optim/advantage_std optim/degenerate_group_ratio optim/grad_norm optim/kl_divergence optim/kl_coef
        optim/entropy optim/clip_ratio_low optim/clip_ratio_high rollout/current_param_version
        rollout/policy_version_lag_mean rollout/policy_version_lag_max rollout/partial_ratio agent/generate_sequences
        agent/tool_calls agent/compute_score agent/num_preempted agent/num_turns perf/step_time perf/samples_per_s
        perf/tokens_per_s perf/trainer_idle_ratio perf/rollouter_idle_ratio""".split()
    for m in metrics[1:]:
        assert set(sync_loop_metrics) <= set(m), set(sync_loop_metrics) - set(m)
        assert all(math.isfinite(v) for v in m.values())
    assert metrics[-1]["rollout/current_param_version"] == 3
    before, after = params(model), params(run / "checkpoints" / "step_3")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    text = "".join(p.read_text(errors="ignore") for p in run.rglob("*") if p.is_file() and p.suffix in
                   {".yaml", ".jsonl", ".json"})
    assert "sk-do-not-leak-123" not in text  # set in the environment: no file of the run may hold it


def test_resume_continues_at_the_next_step_without_retraining_a_batch(setup):
    root, model, cfg = setup
    full, part = root / "full", root / "part"
    if not (full / "samples.jsonl").exists():
        train(cfg, model, full)
    train(cfg, model, part, "--set", "trainer.total_steps=2")  # the "interrupted" run: stops after step 2
    train(cfg, model, part, "--resume")  # total_steps back to 3
    samples = rows(part / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 2, 3]
    assert samples == rows(full / "samples.jsonl")  # the same batches, in the same order, none twice
    assert [m["step"] for m in rows(part / "metrics.jsonl")] == [0, 1, 2, 3]
    a, b = params(full / "checkpoints" / "step_3"), params(part / "checkpoints" / "step_3")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_resume_without_a_checkpoint_is_a_clear_error(setup):
    root, model, cfg = setup
    result = CliRunner().invoke(app, ["train", str(cfg), "--set", f"model.path={model}", "--run-dir",
                                      str(root / "empty"), "--resume"])
    assert result.exit_code == 2 and "no complete checkpoint" in result.output
