"""ReplayBuffer: finished groups of the partial-rollout path, taken by freshness and diversity (``buffer``).

Capacity ``rollout.partial_rollout.replay_buffer_size`` groups. Every group is used once: ``take``
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

**Taking**: ``type: priority`` takes the highest-priority groups first (ties: oldest inserted); the rest
wait in the buffer and age, so their freshness falls at every version until they are taken, become stale
(``remove_stale``, counted as stale by the consumer) or are evicted. ``type: fifo`` takes and evicts the
oldest inserted first. (An earlier version sampled ∝ priority; the config's promise is "the trainer takes
the highest priority first", and deterministic top-k is what a user can reason about. Top-k leans towards
the freshest groups; the older ones then leave by eviction or by the stale filter, both counted.)

**Eviction** when an ``add`` makes the buffer exceed its capacity: the lowest-priority group (ties:
oldest inserted) for ``priority``, the oldest inserted for ``fifo``; possibly the group just added.
``evicted`` counts groups, ``evicted_samples`` trajectories (the consumer adds them to the queue's
dropped samples, so that produced = consumed + dropped + stale + queued still holds).

Used from the trainer's thread only (the async source moves finished groups from the MessageQueue into it
at every take), so it needs no lock.
"""

from __future__ import annotations

import statistics
from typing import Literal

from tether.pipeline.queue import QueuedGroup
from tether.pipeline.staleness import policy_lag
from tether.types import Group


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
                 diversity_weight: float = 0.3, *, version: int = 0):
        if capacity < 1:
            raise ValueError(f"rollout.partial_rollout.replay_buffer_size must be >= 1, got {capacity}")
        if type not in ("fifo", "priority"):
            raise ValueError(f"buffer.type must be 'fifo' or 'priority', got {type!r}")
        if freshness_weight < 0 or diversity_weight < 0:
            raise ValueError(f"buffer weights must be >= 0, got freshness {freshness_weight}, "
                             f"diversity {diversity_weight}")
        self.capacity, self.type = capacity, type
        self.freshness_weight, self.diversity_weight = freshness_weight, diversity_weight
        self._version = version
        self._items: list[tuple[int, QueuedGroup]] = []  # (insertion number, record), oldest first
        self._inserted = 0
        self.evicted = self.evicted_samples = 0

    def priority(self, record: QueuedGroup) -> float:
        """Priority of ``record`` at the buffer's current version."""
        return priority(record, self._version, self.freshness_weight, self.diversity_weight)

    def on_version(self, version: int) -> None:
        """The parameter version freshness is measured against (a ``WeightSync`` subscriber)."""
        if version < self._version:
            raise ValueError(f"parameter version went back from {self._version} to {version}")
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def _order(self) -> list[int]:
        """Indices of the held groups, first to be taken first."""
        if self.type == "fifo":
            return list(range(len(self._items)))
        return sorted(range(len(self._items)), key=lambda i: (-self.priority(self._items[i][1]), i))

    def add(self, record: QueuedGroup) -> list[QueuedGroup]:
        """Insert a finished group; returns what was evicted to make room (possibly ``record`` itself)."""
        self._items.append((self._inserted, record))
        self._inserted += 1
        evicted = []
        while len(self._items) > self.capacity:
            victim = 0 if self.type == "fifo" else min(  # lowest priority; the oldest of equal ones
                range(len(self._items)), key=lambda i: (self.priority(self._items[i][1]), i))
            evicted.append(self._items.pop(victim)[1])
            self.evicted += 1
            self.evicted_samples += evicted[-1].num_samples
        return evicted

    def take(self, n: int) -> list[QueuedGroup]:
        """Take up to ``n`` groups now (fewer when the buffer holds fewer): highest priority / oldest first."""
        chosen = self._order()[:n]
        out = [self._items[i][1] for i in chosen]
        for i in sorted(chosen, reverse=True):
            del self._items[i]
        return out

    def remove_stale(self, max_policy_lag: int) -> list[QueuedGroup]:
        """Remove and return the held groups whose policy lag now exceeds ``max_policy_lag``."""
        stale = [rec for _, rec in self._items if (lag := policy_lag(rec.group, self._version)) is not None
                 and lag > max_policy_lag]
        self._items = [(k, rec) for k, rec in self._items if not any(rec is s for s in stale)]
        return stale

    def __len__(self) -> int:
        return len(self._items)

    @property
    def held_samples(self) -> int:
        return sum(rec.num_samples for _, rec in self._items)

    def priorities(self) -> list[float]:
        """Priorities of the buffered groups, oldest inserted first."""
        return [self.priority(rec) for _, rec in self._items]

    def metrics(self) -> dict[str, float]:
        ps = self.priorities()
        return {"buffer/size": float(len(ps)), "buffer/evicted": float(self.evicted),
                "buffer/priority_mean": sum(ps) / len(ps) if ps else 0.0}
