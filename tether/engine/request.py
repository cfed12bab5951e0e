"""A ``LocalEngine`` request: its state on the worker thread, and the delivery of its result (and, streamed, its
tokens) to the caller's event loop with ``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tether.engine.base import ConstraintMatcher, FinishReason, SamplingParams


@dataclass(eq=False)
class Request:
    """One generation inside the engine: its sampling state, its tokens so far, and its caller (loop, future)."""

    prompt: list[int]
    params: SamplingParams
    max_new: int  # max_tokens, clipped to the model's context
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    num_preempted: int = 0
    finish: FinishReason | None = None
    cancelled: bool = False  # set by the caller's task when it is cancelled
    uniforms: list[float] = field(default_factory=list)  # drawn from ``generator`` ahead, used front to back
    truncates: bool = False  # top_k or min_p on
    shapes: bool = False  # a logit-shaping parameter on (SamplingParams.shapes_logits)
    seen: torch.Tensor | None = None  # [V] bool, prompt and output tokens (repetition_penalty), from the first token
    counts: torch.Tensor | None = None  # [V] float32, times each token was generated (presence/frequency penalties)
    matcher: ConstraintMatcher | None = None  # its grammar's state (params.constraint), advanced with each token
    group: Any = None  # fair admission's group (tether.engine.fair_share); None: the request alone
    streamed: bool = False  # ``stream``: the caller is woken after each step that added tokens, and at the end
    every: Callable[[], int] | None = None  # (streamed) tokens between wakes after the first (the caller's pace)
    told: int = 0  # (streamed) tokens when the caller was last woken for tokens
    waiter: asyncio.Future | None = None  # (streamed) what the caller awaits until then

    def tell(self) -> bool:
        """(streamed, after a token was added) Whether to wake the caller: at the first token, then once ``every()``
        tokens are new (every step's without a pace); the end always wakes it (``send``)."""
        if self.every is not None and self.told and len(self.tokens) - self.told < self.every():
            return False
        self.told = len(self.tokens)
        return True

    def __post_init__(self) -> None:
        if self.group is None:
            self.group = self

    @property
    def context(self) -> list[int]:
        """The tokens before the next one: the prompt, and the tokens of a request interrupted by fair admission."""
        return self.prompt + self.tokens if self.tokens else self.prompt

    def uniform(self) -> float:
        """The next uniform of the request's own generator: drawn in blocks (``torch.rand(k)`` is the same stream as k
        draws of one), as many as it may still sample tokens, at most 64 at a time."""
        if not self.uniforms:
            assert self.generator is not None
            block = max(1, min(64, self.max_new - len(self.tokens)))
            self.uniforms = torch.rand(block, generator=self.generator).tolist()[::-1]
        return self.uniforms.pop()


@dataclass(eq=False)
class WeightUpdate:
    """Weights queued for the worker; ``done`` is set once it loaded them (or failed: ``error``)."""

    state_dict: dict[str, Any]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


def _resolve(future: asyncio.Future, result: Any) -> None:
    if future.done():  # cancelled by the caller
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _woken(req: Request) -> None:
    if req.waiter is not None and not req.waiter.done():
        req.waiter.set_result(None)


def _woken_all(reqs: list[Request]) -> None:
    for req in reqs:
        _woken(req)


def wake_all(reqs: list[Request]) -> None:
    """Tell streamed requests' callers that they have new tokens or have ended, with one call into each caller's event
    loop (from the worker thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Request]] = {}
    for req in reqs:
        by_loop.setdefault(req.loop, []).append(req)
    for loop, some in by_loop.items():
        try:
            loop.call_soon_threadsafe(_woken_all, some)
        except RuntimeError:  # the caller's event loop is closed
            pass


def send(req: Request, result: Any) -> None:
    """Deliver a result or exception to the request's event loop (from the worker thread)."""
    try:
        req.loop.call_soon_threadsafe(_resolve, req.future, result)
    except RuntimeError:  # the caller's event loop is closed; nobody is waiting
        return
    if req.streamed:
        wake_all([req])
