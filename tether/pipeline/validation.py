"""Validation generations: every held-out rollout of an evaluation, saved for a person to read.

``RUN/validation/step_N.jsonl`` holds one line per evaluated task, in the evaluator's task order: the task
(id, kind), the outcome (success, reward, the verifier's ``reward_components``, termination, hacking flags,
errors), the number of tool calls and the whole conversation (OpenAI-style messages, tool calls included).
The metrics say *that* success moved; these files say *what* the policy did at that step — the check the
second source document asks for ("read the validation generations"), which no metric replaces.

The file of a step is written whole (a temporary file, then a rename), so a reader never sees half a step, and
a resumed run that evaluates the same step again replaces it instead of appending a second copy; on resume, the
files of the steps after the checkpoint are removed first (``drop_validation_after``), as metrics.jsonl's rows are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tether.types import Task, Trajectory


def validation_row(task: Task, traj: Trajectory) -> dict[str, Any]:
    """One task's held-out rollout as a JSON-ready dict (the conversation last: it is the long part)."""
    return {"task_id": task.id, "kind": task.kind, "success": traj.success, "reward": traj.reward,
            "reward_components": dict(traj.reward_components), "termination": traj.termination,
            "truncated": traj.truncated, "num_tool_calls": traj.num_tool_calls,
            "num_assistant_turns": traj.num_assistant_turns, "hacking_flags": dict(traj.hacking_flags),
            "errors": list(traj.errors), "messages": traj.messages}


def validation_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "validation" / f"step_{step}.jsonl"


def write_validation(run_dir: str | Path, step: int, tasks: list[Task], trajs: list[Trajectory]) -> Path:
    """Write ``RUN/validation/step_<step>.jsonl`` (one line per task) and return its path."""
    if len(tasks) != len(trajs):
        raise AssertionError(f"step {step}: {len(tasks)} evaluation tasks but {len(trajs)} trajectories")
    path = validation_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("w", encoding="utf-8") as f:
        for task, traj in zip(tasks, trajs):
            # default=str: a tool's arguments or observation may hold a value JSON cannot (a date, a set)
            f.write(json.dumps(validation_row(task, traj), ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def drop_validation_after(run_dir: str | Path, step: int) -> list[Path]:
    """Remove the validation files of the steps after ``step`` (what an interrupted run evaluated after its last
    checkpoint: the resumed run evaluates those steps again, or not at all if ``trainer.eval_every`` changed)."""
    dropped = [p for p in (Path(run_dir) / "validation").glob("step_*.jsonl")
               if p.stem[len("step_"):].isdigit() and int(p.stem[len("step_"):]) > step]
    for p in dropped:
        p.unlink()
    return dropped


def read_validation(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """The rows of one step's validation file."""
    text = validation_path(run_dir, step).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
