"""From finished groups to the batch the learner trains on, and how many rollouts each task gets.

Per trainer step, after the batch source (modes.py) delivered its groups:

1. **Diversity bonus** (``exploration.diversity_bonus``): each successful trajectory gets coef / (successful
   trajectories of its group with the same strategy) added to its reward, so a group that solved the task
   in k distinct ways earns k·coef between them (``tether.algo.diversity``: the strategy is the sequence of
   tool calls with canonical arguments plus the facts of the final answer; clusters are exact matches).
2. **Degenerate-group filter** (``advantage.degenerate_group_filter``): a group whose reward std is at most
   ``min_reward_std`` carries no learning signal (its group-relative advantages are ~0). Its task is generated
   again with fresh seeds, up to ``resample_attempts`` times, under the current weights; a group still
   degenerate after that is dropped and the step trains on fewer trajectories.
3. **Rollout allocation** (``rollout_allocation``): ``fixed`` gives every task ``group_size`` rollouts;
   ``adaptive`` gives the tasks of a step between 2 and ``max_rollouts_per_prompt`` rollouts, ∝ √(variance of
   the task's recent rewards — its kind's, for a task not seen yet), with the step's total kept at
   group_size × tasks (``tether.algo.allocation``). The statistics are re-read every ``reallocation_interval``
   steps.

Metrics: ``reward/diversity_bonus_mean``, ``rollout/semantic_cluster_count``,
``optim/degenerate_group_ratio_before_filter`` (as generated), ``optim/degenerate_group_ratio`` (as trained,
recorded with the advantages), ``rollout/resampled_groups``, ``rollout/resampled_trajectories``,
``rollout/dropped_groups``,
``rollout/allocation_max`` / ``_min``.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from tether.algo.allocation import TaskRewardWindow, allocate_rollouts
from tether.algo.diversity import diversity_bonus, strategy_signature
from tether.algo.filters import degenerate_groups, resample_or_drop
from tether.config import RunConfig
from tether.metrics import record_metric
from tether.pipeline.rollouter import Rollouter, episode_seed
from tether.types import Group, Task


def add_diversity_bonus(groups: list[Group], coef: float) -> None:
    """Add the diversity bonus to every trajectory's reward, in place (component ``diversity_bonus``)."""
    sigs = [[strategy_signature(t.messages) for t in g.trajectories] for g in groups]
    wins = [[t.success for t in g.trajectories] for g in groups]
    bonuses, m = diversity_bonus(sigs, wins, coef=coef)
    for g, bs in zip(groups, bonuses):
        for t, b in zip(g.trajectories, bs):
            t.reward += b
            t.reward_components["diversity_bonus"] = b
    record_metric("reward/diversity_bonus_mean", m["diversity_bonus_mean"])
    record_metric("rollout/semantic_cluster_count", m["semantic_cluster_count"])


class DegenerateFilter:
    """Resample, then drop, the groups whose rewards do not differ (see the module docstring)."""

    def __init__(self, cfg: RunConfig, rollouter: Rollouter, tasks: dict[str, Task],
                 shape: Callable[[list[Group]], None]):
        f = cfg.policy_optimization.advantage.degenerate_group_filter
        self.min_std, self.attempts = f.min_reward_std, f.resample_attempts
        self.rollouter, self.tasks, self.shape, self.seed = rollouter, tasks, shape, cfg.trainer.seed

    def __call__(self, groups: list[Group], step: int) -> list[Group]:
        """The groups to train on, in order. Every degenerate group of a round is regenerated at once."""
        flags, m = degenerate_groups([g.rewards for g in groups], min_reward_std=self.min_std)
        record_metric("optim/degenerate_group_ratio_before_filter", m["degenerate_group_ratio"])
        groups, resampled, regenerated = list(groups), 0, 0
        pending = [k for k, flag in enumerate(flags) if flag]
        attempt = 0
        while pending and resample_or_drop(attempt, self.attempts) == "resample":
            attempt += 1
            fresh = asyncio.run(self._regenerate([groups[k] for k in pending], step, pending, attempt))
            self.shape(fresh)
            for k, g in zip(pending, fresh):
                groups[k] = g
            resampled += len(pending)
            regenerated += sum(len(g.trajectories) for g in fresh)
            flags = degenerate_groups([g.rewards for g in fresh], min_reward_std=self.min_std)[0]
            pending = [k for k, flag in zip(pending, flags) if flag]
        record_metric("rollout/resampled_groups", resampled, "sum")
        record_metric("rollout/dropped_groups", len(pending), "sum")
        record_metric("rollout/resampled_trajectories", regenerated, "sum")
        dropped = set(pending)
        return [g for k, g in enumerate(groups) if k not in dropped]

    async def _regenerate(self, old: list[Group], step: int, index: list[int], attempt: int) -> list[Group]:
        jobs = [self.rollouter.group(self.tasks[g.task_id], len(g.trajectories),
                                     episode_seed(self.seed, f"resample:{step}:{k}", attempt))
                for g, k in zip(old, index)]
        return list(await asyncio.gather(*jobs))


class RolloutAllocator:
    """Rollouts per task for ``rollout_allocation.strategy`` (``sizes``), learning from trained groups (``observe``).

    Statistics are kept per task and per task kind: a task not seen yet (with shuffled epochs over hundreds of
    tasks, most tasks of a step are new) takes its kind's variance as its prior, and only a task of an unseen
    kind gets the base count.
    """

    def __init__(self, cfg: RunConfig, kinds: dict[str, str] | None = None):
        ra = cfg.policy_optimization.rollout_allocation
        self.adaptive = ra.strategy == "adaptive"
        self.group_size = cfg.policy_optimization.advantage.group_size
        self.max, self.interval = ra.max_rollouts_per_prompt, ra.reallocation_interval
        self.kinds = kinds or {}  # task id -> kind
        self.window = TaskRewardWindow()
        self.proxies: dict[str, float] = {}  # the statistics in force, re-read every ``interval`` steps

    def _proxy(self, task: Task) -> float | None:
        own = self.proxies.get(task.id)
        return own if own is not None else self.proxies.get(f"kind:{task.kind}")

    def sizes(self, tasks: list[Task]) -> list[int]:
        if not self.adaptive:
            return [self.group_size] * len(tasks)
        counts, m = allocate_rollouts([self._proxy(t) for t in tasks], base_rollouts_per_prompt=self.group_size,
                                      max_rollouts_per_prompt=self.max)
        record_metric("rollout/allocation_max", m["allocation_max"], "max")
        record_metric("rollout/allocation_min", m["allocation_min"], "min")
        return counts

    def state_dict(self) -> dict:
        """Plain data for a checkpoint, so that a resumed run allocates as the uninterrupted one would."""
        return {"rewards": {t: self.window.rewards(t) for t in self.window.task_ids()},
                "proxies": dict(self.proxies)}

    def load_state_dict(self, state: dict) -> None:
        for task_id, rewards in state["rewards"].items():
            self.window.update(task_id, rewards)
        self.proxies = dict(state["proxies"])

    def observe(self, groups: list[Group], step: int) -> None:
        for g in groups:
            self.window.update(g.task_id, g.rewards)
            if g.task_id in self.kinds:
                self.window.update(f"kind:{self.kinds[g.task_id]}", g.rewards)
        if self.adaptive and step % self.interval == 0:
            self.proxies = {t: p for t in self.window.task_ids() if (p := self.window.proxy(t)) is not None}
