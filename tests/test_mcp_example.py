"""examples/mcp_tools: the calculator whose ``calculate`` is an MCP server's tool, trained by the real ``tether train``.

The untrained tiny model never writes a tool call, so the run starts from a short ``tether sft`` on demonstrations
that call ``calculate`` (written here from the train tasks); its validation rollouts then call the MCP tool, and the
server's answer is the tool message the model saw."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from conftest import REPO, read_rows
from tether.cli import app

pytest.importorskip("mcp")
pytest.importorskip("fastmcp")
EXAMPLE = REPO / "examples" / "mcp_tools"


def demos(path):
    with path.open("w") as f:
        for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines():
            task = json.loads(line)
            if task["split"] != "train":
                continue
            call = {"type": "function", "function": {"name": "calculate",
                                                     "arguments": {"expression": task["prompt"][8:-1]}}}
            f.write(json.dumps({"messages": [
                {"role": "user", "content": task["prompt"]},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": str(float(task["answer"]))},
                {"role": "assistant", "content": str(task["answer"])}]}) + "\n")
    return path


def test_tether_train_calls_the_mcp_tool_end_to_end(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(EXAMPLE)  # as the example's README runs it: the server's command runs here
    monkeypatch.syspath_prepend(str(EXAMPLE))
    runner, sft = CliRunner(), tmp_path / "sft"
    result = runner.invoke(app, ["sft", "config.yaml", "--set", "model.preset=null",
                                 "--set", f"model.path={tiny_model}", "--demos", str(demos(tmp_path / "demos.jsonl")),
                                 "--epochs", "30", "--lr", "1e-2", "--out", str(sft)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["train", "config.yaml", "--set", "model.preset=null", "--set", f"model.path={sft}",
                                 "--set", "trainer.total_steps=2", "--run-dir", str(run_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    steps = [r for r in read_rows(run_dir) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["optim/loss"]) for r in steps)
    assert sum(r["agent/num_tool_calls"] for r in steps) > 0
    rollouts = [json.loads(line) for f in sorted((run_dir / "validation").glob("step_*.jsonl"))
                for line in f.read_text().splitlines()]
    answered = []  # (the call, the tool message that answered it); call ids repeat across turns: pair turn by turn
    for r in rollouts:
        calls: dict = {}
        for m in r["messages"]:
            if m["role"] == "assistant":
                calls = {c["id"]: c["function"] for c in m.get("tool_calls", [])}
            elif m["role"] == "tool" and m.get("tool_call_id") in calls:  # (a malformed call's error answers none)
                answered.append((calls[m["tool_call_id"]], m["content"]))
    computed = [(fn["arguments"]["expression"], float(text)) for fn, text in answered
                if fn["name"] == "calculate" and _number(text)]
    assert computed, f"no validation rollout got a number from the MCP server: {answered}"
    for expression, value in computed:  # the server's arithmetic, checked here
        assert value == pytest.approx(eval(expression, {"__builtins__": {}}), abs=1e-6), (expression, value)


def _number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
