"""Limits shared by every client of one endpoint: a concurrency cap and request and token buckets.

A provider's limits are per key and endpoint, not per Python object: the rollout workers, the judge and
``tether ping`` in one process must share them. So the limits live in a module-level registry keyed by
``(base_url, model)`` (``limits_for``), and each ``LLMClient`` of that endpoint draws from the same
``EndpointLimits``. When two clients ask for different values, the stricter one applies to both (a smaller cap,
a lower rate); a limit only one of them sets applies to both.

The primitives are thread-safe and work across event loops (a ``threading.Lock`` guards the state; a waiter is
woken on its own loop with ``call_soon_threadsafe``), because tether runs rollout workers in threads, each with
its own loop, and a Ray actor may run its own.

Token bucket (``TokenBucket``): ``per_minute`` units refill continuously; the burst is one second of the rate
(at least 1 unit) so a restart does not fire a minute's quota at once. A request reserves its units up front
and may take the bucket below zero; it then waits until the debt is repaid. So request k of a burst starts
``max(0, k - burst) / rate`` seconds after the first, a request larger than the burst is admitted instead of
starving, and the average rate holds. Tokens spent are corrected after the answer from ``usage`` (``refund``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass


class TokenBucket:
    """``per_minute`` units per minute, burst of one second's worth (at least 1); see the module docstring."""

    def __init__(self, per_minute: float, burst: float | None = None):
        if per_minute <= 0:
            raise ValueError(f"per_minute must be > 0, got {per_minute}")
        self._lock = threading.Lock()
        self._set(per_minute, burst)
        self._level = self.capacity
        self._t = time.monotonic()

    def _set(self, per_minute: float, burst: float | None) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60.0  # units per second
        self.capacity = burst if burst is not None else max(1.0, self.rate)

    def tighten(self, per_minute: float) -> None:
        with self._lock:
            if per_minute < self.per_minute:
                self._set(per_minute, None)
                self._level = min(self._level, self.capacity)

    def reserve(self, n: float = 1.0) -> float:
        """Take ``n`` units now (possibly into debt); the seconds to wait before using them."""
        with self._lock:
            now = time.monotonic()
            self._level = min(self.capacity, self._level + (now - self._t) * self.rate)
            self._t = now
            self._level -= n
            return 0.0 if self._level >= 0 else -self._level / self.rate

    def refund(self, n: float) -> None:
        """Give back ``n`` units (negative: charge more), e.g. the estimate less the tokens used."""
        with self._lock:
            self._level = min(self.capacity, self._level + n)

    async def acquire(self, n: float = 1.0) -> float:
        """Wait for ``n`` units; the seconds waited. A cancelled wait gives its units back."""
        wait = self.reserve(n)
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:
                self.refund(n)
                raise
        return wait


class SharedGate:
    """A counting semaphore usable from any thread and event loop, first come first served."""

    def __init__(self, cap: int):
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        self.cap = cap
        self._held = 0
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._held

    def tighten(self, cap: int) -> None:
        with self._lock:
            self.cap = min(self.cap, cap)  # slots held above the new cap drain as they are released

    async def acquire(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._held < self.cap and not self._waiters:
                self._held += 1
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, fut))
        try:
            await fut
        except asyncio.CancelledError:
            with self._lock:
                try:
                    self._waiters.remove((loop, fut))
                    queued = True
                except ValueError:
                    queued = False
            if not queued and fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just before the cancellation landed
            raise  # (a slot handed to an already cancelled future is passed on by _hand)

    def release(self) -> None:
        while True:
            with self._lock:
                if not self._waiters or self._held > self.cap:
                    self._held -= 1
                    return
                loop, fut = self._waiters.popleft()  # the slot passes to it: _held unchanged
            try:
                loop.call_soon_threadsafe(self._hand, fut)
                return
            except RuntimeError:  # that waiter's loop is closed: next one
                continue

    def _hand(self, fut: asyncio.Future[None]) -> None:
        if fut.done():  # cancelled while the hand-over was in flight
            self.release()
        else:
            fut.set_result(None)


@dataclass
class EndpointLimits:
    """What every client of one endpoint shares."""

    gate: SharedGate
    requests: TokenBucket | None
    tokens: TokenBucket | None

    def tighten(self, max_concurrency: int, requests_per_minute: float | None,
                tokens_per_minute: float | None) -> None:
        self.gate.tighten(max_concurrency)
        if requests_per_minute is not None:
            if self.requests is None:
                self.requests = TokenBucket(requests_per_minute)
            else:
                self.requests.tighten(requests_per_minute)
        if tokens_per_minute is not None:
            if self.tokens is None:
                self.tokens = TokenBucket(tokens_per_minute)
            else:
                self.tokens.tighten(tokens_per_minute)


_REGISTRY: dict[tuple[str, str], EndpointLimits] = {}
_REGISTRY_LOCK = threading.Lock()


def limits_for(base_url: str, model: str, *, max_concurrency: int, requests_per_minute: float | None,
               tokens_per_minute: float | None) -> EndpointLimits:
    """The limits shared by every client of ``(base_url, model)``, made by the first and tightened by later
    ones (module docstring)."""
    key = (base_url.rstrip("/"), model)
    with _REGISTRY_LOCK:
        limits = _REGISTRY.get(key)
        if limits is None:
            limits = _REGISTRY[key] = EndpointLimits(
                SharedGate(max_concurrency),
                TokenBucket(requests_per_minute) if requests_per_minute is not None else None,
                TokenBucket(tokens_per_minute) if tokens_per_minute is not None else None,
            )
        else:
            limits.tighten(max_concurrency, requests_per_minute, tokens_per_minute)
        return limits
