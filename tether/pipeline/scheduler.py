"""Consumption order of finished groups (``rollout.scheduler.type``), and the wait primitive of the pipeline.

Every group gets a **start sequence number** ``seq`` (0, 1, 2, … in the order the rollouter started it;
``AdmissionController.try_start`` hands them out). Groups finish out of order (long episodes, tool
latency), so the consumer has to choose among the *finished, not yet consumed* groups. A start position is
**retired** once its group has left the pipeline for good: taken by the consumer, dropped by the full
queue, or abandoned by the rollouter (an episode that failed and will never arrive).
``oldest_unconsumed`` is the smallest start position not yet retired.

- ``fifo``: finished groups are taken in finish order (first finished, first consumed), whatever their
  start position. Reordering relative to start order is unbounded: a straggler may wait forever
  behind fast groups (and then goes stale).
- ``windowed_fifo(window_size = W)``: the *window* is the W start positions
  ``[oldest_unconsumed, oldest_unconsumed + W)``. Only finished groups inside the window may be taken,
  and among those finish order holds. Finished work inside the window is not held up by a slower group
  inside it, while nothing started W or more positions after the oldest unconsumed group can overtake
  it (bounded reordering). Taking the oldest group slides the window, also within one batch
  (``plan_batch``). W = 1 is strict start order; W = ∞ is ``fifo``.
- ``max_hold_s`` (``windowed_fifo`` only; None = no limit): a finished group outside the window that has waited
  ``max_hold_s`` seconds since it finished is *overdue* and may be taken past the window, in finish order with
  the others. So the bound reads: nothing started W or more positions after the oldest unconsumed group
  overtakes it unless it has already waited ``max_hold_s``. Why: a group whose episodes wait on slow tools can
  hold the window for many steps, and then the trainer starves with finished groups in the queue (measured on
  ``benchmarks/async_vs_sync.py``: ten finished groups held while the trainer waited) — and a held group keeps
  its admission slot (``staleness.AdmissionController`` counts it until the trainer's version moves on), so
  fewer groups are generated, too. The hold bounds both; the straggler itself is never skipped: it is taken as
  soon as it finishes, being the oldest.

The phrase "windowed FIFO" comes from the seed config; no system in reference/notes/async.md uses it.
The closest is AReaL's oldest-first draining inside its admission window of (η + 1)·B groups.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Literal, TypeVar

T = TypeVar("T")

SchedulerType = Literal["fifo", "windowed_fifo"]


def window_for(type: SchedulerType, window_size: int) -> int | None:
    """The window of ``rollout.scheduler``: ``None`` (unbounded) for ``fifo``."""
    if type == "fifo":
        return None
    if type == "windowed_fifo":
        if window_size < 1:
            raise ValueError(f"rollout.scheduler.window_size must be >= 1, got {window_size}")
        return window_size
    raise ValueError(f"rollout.scheduler.type must be 'fifo' or 'windowed_fifo', got {type!r}")


def select(pending_finished: Sequence[int], oldest_unconsumed_seq: int, window_size: int | None,
           n: int, overdue: Collection[int] = ()) -> list[int]:
    """Up to ``n`` start positions to consume now, in consumption order, with the window held fixed.

    ``pending_finished``: start positions of the finished, unconsumed groups, in finish order.
    Returns the first ``n`` of them that lie in ``[oldest_unconsumed_seq, oldest_unconsumed_seq +
    window_size)`` or in ``overdue`` (held ``max_hold_s`` already); every one when ``window_size`` is None
    (``fifo``).
    """
    if window_size is None:
        return list(pending_finished[:n])
    limit = oldest_unconsumed_seq + window_size
    return [s for s in pending_finished if s < limit or s in overdue][:n]


class StartOrder:
    """Which start positions are retired; ``oldest_unconsumed`` is the smallest one that is not.

    Not thread-safe: its owner calls it under its own lock. Memory is bounded by the reordering: only
    retired positions above ``oldest_unconsumed`` are stored.
    """

    def __init__(self, first_seq: int = 0):
        self.oldest_unconsumed = first_seq
        self._retired_above: set[int] = set()

    def is_retired(self, seq: int) -> bool:
        return seq < self.oldest_unconsumed or seq in self._retired_above

    def retire(self, seq: int) -> None:
        if self.is_retired(seq):
            raise ValueError(f"start position {seq} retired twice (put, taken, dropped or abandoned before)")
        self._retired_above.add(seq)
        self.oldest_unconsumed = self.oldest_after(())
        self._retired_above = {s for s in self._retired_above if s > self.oldest_unconsumed}

    def oldest_after(self, also_retired: Iterable[int]) -> int:
        """``oldest_unconsumed`` as it would be if ``also_retired`` were retired too (nothing changes)."""
        gone = self._retired_above.union(also_retired)
        s = self.oldest_unconsumed
        while s in gone:
            s += 1
        return s


def plan_batch(pending_finished: Sequence[int], order: StartOrder, window_size: int | None, n: int,
               overdue: Collection[int] = ()) -> list[int]:
    """Up to ``n`` start positions for one batch, letting the window slide as the batch takes its oldest.

    Repeats ``select`` on what is left, treating the positions chosen so far as retired, until ``n`` are
    chosen or nothing more fits. ``overdue``: positions that may be taken past the window (``select``).
    ``order`` is not changed.
    """
    chosen: list[int] = []
    while len(chosen) < n:
        taken = set(chosen)
        rest = [s for s in pending_finished if s not in taken]
        more = select(rest, order.oldest_after(chosen), window_size, n - len(chosen), overdue)
        if not more:
            break
        chosen += more
    return chosen


# ----------------------------------------------------------------------------- waiting


class Signal:
    """A ``threading.Condition`` that also wakes asyncio tasks, so one object can be waited on from the
    trainer thread (``wait``) and from the rollouter's event loop (``wait_async``) without polling.

    ``attempt`` is called with the lock held and returns ``None`` to keep waiting or the result to
    return; state changes happen under ``with signal.lock:`` followed by ``signal.notify_all()``.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def notify_all(self) -> None:
        """Wake every waiter. Call with ``lock`` held."""
        self._cond.notify_all()
        futures, self._futures = self._futures, []
        for loop, fut in futures:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that event loop is closed; nobody is waiting on it any more
                pass

    def wait(self, attempt: Callable[[], T | None], timeout: float | None) -> T | None:
        """Block until ``attempt()`` returns a result; ``None`` after ``timeout`` seconds (None = forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                result = attempt()
                if result is not None:
                    return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    async def wait_async(self, attempt: Callable[[], T | None], timeout: float | None) -> T | None:
        """``wait`` for coroutines: suspends the task, not the event loop. Cancelling it takes nothing."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self.lock:  # held only for short critical sections, never across a wait
                result = attempt()
                if result is not None:
                    return result
                fut = loop.create_future()
                self._futures.append((loop, fut))
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                with self.lock:
                    return attempt()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
