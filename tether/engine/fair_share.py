"""Fair admission across request groups: who gets the engine's next slot, and whom to interrupt for it.

A group is what one caller asked for at once (``tether serve``: the ``n`` choices of one HTTP request); a request
without a group is a group of its own. First come, first served lets one caller's many long requests hold every slot
while a later caller's short request waits behind them (issue 29's load test: 32 abandoned ``n=32`` requests made an
8-token request wait up to a second). Here, as in vLLM's and SGLang's fair schedulers:

- the next request admitted is the first queued one of the group that has the fewest running requests (arrival
  order among equals, so requests of distinct groups, as rollouts' are, are admitted first come, first served);
- when every slot is taken and a queued group runs fewer than its share (``max_batch`` ÷ the groups running or
  queued, at least 1), running requests of the groups furthest above their share are interrupted: their caches are
  parked, they go back to the front of the queue keeping their tokens, and resume where they stopped (from the
  parked cache, so only the last token is computed again when it is still there).

A group at or below its share is never interrupted, and an interrupted request's group is then still at or above
its share, so nothing is interrupted back and forth.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any


def share(groups: int, max_batch: int) -> int:
    """Slots a group is entitled to when ``groups`` groups compete for ``max_batch``."""
    return max(1, max_batch // max(1, groups))


def next_index(queue: Sequence[Any], running: Counter) -> int:
    """Index in ``queue`` (objects with ``group``) of the next request to admit, given ``running``: group → running
    requests."""
    best, fewest = 0, None
    seen: set[Any] = set()
    for i, req in enumerate(queue):
        if req.group in seen:
            continue
        seen.add(req.group)
        count = running.get(req.group, 0)
        if fewest is None or count < fewest:
            best, fewest = i, count
            if count == 0:  # nobody runs fewer
                break
    return best


def victims(queue: Sequence[Any], running: Sequence[Any], max_batch: int) -> list[Any]:
    """Running requests to interrupt so that the queued groups below their share get slots (none while a slot is
    free for each of them); the most recently admitted of a group first."""
    counts = Counter(r.group for r in running)
    if not queue or not counts or max(counts.values()) <= 1:
        return []
    groups = set(counts) | {r.group for r in queue if not r.cancelled}
    fair = share(len(groups), max_batch)
    wanting: Counter = Counter()  # more slots each queued group would take, up to its share
    for r in queue:
        if not r.cancelled and counts[r.group] + wanting[r.group] < fair:
            wanting[r.group] += 1
    need = sum(wanting.values()) - (max_batch - len(running))
    out: list[Any] = []
    order = list(reversed(running))  # the most recently admitted first
    while need > 0:
        group, most = counts.most_common(1)[0]
        if most <= fair:
            break
        victim = next(r for r in order if r.group == group and r not in out)
        out.append(victim)
        counts[group] -= 1
        need -= 1
    return out
