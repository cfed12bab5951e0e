"""Group production — what the batch source (modes.py) asks for — and how many rollouts each task gets.

A group is produced in one place, the same way in every ``rollout.mode`` (``GroupProducer.produce``):

1. **Rollouts**: ``size`` episodes of the task, seeded by (run seed, step, task). With an LLM judge their rubric
   scores come from the reward loop (``tether.reward``) and a judge failure in the group is settled by
   ``reward.on_judge_failure``: drop_group delivers the group marked ``dropped`` (not resampled, not trained).
2. **Diversity bonus** (``exploration.diversity_bonus``): each successful trajectory gets coef / (successful
   trajectories of its group with the same strategy) added to its reward, so a group that solved the task
   in k distinct ways earns k·coef between them (``tether.algo.diversity``: the strategy is the sequence of
   tool calls with canonical arguments plus the facts of the final answer; clusters are exact matches).
3. **Degenerate-group filter** (``advantage.degenerate_group_filter``): a group whose reward std is at most
   ``min_reward_std`` carries no learning signal (its group-relative advantages are ~0). Its task (or, with
   ``resample: new_task``, another train task drawn for the attempt) is generated again with fresh seeds, up to
   ``resample_attempts`` times, under the weights of the moment; a group still degenerate after that is delivered
   marked ``dropped`` and the step trains on fewer trajectories.

Because this runs inside the producer, in the async modes a resampled group holds the admission slot of the
group it replaces (so it is bounded by ``max_staleness`` like any other: it starts later, hence fresher) and
reaches the trainer through the MessageQueue, whose accounting counts it once. The metrics of a group are
recorded by the consumer, when the trainer takes it (``record_production_metrics``), so that a step's row
describes the groups of that step in every mode.

4. **Rollout allocation** (``rollout_allocation``): ``fixed`` gives every task ``group_size`` rollouts;
   ``adaptive`` gives the tasks of a step between 2 and ``max_rollouts_per_prompt`` rollouts, ∝ √(variance of
   the task's recent rewards — its kind's, for a task not seen yet), with the step's total kept at
   group_size × tasks (``tether.algo.allocation``). The statistics are re-read every ``reallocation_interval``
   steps.

Metrics: ``reward/diversity_bonus_mean``, ``rollout/semantic_cluster_count``,
``optim/degenerate_group_ratio_before_filter`` (first attempts), ``optim/degenerate_group_ratio`` (as trained,
recorded with the advantages), ``rollout/resampled_groups``, ``rollout/resampled_trajectories``,
``rollout/dropped_groups``, ``rollout/generated_trajectories`` (first attempts), ``rollout/speculative_trajectories``
(sync mode: episodes of resample attempts started together with an earlier one that turned out informative,
then cancelled; see ``GroupProducer``), ``rollout/group_time_s`` (mean wall seconds from a group's start to the end
of its first attempt's last episode: the time a group holds its place under admission control),
``rollout/allocation_max`` / ``_min``; and the learning signal where it can fail, over every first attempt of
the step's groups before the filter: ``optim/raw_reward_std_within_group`` (mean of the within-group reward
stds, a singleton counting 0) and ``optim/advantage_std_before_filter`` (the std of the advantages those
groups would get). ``optim/advantage_std`` is taken after the filter and after group normalisation, so it reads
≈ √((n−1)/n) for any informative batch, whatever the share of groups that carried no signal.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from tether.algo.advantages import Normalization, group_advantages
from tether.algo.allocation import TaskRewardWindow, allocate_rollouts
from tether.algo.diversity import diversity_bonus, strategy_signature
from tether.algo.filters import decided_informative, degenerate_groups, group_reward_std, resample_or_drop
from tether.config.policy import PolicyOptimConfig, RolloutAllocationConfig
from tether.metrics import record_metric
from tether.pipeline.rollouter import Rollouter, episode_seed
from tether.types import Group, Task


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s first attempts (episode seeds derive from it and the task)."""
    return seed * 100_003 + step


def add_diversity_bonus(groups: list[Group], coef: float) -> dict[str, float]:
    """Add the diversity bonus to every trajectory's reward, in place (component ``diversity_bonus``);
    returns ``diversity_bonus_mean`` and ``semantic_cluster_count`` (means over ``groups``)."""
    sigs = [[strategy_signature(t.messages) for t in g.trajectories] for g in groups]
    wins = [[t.success for t in g.trajectories] for g in groups]
    bonuses, m = diversity_bonus(sigs, wins, coef=coef)
    for g, bs in zip(groups, bonuses):
        for t, b in zip(g.trajectories, bs):
            t.reward += b
            t.reward_components["diversity_bonus"] = b
    return m


@dataclass
class Produced:
    """A finished group as the producer delivers it, with what it took to get it."""

    group: Group
    step: int  # the step whose task list it came from
    index: int  # its position in that list
    first_degenerate: bool = False  # the first attempt's rewards did not differ
    first_rewards: list[float] = field(default_factory=list)  # the first attempt's rewards (bonus included)
    resampled: int = 0  # further attempts made by the degenerate-group filter
    resampled_trajectories: int = 0
    speculative_trajectories: int = 0  # started by a resample attempt that an earlier one made unneeded
    speculative_cancelled_early: int = 0  # of those, cancelled before the earlier attempt's stragglers finished
    first_trajectories: int = 0
    dropped: bool = False  # still degenerate after every attempt (or failed): delivered, not trained
    failed: bool = False  # every episode of the group failed (``RolloutError``): no trajectories
    any_success: bool = False  # some trajectory of some attempt succeeded
    bonus: dict[str, float] = field(default_factory=dict)  # diversity metrics of the delivered group


class GroupProducer:
    """Rollouts of one task → diversity bonus → degenerate-group resampling (see the module docstring)."""

    def __init__(self, rollouter: Rollouter, po: PolicyOptimConfig, *, seed: int, sync: bool,
                 replacement: Callable[[int, int, int], Task] | None = None):
        """``po``: the diversity bonus and the degenerate-group filter; ``sync``: ``rollout.mode`` is sync (the
        weights cannot change during a step); ``replacement(step, index, attempt)``: the task a resample attempt
        generates instead of the group's own (``degenerate_group_filter.resample: new_task``); None: the group's
        own task again."""
        self.replacement = replacement
        self.rollouter, self.seed = rollouter, seed
        bonus = po.exploration.diversity_bonus
        self.bonus_coef = bonus.coef if bonus.enabled else 0.0
        f = po.advantage.degenerate_group_filter
        self.filter, self.min_std, self.attempts = f.enabled, f.min_reward_std, f.resample_attempts
        # In sync mode the weights cannot change while a step's groups are generated, so a resample attempt can
        # start before it is known to be needed: attempt k is the same episodes (same seeds, same weights) either
        # way, the first informative one is kept as before, and the later ones are cancelled
        # (``rollout/speculative_trajectories``). Attempt k starts once the attempt before it looks degenerate
        # (all but its last quarter finished with equal rewards; ``produce``), so the step does not wait for
        # attempts in series at its tail, where the engine runs few requests, and rarely generates one that is
        # not needed. (A rollouter that does not report episodes as they finish starts them all together once
        # the first attempt is degenerate.) Not with a judge or a teacher (an attempt not kept would still cost
        # their calls), nor in the async modes (an attempt takes the weights of the moment it starts).
        self.concurrent_resamples = (sync and self.attempts > 1
                                     and getattr(rollouter, "rewards", None) is None
                                     and getattr(rollouter, "score", None) is None)

    def _degenerate(self, group: Group) -> bool:
        return degenerate_groups([group.rewards], min_reward_std=self.min_std)[0][0]

    def _shape(self, group: Group) -> dict[str, float]:
        return add_diversity_bonus([group], self.bonus_coef) if self.bonus_coef > 0 else {}

    async def _rollouts(self, task: Task, size: int, seed: int,
                        on_episode: Callable[[list[float]], None] | None = None) -> tuple[Group, bool]:
        """The group, its rewards settled by the reward loop when a judge scores rubrics (``tether.reward``): True
        when a judge failure drops it (``reward.on_judge_failure: drop_group``)."""
        if on_episode is None:
            group = await self.rollouter.group(task, size, seed)
        else:
            group = await self.rollouter.group(task, size, seed, on_episode=on_episode)
        rewards = getattr(self.rollouter, "rewards", None)  # a rollouter without a reward loop: rewards are final
        return group, rewards is not None and rewards.settle(group.trajectories)

    async def produce(self, task: Task, size: int, step: int, index: int) -> Produced:
        early = self.filter and self.concurrent_resamples and getattr(self.rollouter, "reports_episodes", False)
        ahead: dict[int, asyncio.Future] = {}  # attempt -> its rollouts, started before they are known to be needed
        launched: set[int] = set()
        cancelled: set[int] = set()  # attempts cancelled as soon as the one before was decided informative

        def attempt(k: int, on_episode: Callable[[list[float]], None] | None = None
                    ) -> Coroutine[Any, Any, tuple[Group, bool]]:
            """Resample attempt ``k``'s rollouts (a coroutine)."""
            return self._rollouts(self._attempt_task(task, step, index, k), size, self._resample_seed(step, index, k),
                                  on_episode)

        def launch(k: int) -> None:
            """Start resample attempt ``k`` now (``concurrent_resamples``); with ``early``, attempt k + 1 starts as
            soon as this one looks degenerate (``watcher``)."""
            if k > self.attempts or k in launched:
                return
            launched.add(k)
            ahead[k] = asyncio.ensure_future(attempt(k, watcher(k + 1) if early else None))

        def watcher(k: int) -> Callable[[list[float]], None]:
            def watch(rewards: list[float]) -> None:
                """The rewards so far of the attempt before ``k``: when all but its last quarter have finished with
                rewards that do not differ, it is likely degenerate, so attempt ``k`` starts now rather than after
                the stragglers (the same episodes either way; an informative attempt cancels it). Once its finished
                rewards make it informative whatever the stragglers score, attempt ``k`` (and any after it) is not
                needed: cancelled now, its slots freed, rather than when the stragglers finish."""
                if k in ahead and decided_informative(rewards, size, min_reward_std=self.min_std):
                    for j in [j for j in ahead if j >= k and j not in cancelled and not ahead[j].done()]:
                        ahead[j].cancel()
                        cancelled.add(j)
                elif len(rewards) >= size - max(1, size // 4) and group_reward_std(rewards) <= self.min_std:
                    launch(k)
            return watch

        try:
            t0 = time.perf_counter()
            group, judge_dropped = await self._rollouts(task, size, step_seed(self.seed, step),
                                                        watcher(1) if early else None)
            record_metric("rollout/group_time_s", time.perf_counter() - t0, "mean")
            out = Produced(group, step, index, first_trajectories=size, bonus=self._shape(group))
            out.first_degenerate = degenerate = self._degenerate(group)
            out.first_rewards = list(group.rewards)
            out.any_success = any(t.success for t in group.trajectories)
            if degenerate and self.filter and not judge_dropped and self.concurrent_resamples and not early:
                for k in range(1, self.attempts + 1):  # no early signal: every attempt starts together
                    launch(k)
            while (degenerate and self.filter and not judge_dropped
                   and resample_or_drop(out.resampled, self.attempts) == "resample"):
                out.resampled += 1
                k = out.resampled
                if self.concurrent_resamples and k not in cancelled:
                    launch(k)  # (a no-op when it started ahead)
                    group, judge_dropped = await ahead.pop(k)
                else:  # (one cancelled early and needed after all: the diversity bonus evened the rewards out)
                    group, judge_dropped = await attempt(k)
                out.group, out.bonus = group, self._shape(group)
                out.resampled_trajectories += size
                out.any_success |= any(t.success for t in group.trajectories)
                degenerate = self._degenerate(group)
        finally:  # attempts started ahead and not needed: an earlier one was informative (or the first failed)
            for unused in ahead.values():
                unused.cancel()
            if ahead:
                await asyncio.gather(*ahead.values(), return_exceptions=True)
        out.speculative_trajectories = size * len(ahead)
        out.speculative_cancelled_early = size * len(cancelled)
        out.dropped = (degenerate and self.filter) or judge_dropped
        return out

    def _attempt_task(self, task: Task, step: int, index: int, attempt: int) -> Task:
        return task if self.replacement is None else self.replacement(step, index, attempt)

    def _resample_seed(self, step: int, index: int, attempt: int) -> int:
        return episode_seed(self.seed, f"resample:{step}:{index}", attempt)


def record_production_metrics(batch: list[Produced], normalization: Normalization = "group") -> None:
    """The shaping metrics of the groups the trainer took at this step (called by the consumer);
    ``normalization`` is ``advantage.normalization``, for ``optim/advantage_std_before_filter``."""
    if not batch:
        return
    n = len(batch)
    for k, v in signal_before_filter([p.first_rewards for p in batch if p.first_rewards], normalization).items():
        record_metric(k, v)
    record_metric("optim/degenerate_group_ratio_before_filter", sum(p.first_degenerate for p in batch) / n)
    record_metric("rollout/generated_trajectories", sum(p.first_trajectories for p in batch), "sum")
    record_metric("rollout/resampled_groups", sum(p.resampled for p in batch), "sum")
    record_metric("rollout/resampled_trajectories", sum(p.resampled_trajectories for p in batch), "sum")
    record_metric("rollout/speculative_trajectories", sum(p.speculative_trajectories for p in batch), "sum")
    record_metric("rollout/speculative_cancelled_early", sum(p.speculative_cancelled_early for p in batch), "sum")
    record_metric("rollout/dropped_groups", sum(p.dropped for p in batch), "sum")
    record_metric("rollout/failed_groups", sum(p.failed for p in batch), "sum")
    for key, name in (("diversity_bonus_mean", "reward/diversity_bonus_mean"),
                      ("semantic_cluster_count", "rollout/semantic_cluster_count")):
        values = [p.bonus[key] for p in batch if key in p.bonus]
        if values:
            record_metric(name, sum(values) / len(values))


def signal_before_filter(first_rewards: list[list[float]], normalization: Normalization) -> dict[str, float]:
    """``optim/raw_reward_std_within_group`` and ``optim/advantage_std_before_filter`` of the first attempts'
    rewards, one list per group (both 0 when there are none: a step whose groups all failed has no signal)."""
    if not first_rewards:
        return {"optim/raw_reward_std_within_group": 0.0, "optim/advantage_std_before_filter": 0.0}
    stds = [0.0 if len(r) < 2 else group_reward_std(r) for r in first_rewards]
    rewards = torch.tensor([r for g in first_rewards for r in g], dtype=torch.float64)  # [N]
    _, m = group_advantages(rewards, group_sizes=[len(g) for g in first_rewards], normalization=normalization)
    return {"optim/raw_reward_std_within_group": sum(stds) / len(stds),
            "optim/advantage_std_before_filter": float(m["advantage_std"])}


def no_signal_warning(batch: list[Produced], step: int, *, preset_hint: bool = True) -> str | None:
    """A one-line diagnosis when no group of the step carries signal because nothing ever succeeds; ``preset_hint``:
    the tiny-sft preset can warm-start this run's environment (the customer-service one), so it is named."""
    if batch and all(p.first_degenerate for p in batch) and not any(p.any_success for p in batch):
        resampled = " (resampled too)" if any(p.resampled for p in batch) else ""
        preset = ", or model.preset: tiny-sft" if preset_hint else ""
        return (f"step {step}: every group is degenerate and no rollout succeeded{resampled}, so there is nothing "
                f"to learn from. Remedy: warm-start the policy (`tether sft`{preset}), use easier tasks, or give "
                "each task more rollouts (policy_optimization.advantage.group_size).")
    return None


class RolloutAllocator:
    """Rollouts per task for ``rollout_allocation.strategy`` (``sizes``), learning from trained groups (``observe``).

    Statistics are kept per task and per task kind: a task not seen yet (with shuffled epochs over hundreds of
    tasks, most tasks of a step are new) takes its kind's variance as its prior, and only a task of an unseen
    kind gets the base count.
    """

    def __init__(self, ra: RolloutAllocationConfig, group_size: int, kinds: dict[str, str] | None = None):
        """``group_size``: what a task of unseen kind gets (``Plan.group_size``)."""
        self.adaptive = ra.strategy == "adaptive"
        self.group_size = group_size
        self.max, self.interval = ra.max_rollouts_per_prompt, ra.reallocation_interval
        self.kinds = kinds or {}  # task id -> kind
        self.window = TaskRewardWindow()
        self.proxies: dict[Hashable, float] = {}  # the statistics in force, re-read every ``interval`` steps

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
