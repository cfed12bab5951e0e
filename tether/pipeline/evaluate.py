"""Held-out evaluation: one greedy rollout per task, success rate and mean reward (overall and per kind)."""

from __future__ import annotations

from collections import defaultdict

from tether.pipeline.rollouter import Rollouter
from tether.types import Task, Trajectory


async def evaluate(rollouter: Rollouter, tasks: list[Task], seed: int = 0) -> tuple[dict[str, float], list[Trajectory]]:
    groups = await rollouter.groups(tasks, 1, seed, keep_failed=True)  # a failed episode counts as not solved
    trajs = [g.trajectories[0] for g in groups]
    return eval_metrics(tasks, trajs), trajs


def eval_metrics(tasks: list[Task], trajs: list[Trajectory]) -> dict[str, float]:
    n = len(trajs)
    out = {"eval/success_rate": sum(t.success for t in trajs) / n,
           "eval/reward_mean": sum(t.reward for t in trajs) / n}
    by_kind: dict[str, list[bool]] = defaultdict(list)
    for task, tr in zip(tasks, trajs):
        by_kind[task.kind].append(tr.success)
    for kind, wins in sorted(by_kind.items()):
        out[f"eval/success_rate/{kind}"] = sum(wins) / len(wins)
    return out
