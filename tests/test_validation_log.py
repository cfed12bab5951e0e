"""Validation generations: each evaluation's held-out rollouts land in RUN/validation/step_N.jsonl."""

from __future__ import annotations

import json

import pytest

from conftest import SMALL_RUN, read_rows
from tether.pipeline.validation import drop_validation_after, read_validation, write_validation
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


def test_drop_validation_after(tmp_path):
    for step in (0, 2, 10):
        write_validation(tmp_path, step, [], [])
    (tmp_path / "validation" / "step_x.jsonl").write_text("")  # not a step file: left alone
    assert [p.name for p in drop_validation_after(tmp_path, 2)] == ["step_10.jsonl"]
    assert sorted(p.name for p in (tmp_path / "validation").iterdir()) == ["step_0.jsonl", "step_2.jsonl",
                                                                          "step_x.jsonl"]
    assert drop_validation_after(tmp_path / "no-run-yet", 0) == []


@pytest.mark.slow
def test_a_resumed_run_drops_the_evaluations_after_its_checkpoint(tiny_model, tmp_path):
    """Steps 0–3 evaluated, the step-3 checkpoint lost: resuming from step 2 with eval_every 0 (a change a resume
    may make) evaluates step 4 only, so step 3's file, from weights the resumed run never had, must go."""
    import shutil

    from tether.config import load_config
    from tether.pipeline.trainer import train

    (tmp_path / "run.yaml").write_text(SMALL_RUN)
    run_dir = tmp_path / "run"
    base = [f"model.path={tiny_model}", "trainer.save_every=1"]
    train(load_config([tmp_path / "run.yaml"], [*base, "trainer.eval_every=1"]), run_dir, show_progress=False)
    assert sorted(p.name for p in (run_dir / "validation").iterdir()) == [f"step_{s}.jsonl" for s in range(4)]
    shutil.rmtree(run_dir / "checkpoints" / "step_3")
    cfg = load_config([tmp_path / "run.yaml"], [*base, "trainer.eval_every=0", "trainer.total_steps=4"])
    train(cfg, run_dir, resume=True, show_progress=False)
    assert sorted(p.name for p in (run_dir / "validation").iterdir()) == [f"step_{s}.jsonl" for s in (0, 1, 2, 4)]
    assert [r["step"] for r in read_rows(run_dir) if "eval/success_rate" in r] == [0, 1, 2, 4]
