"""MessageQueue: finished groups from the rollouter to the trainer (verl's fully-async ``MessageQueue``).

Bounded by ``max_size`` **groups** (``message_queue.max_queue_size``). ``put`` never blocks: when the
queue is full the **oldest** group is dropped, oldest meaning earliest *started* (lowest ``seq``, hence
the stalest policy; for groups that arrive in start order this is verl's drop-the-head). That may be the
group being put, when it is a straggler older than everything queued. The consumer takes batches in
the order of ``scheduler`` (``fifo`` or ``windowed_fifo``, whose ``max_hold_s`` lets a finished group that has
waited that long past the window; a blocked ``get_batch`` wakes when one comes due). With ``windowed_fifo``, make
``max_size``
at least the admission bound ((max_staleness + 1) · groups_per_step): a queue full of groups outside the
window can only make progress by dropping the in-window groups as they arrive.

Counters are in **samples = trajectories** (a group of 8 counts 8), so that they add up whatever the
group sizes:

    total_produced == total_consumed + dropped_samples + stale_samples + queued_samples

where ``total_consumed`` counts what the trainer took and did not hand back through ``report_stale``.
``check_accounting`` raises with the numbers when that fails.

Thread-safe; ``put``, ``abandon`` and ``get_available`` never block and are safe to call from an event loop;
``get_batch`` blocks the trainer's thread (``timeout=0``: take what is ready, or None, at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tether.pipeline.scheduler import Signal, StartOrder, plan_batch
from tether.pipeline.staleness import oldest_version
from tether.types import Group

_CLOSED = object()  # what an attempt returns when the wait is over because the queue closed


@dataclass(frozen=True)
class QueuedGroup:
    """A finished group with where it stands in the pipeline."""

    group: Group
    seq: int  # start position: the order the rollouter started it (AdmissionController.try_start)
    start_version: int  # parameter version when it started (-1 = unknown)
    finish_time: float = field(default_factory=time.monotonic)  # time.monotonic() when it finished
    produced: Any = None  # the producer's record of how it was made (``shaping.Produced``), if any

    @property
    def num_samples(self) -> int:
        return len(self.group.trajectories)


def _samples(items: Iterable[QueuedGroup | Group]) -> int:
    return sum(len((x if isinstance(x, Group) else x.group).trajectories) for x in items)


class MessageQueue:
    """``MessageQueue(max_size, window_size=None, max_hold_s=None)``; ``window_size=None`` is ``fifo``, an int is
    ``windowed_fifo`` (see ``scheduler.py``; ``scheduler.window_for`` maps the config); ``max_hold_s``: how long
    a finished group may be held outside the window (None: until the window reaches it), counted from its ``put``
    on ``clock`` (the queue's own: under ``backend: ray`` the producer's clock may be another machine's)."""

    def __init__(self, max_size: int, window_size: int | None = None, max_hold_s: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        if max_size < 1:
            raise ValueError(f"message_queue.max_queue_size must be >= 1, got {max_size}")
        if max_hold_s is not None and max_hold_s < 0:
            raise ValueError(f"rollout.scheduler.max_hold_s must be >= 0, got {max_hold_s}")
        self.max_size, self.window_size = max_size, window_size
        self.max_hold_s = max_hold_s if window_size is not None else None  # fifo holds nothing
        self._clock = clock
        self._items: dict[int, QueuedGroup] = {}  # seq -> group, in finish (arrival) order
        self._arrived: dict[int, float] = {}  # seq -> clock() at its put
        self._order = StartOrder()
        self._auto_seq: bool | None = None  # whether put() numbers groups itself (decided by the first put)
        self._next_auto_seq = 0
        self._closed = False
        self._signal = Signal()
        self._produced = self._taken = self._dropped = self._stale = self._queued = 0
        self.dropped_groups = 0

    # ------------------------------------------------------------------ producer side

    def put(self, item: QueuedGroup | Group) -> bool:
        """Enqueue a finished group; never blocks. A bare ``Group`` is numbered in arrival order (then
        ``windowed_fifo`` behaves as ``fifo``) with ``start_version`` its oldest token version.
        Returns False, counting nothing, when the queue is closed."""
        with self._signal.lock:
            if self._closed:
                return False
            auto = isinstance(item, Group)
            if self._auto_seq is None:
                self._auto_seq = auto
            elif self._auto_seq != auto:
                raise ValueError("put() got both bare Groups and QueuedGroups: number every group or none")
            if isinstance(item, Group):  # auto
                v = oldest_version(item)
                item = QueuedGroup(item, self._next_auto_seq, -1 if v is None else v)
                self._next_auto_seq += 1
            if item.seq in self._items or self._order.is_retired(item.seq):
                raise ValueError(f"group with start position {item.seq} put twice")
            self._produced += item.num_samples
            self._items[item.seq] = item
            self._arrived[item.seq] = self._clock()
            self._queued += item.num_samples
            if len(self._items) > self.max_size:
                self._drop(min(self._items))
            self._signal.notify_all()
            return True

    def _drop(self, seq: int) -> None:
        victim = self._items.pop(seq)
        del self._arrived[seq]
        self._order.retire(seq)
        self._queued -= victim.num_samples
        self._dropped += victim.num_samples
        self.dropped_groups += 1

    def abandon(self, seq: int) -> None:
        """Start position ``seq`` will never arrive (its episode failed): retire it so the window moves on."""
        with self._signal.lock:
            if seq in self._items:
                raise ValueError(f"abandon({seq}) of a group that is in the queue")
            self._order.retire(seq)
            self._signal.notify_all()

    def close(self) -> None:
        """No more puts; every waiter wakes (and gets ``None`` unless a whole batch is ready)."""
        with self._signal.lock:
            self._closed = True
            self._signal.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ consumer side

    def _overdue(self) -> set[int]:
        """Queued groups held ``max_hold_s`` or longer: they may be taken past the window."""
        if self.max_hold_s is None:
            return set()
        now = self._clock()
        return {s for s, t in self._arrived.items() if now - t >= self.max_hold_s}

    def _next_due_in(self) -> float | None:
        """Seconds until the next queued group becomes overdue (None: none will; one overdue already may be
        taken now, so it sets no deadline)."""
        if self.max_hold_s is None:
            return None
        now = self._clock()
        waits = [t + self.max_hold_s - now for t in self._arrived.values()]
        future = [w for w in waits if w > 0]
        return min(future) if future else None

    def _take_locked(self, n: int, *, partial: bool = False) -> list[QueuedGroup] | None:
        seqs = plan_batch(list(self._items), self._order, self.window_size, n, self._overdue())
        if len(seqs) < n and not partial:
            return None
        batch = [self._items.pop(s) for s in seqs]
        for s in seqs:
            del self._arrived[s]
        for s in seqs:
            self._order.retire(s)
        got = _samples(batch)
        self._queued -= got
        self._taken += got
        return batch

    def _attempt(self, n: int):
        return self._take_locked(n) or (_CLOSED if self._closed else None)

    def _check_n(self, n: int) -> None:
        if not 1 <= n <= self.max_size:
            raise ValueError(f"a batch of {n} groups from a queue of at most {self.max_size} groups can never "
                             f"be served; make message_queue.max_queue_size >= the groups per batch")

    def get_batch(self, n: int, timeout: float | None = None) -> list[QueuedGroup] | None:
        """Block until ``n`` groups may be taken under the schedule and take them (in consumption order);
        ``None`` on timeout, or when closed with fewer than ``n`` takeable."""
        self._check_n(n)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # with max_hold_s, wake when a held group comes due as well as on a put
            with self._signal.lock:
                due = self._next_due_in()
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            wait = left if due is None else (due if left is None else min(due, left))
            r = self._signal.wait(lambda: self._attempt(n), wait)
            if r is not None:
                return None if r is _CLOSED else r
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def get_available(self) -> list[QueuedGroup]:
        """Every group that may be taken now under the schedule (possibly none); never blocks."""
        with self._signal.lock:
            return self._take_locked(len(self._items), partial=True) or []

    def report_stale(self, groups: Iterable[QueuedGroup | Group]) -> None:
        """The consumer discarded these taken groups as stale (``stale_filter``'s dropped list)."""
        n = _samples(groups)
        with self._signal.lock:
            if self._stale + n > self._taken:
                raise ValueError(f"report_stale of {n} samples, but only {self._taken - self._stale} were taken "
                                 "and not yet reported")
            self._stale += n

    # ------------------------------------------------------------------ counters

    @property
    def total_produced(self) -> int:
        return self._produced

    @property
    def total_consumed(self) -> int:
        with self._signal.lock:
            return self._taken - self._stale

    @property
    def dropped_samples(self) -> int:
        return self._dropped

    @property
    def stale_samples(self) -> int:
        return self._stale

    @property
    def queued_samples(self) -> int:
        return self._queued

    def __len__(self) -> int:
        """Groups in the queue."""
        return len(self._items)

    def metrics(self) -> dict[str, float]:
        with self._signal.lock:
            return {"queue/total_produced": float(self._produced),
                    "queue/total_consumed": float(self._taken - self._stale),
                    "queue/dropped_samples": float(self._dropped),
                    "queue/stale_samples": float(self._stale),
                    "queue/size": float(len(self._items)),
                    "queue/queued_samples": float(self._queued)}

    def check_accounting(self) -> None:
        """Raise ``AssertionError`` with the numbers unless produced = consumed + dropped + stale + queued."""
        with self._signal.lock:
            p, c, d, s = self._produced, self._taken - self._stale, self._dropped, self._stale
            q, q_items = self._queued, _samples(self._items.values())
        if p != c + d + s + q or q != q_items:
            raise AssertionError(f"queue accounting broken: produced {p} != consumed {c} + dropped {d} + "
                                 f"stale {s} + queued {q} (= {c + d + s + q}; samples actually queued {q_items})")
