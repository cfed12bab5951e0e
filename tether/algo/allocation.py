"""Adaptive rollout allocation: more rollouts for the tasks whose gradient estimate is noisiest.

Method: minimum-variance (Neyman) allocation under a budget. If task i's gradient estimate from n_i rollouts has
variance v_i / n_i, minimising Σ_i v_i / n_i subject to Σ_i n_i = N gives n_i ∝ √v_i (Lagrangian: v_i / n_i² = λ).
GVM-RAFT (Yao et al. 2025, arXiv 2505.02391, "Optimizing chain-of-thought reasoners via gradient variance
minimization in rejection sampling and RL") derives its per-prompt sample sizes by this argument, with v_i
built from the prompt's gradient norm G_i and acceptance rate p_i (n_i ∝ G_i / √p_i in their simplest form).

Departure, on purpose: per-prompt gradient norms need an extra backward pass per prompt, so ``gradient_variance_proxy``
uses the spread of the task's observed rewards — their population variance, which for 0/1 rewards is the
Bernoulli variance p̂(1 − p̂). A task always solved or always failed has proxy 0: its group-relative advantages
are all 0, so it gets the minimum. Knapsack-RL (Li et al. 2025, arXiv 2509.25849) is the alternative that
instead spends extra rollouts on hard prompts to make a non-zero gradient likely; it is not implemented here.

Constraints, with the bounded optimum n_i = clip(λ·√v_i, min_per_task, max_rollouts_per_prompt):
  * every task gets between ``min_per_task`` (≥ 2: a group needs two samples to have an advantage) and
    ``max_rollouts_per_prompt``;
  * tasks never seen (proxy None) get ``base_rollouts_per_prompt``;
  * the counts sum exactly to ``total_budget`` (default base × tasks, the fixed strategy's compute): λ is
    solved exactly on the piecewise-linear Σ_i clip(λ·√v_i, lo, hi), then rounded by largest remainder (ties by
    task order, so the result is deterministic). Only if every informative task is at the maximum is the
    surplus spread evenly over the proxy-0 tasks; only if every task is at the maximum is budget left unused.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence


def gradient_variance_proxy(rewards: Sequence[float]) -> float:
    """Population variance of a task's observed rewards (= p̂(1 − p̂) for 0/1 rewards); 0 for fewer than 2."""
    n = len(rewards)
    if n < 2 or max(rewards) == min(rewards):
        return 0.0
    mean = math.fsum(rewards) / n
    return math.fsum((r - mean) ** 2 for r in rewards) / n


def _water_fill(scores: Sequence[float], lo: float, hi: float, budget: float) -> list[float]:
    """Real n_i = clip(λ·s_i, lo, hi) with Σ n_i = budget (lo·n ≤ budget ≤ Σ_i (hi if s_i > 0 else lo))."""

    def total(lam: float) -> float:
        return math.fsum(min(max(lam * s, lo), hi) for s in scores)

    knots = sorted({b / s for s in scores if s > 0 for b in (lo, hi)})  # where a task leaves or joins the free set
    prev, f_prev = 0.0, total(0.0)
    lam = 0.0
    for knot in knots:
        f = total(knot)
        if f >= budget:  # total is linear on [prev, knot]: solve it there
            lam = prev + (budget - f_prev) * (knot - prev) / (f - f_prev) if f > f_prev else knot
            break
        prev, f_prev = knot, f
    return [min(max(lam * s, lo), hi) for s in scores]


def _largest_remainder(real: Sequence[float], budget: int, hi: int) -> list[int]:
    floors = [math.floor(x) for x in real]
    left = budget - sum(floors)
    order = sorted((i for i, f in enumerate(floors) if f < hi), key=lambda i: (-(real[i] - floors[i]), i))
    if left < 0 or left > len(order):
        raise AssertionError(f"rounding {list(real)} to {budget} left {left} units")  # a bug, never user input
    for i in order[:left]:
        floors[i] += 1
    return floors


def allocate_rollouts(
    proxies: Sequence[float | None],
    *,
    base_rollouts_per_prompt: int,
    max_rollouts_per_prompt: int,
    total_budget: int | None = None,
    min_per_task: int = 2,
) -> tuple[list[int], dict[str, float]]:
    """Rollouts per task, n_i ∝ √proxy_i within bounds, summing to the budget (rules in the module docstring).

    Args:
        proxies: one ``gradient_variance_proxy`` per task (≥ 0), or None for a task without statistics.
        base_rollouts_per_prompt: what unseen tasks get; in [min_per_task, max_rollouts_per_prompt].
        max_rollouts_per_prompt: upper bound per task.
        total_budget: rollouts to hand out; default base × len(proxies).
        min_per_task: lower bound per seen task, ≥ 2.

    Returns:
        counts: one int per task, in the order given.
        metrics: ``allocation_min``, ``allocation_max``, ``allocation_mean``, ``allocation_unused_budget``,
            ``allocation_zero_proxy_fraction`` (seen tasks with proxy 0).
    """
    lo, hi, base = min_per_task, max_rollouts_per_prompt, base_rollouts_per_prompt
    if lo < 2:
        raise ValueError(f"min_per_task must be >= 2 (a group needs two samples for an advantage), got {lo}")
    if not lo <= base <= hi:
        raise ValueError(f"need min_per_task ({lo}) <= base_rollouts_per_prompt ({base}) <= "
                         f"max_rollouts_per_prompt ({hi})")
    if any(p is not None and not (math.isfinite(p) and p >= 0) for p in proxies):
        raise ValueError(f"proxies must be finite and >= 0, or None for an unseen task; got {list(proxies)}")
    n = len(proxies)
    budget = base * n if total_budget is None else total_budget
    seen = [i for i, p in enumerate(proxies) if p is not None]
    seen_budget = budget - base * (n - len(seen))
    if seen_budget < lo * len(seen):
        raise ValueError(f"total_budget {budget} is below the minimum: {base} per unseen task × {n - len(seen)} + "
                         f"{lo} per seen task × {len(seen)}")
    counts = [base] * n
    scores = [math.sqrt(p) for p in proxies if p is not None]  # in the order of seen
    spend = min(seen_budget, hi * len(seen))
    positive = sum(1 for s in scores if s > 0)
    if spend <= hi * positive + lo * (len(seen) - positive):
        real = _water_fill(scores, lo, hi, spend)
    else:  # every informative task is at the maximum: share the rest evenly among the proxy-0 tasks
        zeros = len(seen) - positive
        rest = iter(_water_fill([1.0] * zeros, lo, hi, spend - hi * positive))
        real = [hi if s > 0 else next(rest) for s in scores]
    for i, c in zip(seen, _largest_remainder(real, spend, hi)):
        counts[i] = c
    metrics = {
        "allocation_min": float(min(counts)) if n else 0.0,
        "allocation_max": float(max(counts)) if n else 0.0,
        "allocation_mean": sum(counts) / n if n else 0.0,
        "allocation_unused_budget": float(seen_budget - spend),
        "allocation_zero_proxy_fraction": (len(seen) - positive) / len(seen) if seen else 0.0,
    }
    return counts, metrics


class TaskRewardWindow:
    """The last ``window`` rewards of each task id, and the allocation proxy they give.

    A task with fewer than ``min_count`` rewards has no proxy (None: ``allocate_rollouts`` gives it the base).
    """

    def __init__(self, window: int = 32, min_count: int = 2):
        if window < 2 or not 1 <= min_count <= window:
            raise ValueError(f"need window >= 2 and 1 <= min_count <= window; got window={window}, "
                             f"min_count={min_count}")
        self.window, self.min_count = window, min_count
        self._rewards: dict[Hashable, deque[float]] = {}

    def update(self, task_id: Hashable, rewards: Iterable[float]) -> None:
        """Append a group's rewards (finite) to the task's window, dropping the oldest beyond ``window``."""
        rewards = list(rewards)
        if not all(math.isfinite(r) for r in rewards):
            raise ValueError(f"task {task_id!r}: rewards must be finite, got {rewards}")
        self._rewards.setdefault(task_id, deque(maxlen=self.window)).extend(rewards)

    def proxy(self, task_id: Hashable) -> float | None:
        rewards = self._rewards.get(task_id)
        if rewards is None or len(rewards) < self.min_count:
            return None
        return gradient_variance_proxy(list(rewards))

    def rewards(self, task_id: Hashable) -> list[float]:
        """The task's rewards in the window, oldest first (empty if unseen)."""
        return list(self._rewards.get(task_id, ()))

    def task_ids(self) -> list[Hashable]:
        """Every task id seen so far, in order of first appearance."""
        return list(self._rewards)

    def proxies(self, task_ids: Iterable[Hashable]) -> list[float | None]:
        return [self.proxy(t) for t in task_ids]
