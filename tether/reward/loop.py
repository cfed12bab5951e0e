"""The reward loop: rubrics scored by a pool of async workers as trajectories finish, off the generation path.

    episode ends ──▶ env: rule checks now (synchronous, cheap) ──▶ Trajectory(reward = rule part,
                                                                   pending_judge = rubrics + JudgeView)
    Rollouter: the episode's slot is free ──▶ RewardLoop.score(traj): one job per rubric, at most ``workers``
    in flight, each through the cache, then the judge (its endpoint's token buckets and concurrency cap)
    ──▶ reward += Σ weight · score ──▶ the group is settled (``settle``) when all of its trajectories are in

Generation is not held up: an episode hands its rubrics to the loop and its slot (``max_concurrent_tasks``)
to the next episode, so the engine keeps decoding while the judge answers; only the group waits for its own
scores (its advantages need them). verl's Reward Loop computes rewards in reward workers the same way; its
``LimitedRewardManager`` / ``AsyncTokenBucket`` are the client's per-endpoint buckets here (``tether.llm``).

**Failures are never a silent 0.** A judge failure — a timeout, an HTTP error left after the client's retries
(500s, 429s), an unparseable answer — is written to the trajectory's ``errors`` and ``pending_judge.failed``
and counted (``reward/judge_failures``, and by cause ``reward/judge_failures/<timeout|http|unparseable|other>``).
``settle(group)`` then applies ``reward.on_judge_failure`` to the group that holds it: ``drop_group`` (the
caller delivers it marked dropped; ``reward/judge_dropped_groups``) or ``rule_only`` (every trajectory of the
group loses its rubric scores, so all are compared on the rule checks; ``reward/rule_only_groups``).

Cache: judge results keyed by the rendered prompt — rubric and trajectory content — and the judge's identity
(``rubrics.cache_key``), least recently used evicted past ``cache_size``; failures are not cached. Metrics:
``reward/judge_requests``, ``reward/judge_cache_hits``, ``reward/judge_latency_s`` (per trajectory, mean).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tether.env.verifier import JudgeView, PendingRubrics
from tether.llm import LLMError, LLMTimeout
from tether.metrics import record_metric
from tether.reward.judge_llm import LLMJudge
from tether.reward.rubrics import UnparseableJudgeAnswer, cache_key, render
from tether.types import Trajectory

Policy = Literal["drop_group", "rule_only"]


class AsyncJudge(Protocol):
    @property
    def identity(self) -> str:
        """What, besides the prompt, decides the answer (part of the cache key)."""
        ...

    async def score(self, prompt: str, rubric: str) -> float: ...


def failure_cause(error: BaseException) -> str:
    if isinstance(error, (LLMTimeout, TimeoutError)):
        return "timeout"
    if isinstance(error, UnparseableJudgeAnswer):
        return "unparseable"
    if isinstance(error, LLMError):
        return "http"
    return "other"


@dataclass
class RewardLoopStats:
    """Counters of one reward loop (tests and benchmarks read them; the metrics carry the same)."""

    jobs: int = 0  # rubric scorings asked for
    requests: int = 0  # judge calls made (cache misses)
    cache_hits: int = 0
    failures: int = 0
    dropped_groups: int = 0
    rule_only_groups: int = 0


class RewardLoop:
    def __init__(self, judge: AsyncJudge, *, workers: int = 32, cache_size: int = 4096,
                 on_failure: Policy = "drop_group"):
        if workers < 1:
            raise ValueError(f"reward.workers must be >= 1, got {workers}")
        if on_failure not in ("drop_group", "rule_only"):
            raise ValueError(f"reward.on_judge_failure must be 'drop_group' or 'rule_only', got {on_failure!r}")
        self.judge, self.workers, self.cache_size, self.on_failure = judge, workers, cache_size, on_failure
        self.stats = RewardLoopStats()
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()  # the cache and stats are shared by the rollouter's and evaluator's threads
        self._sems: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    @classmethod
    def from_config(cls, cfg: Any) -> RewardLoop | None:
        """The loop of a ``RunConfig``; None when no rubric is left to a judge (``verifier.judge: deterministic``,
        or ``verifier.type: rule``)."""
        v = cfg.environment.verifier
        if v.judge != "llm" or v.type == "rule" or not v.model_based:
            return None
        r = cfg.reward
        return cls(LLMJudge.from_config(r), workers=r.workers, cache_size=r.cache_size, on_failure=r.on_judge_failure)

    # -- one trajectory ------------------------------------------------------------------------------------
    async def score(self, traj: Trajectory) -> Trajectory:
        """Score ``traj``'s pending rubrics (in place) and return it; a failure is recorded, not raised."""
        pending: PendingRubrics | None = traj.pending_judge
        if pending is None or pending.scored or pending.failed:
            return traj
        t = time.perf_counter()
        results = await asyncio.gather(*(self._job(name, template, pending.view)
                                         for name, _, template in pending.rubrics), return_exceptions=True)
        for (name, weight, _), result in zip(pending.rubrics, results):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancellation, interrupts: not the judge's failure
                cause = failure_cause(result)
                pending.failed[name] = f"{cause}: {result}"
                traj.errors.append(f"judge {name} ({cause}): {result}")
                self._count("failures")
                record_metric(f"reward/judge_failures/{cause}", 1, "sum")
            else:
                pending.scored[name] = result
                traj.reward_components[name] = result
                traj.reward += weight * result
        traj.reward = round(traj.reward, 9)
        record_metric("reward/judge_failures", len(pending.failed), "sum")
        record_metric("reward/judge_latency_s", time.perf_counter() - t)
        return traj

    async def _job(self, name: str, template: str, view: JudgeView) -> float:
        prompt = render(template, view)
        key = cache_key(prompt, self.judge.identity) if self.cache_size else ""
        self._count("jobs")
        if key:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    self.stats.cache_hits += 1
            if hit is not None:
                record_metric("reward/judge_cache_hits", 1, "sum")
                return hit
        async with self._slot():
            self._count("requests")
            record_metric("reward/judge_requests", 1, "sum")
            score = await self.judge.score(prompt, name)
        if not 0.0 <= score <= 1.0:
            raise UnparseableJudgeAnswer(f"judge score {score} for rubric {name!r} is outside [0, 1]")
        if key:
            with self._lock:
                self._cache[key] = score
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return score

    def _slot(self) -> asyncio.Semaphore:
        """The worker pool: ``workers`` jobs at once per event loop (sync mode runs one loop per step)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if loop not in self._sems:
                self._sems = {lp: s for lp, s in self._sems.items() if not lp.is_closed()}
                self._sems[loop] = asyncio.Semaphore(self.workers)
            return self._sems[loop]

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    # -- one group -----------------------------------------------------------------------------------------
    def settle(self, trajectories: list[Trajectory], policy: Policy | None = None) -> bool:
        """Apply the failure policy to one group once all of it is scored; True when it must be dropped.
        ``policy`` overrides ``on_failure`` (evaluation has no group to drop: it asks for ``rule_only``)."""
        policy = policy or self.on_failure
        pendings = [t.pending_judge for t in trajectories if t.pending_judge is not None]
        failed = any(p.failed for p in pendings)
        if failed:
            for t in trajectories:
                p = t.pending_judge
                if p is None:
                    continue
                for name, weight, _ in p.rubrics:
                    if name in p.scored:
                        t.reward -= weight * p.scored[name]
                    t.reward_components.pop(name, None)
                t.reward = round(t.reward, 9)
            name = "dropped_groups" if policy == "drop_group" else "rule_only_groups"
            self._count(name)
            record_metric("reward/judge_dropped_groups" if policy == "drop_group" else "reward/rule_only_groups", 1,
                          "sum")
        return failed and policy == "drop_group"
