"""`tether sft` through the real CLI: from the scripted expert or a JSONL file to a checkpoint whose
weights moved; bad input exits 2 with one line naming the file and line."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from tether.cli import app

CONFIG = """
environment: {num_train_tasks: 6, num_eval_tasks: 2}
trainer: {seed: 3}
"""
CONVERSATION = {"messages": [
    {"role": "user", "content": "Is SKU-136 in stock?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "query_inventory", "arguments": '{"sku_id": "SKU-136"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"sku_id": "SKU-136", "stock": 4}'},
    {"role": "assistant", "content": "SKU-136 has 4 in stock."},
    {"role": "user", "content": "Thanks, that solves it."}]}
runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    root, model = tmp_path_factory.mktemp("sft"), tiny_model  # the shared tiny model (conftest.py)
    cfg = root / "cfg.yaml"
    cfg.write_text(CONFIG)
    return root, model, cfg


def sft(cfg, model, *args):
    return runner.invoke(app, ["sft", str(cfg), "--set", f"model.path={model}", *args], catch_exceptions=False)


def weights(folder):
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def test_expert_demonstrations_to_a_checkpoint(setup):
    root, model, cfg = setup
    out = root / "expert"
    result = sft(cfg, model, "--expert", "--mistake-rate", "0.5", "--epochs", "1", "--lr", "1e-3", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "6 demonstrations" in result.output and "expert: " in result.output and "sft epoch 1/1" in result.output
    assert f"wrote {out}" in result.output
    before, after = weights(model), weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (out / "tokenizer.json").read_text() == (Path(model) / "tokenizer.json").read_text()


def test_jsonl_demonstrations_to_a_checkpoint(setup):
    root, model, cfg = setup
    demos = root / "demos.jsonl"
    demos.write_text(json.dumps(CONVERSATION) + "\n" + json.dumps(CONVERSATION) + "\n")
    out = root / "jsonl"
    result = sft(cfg, model, "--demos", str(demos), "--epochs", "2", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "2 demonstrations" in result.output and "sft epoch 2/2" in result.output
    before, after = weights(model), weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("args, message", [
    (["--demos", "{root}/absent.jsonl"], "{root}/absent.jsonl: no such file"),
    (["--demos", "{root}/bad.jsonl"], "{root}/bad.jsonl:2: not valid JSON"),
    (["--demos", "{root}/bad.jsonl", "--expert"], "give exactly one of --demos FILE.jsonl and --expert"),
    ([], "give exactly one of --demos FILE.jsonl and --expert"),
    (["--expert", "--mistake-rate", "1.5"], "--mistake-rate is a fraction in [0, 1]"),
])
def test_bad_input_exits_2_with_one_line(setup, args, message):
    root, model, cfg = setup
    (root / "bad.jsonl").write_text(json.dumps(CONVERSATION) + "\n" + '{"messages": [\n')
    result = sft(cfg, model, *[a.format(root=root) for a in args], "--out", str(root / "never"))
    assert result.exit_code == 2, result.output
    assert message.format(root=root) in result.stderr and result.stderr.strip().count("\n") == 0
    assert "Traceback" not in result.output and not (root / "never").exists()


def test_the_slow_phases_are_announced_on_stderr(setup):
    """Before the model loads, before the expert's demonstrations are replayed, and each epoch: progress on stderr;
    stdout keeps the results (the expert's score, the demonstrations' size, the checkpoint written)."""
    root, model, cfg = setup
    result = sft(cfg, model, "--expert", "--epochs", "2", "--out", str(root / "phases"))
    assert result.exit_code == 0, result.output
    phases = ["building the environment customer_service_agent and loading the model…",
              "replaying 6 expert demonstrations through the agent loop…", "sft epoch 1/2", "sft epoch 2/2"]
    at = [result.stderr.find(p) for p in phases]
    assert -1 not in at and at == sorted(at), result.stderr
    assert not any(p[:20] in result.stdout for p in phases)
    assert "6 demonstrations" in result.stdout and f"wrote {root / 'phases'}" in result.stdout
