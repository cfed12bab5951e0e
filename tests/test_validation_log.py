"""Validation generations: each evaluation's held-out rollouts land in RUN/validation/step_N.jsonl."""

from __future__ import annotations

import json

import pytest

from tether.pipeline.validation import read_validation, write_validation
from tether.types import Task, Trajectory


def test_rows_hold_the_outcome_and_the_conversation(tmp_path):
    tasks = [Task("t1", "eval", "refund"), Task("t2", "eval", "lookup")]
    call = {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": {"order_id": "A7"}}}
    trajs = [Trajectory("t1", [1], reward=0.75, reward_components={"outcome": 1.0, "format": 0.5}, success=True,
                        termination="user_issue_resolved", num_tool_calls=1,
                        messages=[{"role": "user", "content": "refund A7 — ünïcode"},
                                  {"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "{\"status\": \"paid\"}"}]),
             Trajectory("t2", [1], termination="max_turns", truncated=True, errors=["turn 1: malformed tool call"])]
    path = write_validation(tmp_path, 4, tasks, trajs)
    assert path == tmp_path / "validation" / "step_4.jsonl"
    assert "ünïcode" in path.read_text(encoding="utf-8")  # readable by a person: no \u escapes
    first, second = read_validation(tmp_path, 4)
    assert first == {"task_id": "t1", "kind": "refund", "success": True, "reward": 0.75,
                     "reward_components": {"outcome": 1.0, "format": 0.5}, "termination": "user_issue_resolved",
                     "truncated": False, "num_tool_calls": 1, "num_assistant_turns": 0, "hacking_flags": {},
                     "errors": [], "messages": trajs[0].messages}
    assert (second["task_id"], second["success"], second["termination"], second["errors"]) == \
        ("t2", False, "max_turns", ["turn 1: malformed tool call"])
    # the same step evaluated again (a resumed run) replaces the file, it does not append
    write_validation(tmp_path, 4, tasks[:1], trajs[:1])
    assert len(read_validation(tmp_path, 4)) == 1
    assert [p.name for p in (tmp_path / "validation").iterdir()] == ["step_4.jsonl"]  # no temporary left


def test_mismatched_lengths_are_a_bug(tmp_path):
    with pytest.raises(AssertionError, match="2 evaluation tasks but 1"):
        write_validation(tmp_path, 0, [Task("a", "eval", "k"), Task("b", "eval", "k")], [Trajectory("a", [1])])


@pytest.mark.slow
def test_a_real_run_writes_one_file_per_evaluation(small_run):
    rows, _, run_dir = small_run("val", "trainer.eval_every=2", "trainer.total_steps=3")
    evaluated = [r["step"] for r in rows if "eval/success_rate" in r]
    assert evaluated == [0, 2, 3]  # step 0, every 2 steps, and the last step
    assert sorted(p.name for p in (run_dir / "validation").iterdir()) == [f"step_{s}.jsonl" for s in evaluated]
    for row in rows:
        if "eval/success_rate" not in row:
            continue
        lines = read_validation(run_dir, row["step"])
        assert len(lines) == 4  # num_eval_tasks of SMALL_RUN: one line per held-out task
        assert len({r["task_id"] for r in lines}) == 4  # each held-out task once
        assert sum(r["success"] for r in lines) / len(lines) == row["eval/success_rate"]
        assert sum(r["reward"] for r in lines) / len(lines) == pytest.approx(row["eval/reward_mean"])
        for r in lines:
            assert set(r) >= {"task_id", "kind", "success", "reward", "reward_components", "termination",
                              "num_tool_calls", "messages"}
            assert [m["role"] for m in r["messages"][:1]] == ["system"]
            assert r["messages"][1]["role"] == "user"
            assert any(m["role"] == "assistant" for m in r["messages"])
            assert r["termination"]
            calls = sum(len(m.get("tool_calls", [])) for m in r["messages"] if m["role"] == "assistant")
            assert calls >= r["num_tool_calls"]  # counted calls were all made by the assistant
            json.dumps(r)  # plain JSON, nothing left that a reader could not load
