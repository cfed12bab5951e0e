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

Fair shares keep a small request from waiting behind large ones, but not from running beside them: its decode steps
are those of the whole batch. On issue 29's load test (2 CPU cores, 32 clients abandoning ``n=32`` requests) a
step of 30-64 rows took 50-200 ms, most of it the prefill of newly admitted large groups' rows, where a step of a
few rows takes 3-8 ms: an 8-token request took up to 0.9 s. So, optionally (``latency_rows``, ``tether serve
--latency-rows``), a latency cap: a group of at most ``rows`` requests (one chat request's ``n`` choices) is small;
while a small group has a request queued or running, the groups of more than ``rows`` requests (large) hold at most
``rows`` rows together, the rest parked as above (most recently admitted first, from the group holding most) and
admitted again when no small group is left, ``rows`` a step: a small request ending just before the next one comes
(one client's requests one after another) would otherwise let the large groups fill the batch in one step whose
prefill the next small request waits for (measured: 90 ms of a 125 ms wait), then be parked again. Large groups
trade throughput for the small requests' latency, as with vLLM's priority scheduling, but are never starved: they
keep ``rows`` rows. Requests without a group (rollouts) are neither small nor large: never capped, admitted first
come, first served as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from itertools import chain
from typing import Any


def share(groups: int, max_batch: int) -> int:
    """Slots a group is entitled to when ``groups`` groups compete for ``max_batch``."""
    return max(1, max_batch // max(1, groups))


def next_index(queue: Sequence[Any], running: Counter, blocked: Collection[Any] = ()) -> int:
    """Index in ``queue`` (objects with ``group``) of the next request to admit, given ``running``: group → running
    requests; requests of the ``blocked`` groups are passed over (-1 when only they are left)."""
    best, fewest = -1, None
    seen: set[Any] = set()
    for i, req in enumerate(queue):
        if req.group in seen or req.group in blocked:
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


NO_CAP: tuple[frozenset[Any], bool] = (frozenset(), False)  # ``large_groups`` without a latency cap


def large_groups(queue: Sequence[Any], running: Sequence[Any], rows: int) -> tuple[frozenset[Any], bool]:
    """(the large groups: of more than ``rows`` requests queued or running, cancelled ones not counted; whether a
    small group, of at most ``rows``, has one: the cap is on). A request without a group is its own group (``group
    is`` the request): neither small nor large."""
    sizes = Counter(r.group for r in chain(running, queue) if r.group is not r and not r.cancelled)
    return frozenset(g for g, n in sizes.items() if n > rows), any(n <= rows for n in sizes.values())


def over_cap(running: Sequence[Any], large: Collection[Any], rows: int) -> list[Any]:
    """The running requests of the ``large`` groups beyond the ``rows`` they may hold together: taken one at a time
    from the group holding most, its most recently admitted first."""
    held = Counter(r.group for r in running if r.group in large)
    need = sum(held.values()) - rows
    if need <= 0:
        return []
    latest: dict[Any, list[Any]] = {}  # group -> its running requests, the most recently admitted first
    for r in reversed(running):
        if r.group in held:
            latest.setdefault(r.group, []).append(r)
    out = []
    for _ in range(need):
        group = held.most_common(1)[0][0]
        out.append(latest[group][len(latest[group]) - held[group]])
        held[group] -= 1
    return out
