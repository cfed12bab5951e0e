"""tau2 through the real CLI: the tiny model trains on tau2 retail for a few steps (plumbing, not skill: finite
metrics, the run directory), and ``tether eval --trials K`` prints pass^1 .. pass^K per domain."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from tether.cli import app
from tether.env.tau2 import available

pytestmark = [pytest.mark.skipif(not available(), reason="tau2 is not installed: pip install 'tether[tau2]'"),
              pytest.mark.slow]

CONFIG = """
environment:
  name: tau2:{domain}
  state: {{max_turns: 8}}
  num_eval_tasks: 3
engine: {{max_tokens: 12, temperature: 1.0}}
agent_loop: {{max_assistant_turns: 2, max_user_turns: 2, tool_selection: all}}
learner: {{batch_size: 4, mini_batch_size: 4, gradient_accumulation_steps: 1, update_frequency: 1}}
policy_optimization:
  advantage: {{group_size: 2, normalization: group, degenerate_group_filter: {{enabled: false}}}}
  optimizer: {{lr: 1e-3, warmup_steps: 0}}
trainer: {{total_steps: 2, eval_every: 0, save_every: 2, seed: 3}}
metrics: {{tensorboard: false}}
"""


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory):
    """The tiny model with 8192 positions: retail's policy and 16 tool schemas take ~4,100 tokens of its prompt."""
    from tether.env.customer_service import example_texts
    from tether.learner.model import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny8k") / "model", corpus=example_texts(100), num_hidden_layers=1,
                      hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=8192)


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tiny_model_trains_on_tau2_retail_through_the_cli(tiny_long, tmp_path):
    cfg = tmp_path / "retail.yaml"
    cfg.write_text(CONFIG.format(domain="retail"))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(cfg), "--set", f"model.path={tiny_long}", "--run-dir", str(run)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    metrics = rows(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert "optim/loss" in metrics[1] and "eval/success_rate/retail" in metrics[-1]
    samples = rows(run / "samples.jsonl")
    assert {t for s in samples for t in s["task_ids"]} <= {t for t in _ids("retail", "train")}
    assert (run / "checkpoints" / "step_2" / "config.json").is_file()


def _ids(domain, split):
    from tether.env.tau2 import list_tasks

    return [t.id for t in list_tasks(domain, split)]


def test_eval_prints_pass_hat_k_per_domain(tiny_model, tmp_path):
    cfg = tmp_path / "mock.yaml"
    cfg.write_text(CONFIG.format(domain="mock"))
    args = ["eval", tiny_model, "--config", str(cfg), "--trials", "2"]
    result = CliRunner().invoke(app, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output[result.output.index("{"):])
    assert metrics["eval/pass^1/mock"] == pytest.approx(metrics["eval/success_rate"])  # pass^1: the success rate
    assert 0.0 <= metrics["eval/pass^2/mock"] <= metrics["eval/pass^1/mock"]
    text = CliRunner().invoke(app, args, catch_exceptions=False).output
    assert "mock: 3 tasks x 2 trials, average reward" in text  # num_eval_tasks: 3 of mock's tasks
    assert "pass^1:" in text and "pass^2:" in text and "no-op passes: 0 of 0 passes" in text
