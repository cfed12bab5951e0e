"""ReplayBuffer: finished groups of the partial-rollout path, taken by freshness and diversity (``buffer``).

Capacity ``rollout.partial_rollout.replay_buffer_size`` groups. Every group is used once: ``sample``
removes what it returns (AReaL's rule; Meta's replay paper reuses samples, tether does not).

**Priority** (``type: priority``) of a group at the buffer's current parameter version v:

    priority = freshness_weight · freshness + diversity_weight · diversity
    freshness = 1 / (1 + lag)              lag = v − oldest model-token version (``staleness.policy_lag``)
    diversity = pstdev(rewards) / ((max(rewards) − min(rewards)) / 2)      0 when all rewards are equal

- freshness: hyperbolic, not FreshPER's exp(−age/τ) (arXiv 2604.16918). Lags 0, 1, 2, 3 give 1, 1/2,
  1/3, 1/4: a group still admissible under ``stale_filter.max_policy_lag: 3`` keeps a quarter of the
  weight (exp(−3) would leave 5%), so freshness stays on the same [0, 1] scale as diversity over the
  lags that matter. A group without model tokens uses its ``start_version``; lag below 0 counts as 0.
- diversity: the reward spread of the group, normalised by the largest population std any group with
  the same min and max can have (Popoviciu's inequality: σ ≤ (max − min)/2), so it lies in [0, 1]:
  0 for a degenerate group (every reward equal: zero group-relative advantage, no learning signal,
  the groups DAPO's dynamic sampling throws away), 1 for an even split between two values, √3/2 for
  one success among four. Scale-free, as GRPO's std-normalised advantages are.

**Sampling** is proportional to priority without replacement (prioritized replay, Schaul et al. 2016,
with α = 1), done by Efraimidis–Spirakis weighted sampling with the seeded RNG: key = u^(1/p), the n
largest keys win. Top-k was rejected: priority is mostly freshness, so top-k becomes last-in-first-out
and older groups would only ever leave by eviction, i.e. as wasted rollouts. Groups of priority 0 are
taken only when nothing else is left, oldest first. ``type: fifo`` takes and evicts oldest-inserted first.

**Eviction** when an ``add`` makes the buffer exceed its capacity: the lowest-priority group (ties:
oldest inserted) for ``priority``, the oldest inserted for ``fifo``; possibly the group just added.
``evicted`` counts groups.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Literal

from tether.pipeline.queue import QueuedGroup
from tether.pipeline.scheduler import Signal
from tether.pipeline.staleness import policy_lag
from tether.types import Group

_CLOSED = object()


def freshness(lag: int) -> float:
    return 1.0 / (1.0 + max(lag, 0))


def diversity(group: Group) -> float:
    rewards = group.rewards
    spread = max(rewards) - min(rewards) if rewards else 0.0
    if len(rewards) < 2 or spread == 0:
        return 0.0
    return min(statistics.pstdev(rewards) / (spread / 2), 1.0)  # min: float rounding only


def group_lag(record: QueuedGroup, current_version: int) -> int:
    lag = policy_lag(record.group, current_version)
    if lag is None:
        lag = current_version - record.start_version if record.start_version >= 0 else 0
    return max(lag, 0)


def priority(record: QueuedGroup, current_version: int, freshness_weight: float, diversity_weight: float) -> float:
    return (freshness_weight * freshness(group_lag(record, current_version))
            + diversity_weight * diversity(record.group))


class ReplayBuffer:
    def __init__(self, capacity: int, type: Literal["fifo", "priority"] = "priority", freshness_weight: float = 0.7,
                 diversity_weight: float = 0.3, seed: int = 0, *, version: int = 0):
        if capacity < 1:
            raise ValueError(f"rollout.partial_rollout.replay_buffer_size must be >= 1, got {capacity}")
        if type not in ("fifo", "priority"):
            raise ValueError(f"buffer.type must be 'fifo' or 'priority', got {type!r}")
        if freshness_weight < 0 or diversity_weight < 0:
            raise ValueError(f"buffer weights must be >= 0, got freshness {freshness_weight}, "
                             f"diversity {diversity_weight}")
        self.capacity, self.type = capacity, type
        self.freshness_weight, self.diversity_weight = freshness_weight, diversity_weight
        self._rng = random.Random(seed)
        self._version = version
        self._items: list[tuple[int, QueuedGroup]] = []  # (insertion number, record), oldest first
        self._inserted = 0
        self.evicted = 0
        self._closed = False
        self._signal = Signal()

    def priority(self, record: QueuedGroup) -> float:
        """Priority of ``record`` at the buffer's current version."""
        return priority(record, self._version, self.freshness_weight, self.diversity_weight)

    def on_version(self, version: int) -> None:
        """The trainer's parameter version, which freshness is measured against."""
        with self._signal.lock:
            if version < self._version:
                raise ValueError(f"parameter version went back from {self._version} to {version}")
            self._version = version

    @property
    def version(self) -> int:
        return self._version

    def add(self, record: QueuedGroup) -> list[QueuedGroup]:
        """Insert a finished group; returns what was evicted to make room (possibly ``record`` itself)."""
        with self._signal.lock:
            if self._closed:
                raise RuntimeError("add() to a closed ReplayBuffer")
            self._items.append((self._inserted, record))
            self._inserted += 1
            evicted = []
            while len(self._items) > self.capacity:
                if self.type == "fifo":
                    victim = 0
                else:  # min priority; min() keeps the first (oldest) of equal ones
                    victim = min(range(len(self._items)), key=lambda i: self.priority(self._items[i][1]))
                evicted.append(self._items.pop(victim)[1])
                self.evicted += 1
            self._signal.notify_all()
            return evicted

    def _sample_locked(self, n: int) -> list[QueuedGroup]:
        n = min(n, len(self._items))
        if self.type == "fifo":
            chosen = list(range(n))
        else:  # Efraimidis–Spirakis: key log(u)/p = log(u^(1/p)); p = 0 → -inf, ranked by insertion
            keys = []
            for i, (_, rec) in enumerate(self._items):
                p, u = self.priority(rec), 1.0 - self._rng.random()  # u in (0, 1]
                keys.append((math.log(u) / p if p > 0 else -math.inf, -i))
            chosen = sorted(range(len(keys)), key=lambda i: keys[i], reverse=True)[:n]
        out = [self._items[i][1] for i in chosen]
        for i in sorted(chosen, reverse=True):
            del self._items[i]
        return out

    def sample(self, n: int) -> list[QueuedGroup]:
        """Take up to ``n`` groups now (fewer when the buffer holds fewer); never blocks."""
        with self._signal.lock:
            return self._sample_locked(n)

    def _attempt(self, n: int):
        if len(self._items) >= n:
            return self._sample_locked(n)
        return _CLOSED if self._closed else None

    def wait_sample(self, n: int, timeout: float | None = None) -> list[QueuedGroup] | None:
        """Block until ``n`` groups are in the buffer and take them; ``None`` on timeout, or when closed
        with fewer than ``n``."""
        if not 1 <= n <= self.capacity:
            raise ValueError(f"cannot wait for {n} groups in a buffer of capacity {self.capacity}")
        r = self._signal.wait(lambda: self._attempt(n), timeout)
        return None if r is _CLOSED else r

    async def wait_sample_async(self, n: int, timeout: float | None = None) -> list[QueuedGroup] | None:
        if not 1 <= n <= self.capacity:
            raise ValueError(f"cannot wait for {n} groups in a buffer of capacity {self.capacity}")
        r = await self._signal.wait_async(lambda: self._attempt(n), timeout)
        return None if r is _CLOSED else r

    def close(self) -> None:
        with self._signal.lock:
            self._closed = True
            self._signal.notify_all()

    def __len__(self) -> int:
        return len(self._items)

    def priorities(self) -> list[float]:
        """Priorities of the buffered groups, oldest inserted first."""
        with self._signal.lock:
            return [self.priority(rec) for _, rec in self._items]

    def metrics(self) -> dict[str, float]:
        ps = self.priorities()
        return {"buffer/size": float(len(ps)), "buffer/evicted": float(self.evicted),
                "buffer/priority_mean": sum(ps) / len(ps) if ps else 0.0}
