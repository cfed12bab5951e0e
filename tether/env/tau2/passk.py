"""pass^k, as tau-bench defines it and tau2's report prints it (no tau2 import: usable for any environment).

pass^k of one task with ``n`` trials of which ``c`` succeeded is the chance that ``k`` trials drawn without
replacement all succeed, ``C(c, k) / C(n, k)`` (tau-bench, arXiv 2406.12045; tau2's
``tau2.metrics.agent_metrics.pass_hat_k``); the reported pass^k is its mean over tasks, for k = 1 .. n.
pass^1 is the mean success rate.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence


def pass_hat_k(num_trials: int, success_count: int, k: int) -> float:
    """``C(success_count, k) / C(num_trials, k)``; k must be at most ``num_trials``."""
    if not 1 <= k <= num_trials:
        raise ValueError(f"pass^k needs 1 <= k <= trials, got k={k} with {num_trials} trials")
    if not 0 <= success_count <= num_trials:
        raise ValueError(f"success count {success_count} is outside 0..{num_trials}")
    return math.comb(success_count, k) / math.comb(num_trials, k)


def pass_hat_ks(outcomes: Sequence[Sequence[bool]]) -> dict[int, float]:
    """``{k: mean over tasks of pass^k}`` for k = 1 .. the fewest trials of any task; ``outcomes``: one list of
    trial successes per task."""
    if not outcomes:
        return {}
    kmax = min(len(o) for o in outcomes)
    return {k: sum(pass_hat_k(len(o), sum(map(bool, o)), k) for o in outcomes) / len(outcomes)
            for k in range(1, kmax + 1)}


def by_group(groups: Sequence[str], outcomes: Sequence[Sequence[bool]]) -> dict[str, dict[int, float]]:
    """``pass_hat_ks`` per group name (e.g. the task's kind; a tau2 task's kind is its domain)."""
    split: dict[str, list[Sequence[bool]]] = defaultdict(list)
    for g, o in zip(groups, outcomes):
        split[g].append(o)
    return {g: pass_hat_ks(o) for g, o in sorted(split.items())}


def report(groups: Sequence[str], outcomes: Sequence[Sequence[bool]], rewards: Sequence[Sequence[float]],
           no_op: Sequence[Sequence[bool]] | None = None) -> str:
    """tau2-style text: per group, its tasks × trials, the average reward and pass^1 .. pass^k; with ``no_op`` (per
    trial: flagged ``no_op_pass``), how many of the passes changed nothing (tau2's DB check passes doing nothing
    on tasks whose gold actions write nothing)."""
    lines = []
    for name, ks in by_group(groups, outcomes).items():
        idx = [i for i, g in enumerate(groups) if g == name]
        flat = [r for i in idx for r in rewards[i]]
        trials = min(len(outcomes[i]) for i in idx)
        lines.append(f"{name}: {len(idx)} tasks x {trials} trials, average reward {sum(flat) / len(flat):.4f}")
        lines += [f"  pass^{k}: {v:.4f}" for k, v in ks.items()]
        if no_op is not None:
            passes = sum(map(bool, (o for i in idx for o in outcomes[i])))
            lines.append(f"  no-op passes: {sum(map(bool, (f for i in idx for f in no_op[i])))} of {passes} passes")
    return "\n".join(lines)
