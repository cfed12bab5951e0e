"""The InferenceEngine protocol: token ids in, token ids and logprobs out.

Logprobs are those of the model's *sampling* distribution before any truncation: log_softmax(logits / T), the
distribution the trainer recomputes, so at equal weights the ratio is exactly 1. What each sampling parameter
does to that, in the order the engine applies them (vLLM's order; vLLM's default ``logprobs_mode`` records
unshaped logprobs too):

1. ``logit_bias``, ``min_tokens``, ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty`` *shape* the
   logits: they change which token is drawn, not the logprob recorded for it, which stays the model's. The learner
   cannot recompute them (they are not a function of its forward), so a rollout sampled with them is off-policy
   w.r.t. what the learner scores, and no importance ratio sees it: the ratio is 1 at equal weights all the same.
2. ``temperature`` divides the (shaped) logits; the recorded logprob is taken at the same T (T = 1 when greedy).
3. ``min_p``, ``top_k``, ``top_p`` *truncate* the distribution, in that order (top-p over the mass top-k and min-p
   kept): the draw is from the truncated one, the logprob from the whole one, as for top_p before them.

``constraint`` (a grammar, ``tether.engine.grammar``) is logit shaping too, applied after step 1's: the logits of the
tokens the grammar does not allow next are set to -inf, so the draw is from the allowed tokens only, and the logprob
recorded is still the unmasked model's. That is the distribution the learner recomputes (it has no grammar state to
mask with), so the importance ratio is 1 at equal weights; the rollout is off-policy all the same, by the mass the
mask removed, which nothing corrects for: ``shapes_logits`` is true for it. (vLLM V1 departs here: its model runner
applies the grammar bitmask to the logits in place before calling its sampler, so even its ``raw_logprobs`` are the
masked distribution's — 0 where the grammar allows one token. tether keeps the model's, as for the other shaping
parameters, so that the learner's recomputation matches at equal weights.)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


class ConstraintMatcher(Protocol):
    """One request's state in its grammar (``tether.engine.grammar.Matcher``)."""

    def mask(self, logits: Any) -> None:
        """Set the logits [1, V] of the tokens not allowed next to -inf, in place."""
        ...

    def accept(self, token: int) -> None:
        ...

    @property
    def terminated(self) -> bool:
        ...


class Constraint(Protocol):
    """A compiled grammar (``tether.engine.grammar.Grammar``): each request gets its own matcher."""

    @property
    def vocab_size(self) -> int:
        """The logits' width it masks."""
        ...

    def matcher(self, stop_token_ids: tuple[int, ...]) -> ConstraintMatcher:
        ...


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0.0 = greedy
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (it is kept)
    seed: int | None = None  # per-request seed for reproducible sampling
    top_k: int = 0  # keep the k most likely tokens (and any tied with the k-th); 0 = off
    min_p: float = 0.0  # keep tokens with probability >= min_p × the most likely one's (after T); 0 = off
    repetition_penalty: float = 1.0  # the logit of a token seen in prompt or output: / it when > 0, × it when < 0
    presence_penalty: float = 0.0  # subtracted from the logit of each token generated at least once
    frequency_penalty: float = 0.0  # × the times a token was generated, subtracted from its logit
    min_tokens: int = 0  # none of stop_token_ids can be drawn before this many new tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit) pairs
    # A grammar the output must follow (tether.engine.grammar.Grammar); the request stops when it is complete.
    # Left out of ==/hash: a compiled grammar compares by identity.
    constraint: Constraint | None = field(default=None, compare=False, hash=False)

    @property
    def shapes_logits(self) -> bool:
        """Whether a logit-shaping parameter acts (base.py's step 1): the draw then departs from the learner's
        distribution."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or (self.min_tokens > 0 and bool(self.stop_token_ids)) or bool(self.logit_bias)
                or self.constraint is not None)

    def check(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field out of its range (token ids against ``vocab_size`` when given)."""
        problems = [
            (self.temperature >= 0, "temperature", ">= 0"), (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (self.top_k >= 0, "top_k", ">= 0 (0 = off)"), (0 <= self.min_p <= 1, "min_p", "in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "> 0 (1 = off)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
            (self.min_tokens >= 0, "min_tokens", ">= 0"),
        ]
        for ok, name, want in problems:
            if not ok:
                raise ValueError(f"sampling parameter {name} must be {want}, got {getattr(self, name)!r}")
        for tok, bias in self.logit_bias:
            if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                raise ValueError(f"logit_bias: token id {tok} is not in the vocabulary [0, {vocab_size})")
            if bias != bias:
                raise ValueError(f"logit_bias: the bias of token {tok} is NaN")
        if self.constraint is not None:
            if not self.stop_token_ids:
                raise ValueError("constraint: a constrained request needs stop_token_ids (its grammar ends at one)")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with a constraint: its grammar decides where the "
                                 "output ends")
            if vocab_size is not None and self.constraint.vocab_size != vocab_size:
                raise ValueError(f"constraint: the grammar was compiled for {self.constraint.vocab_size} logits, the "
                                 f"model has {vocab_size}")


@dataclass
class GenerationResult:
    token_ids: list[int]  # [N] newly generated ids, including the stop id when finish_reason == "stop"
    logprobs: list[float]  # [N] log_softmax(logits / T) of each chosen id (T = 1 when greedy), unshaped, untruncated
    finish_reason: FinishReason
    versions: list[int] = field(default_factory=list)  # [N] weight version that produced each token
    num_preempted: int = 0  # times this request was interrupted by a weight swap and resumed


@dataclass
class TokenDelta:
    """Tokens a streamed generation added since the last delta (``stream_generation``)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


def stream_generation(engine: InferenceEngine, prompt_ids: list[int], params: SamplingParams, group: Any = None,
                      every: Callable[[], int] | None = None) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
    """A generation as it grows: ``TokenDelta``s, then the finished ``GenerationResult``. Engines with a ``stream``
    method (``LocalEngine``) tell each decode step's tokens as the step ends; the others tell them all at the end.
    Closing the iterator early aborts the generation. ``group``: ``LocalEngine``'s fair-admission group; ``every``:
    its pace (tokens between deltas after the first, asked after each step; None = every step's); each is passed
    only to an engine whose ``stream`` takes it."""
    stream = getattr(engine, "stream", None)
    if stream is None:
        return _whole(engine, prompt_ids, params)
    kw = {k: v for k, v in (("group", group), ("every", every)) if v is not None and takes(stream, k)}
    return stream(prompt_ids, params, **kw)


def takes(method: Callable[..., Any], name: str) -> bool:
    """Whether ``method`` (an engine's ``generate`` or ``stream``) has a parameter ``name``: optional arguments only
    some engines accept (``group``, ``every``) are passed by this. Read once per function, not per call."""
    return name in _parameters(getattr(method, "__func__", method))


@functools.lru_cache(maxsize=64)
def _parameters(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


async def _whole(engine: InferenceEngine, prompt_ids: list[int],
                 params: SamplingParams) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
    result = await engine.generate(prompt_ids, params)
    yield TokenDelta(list(result.token_ids), list(result.logprobs), list(result.versions))
    yield result


@runtime_checkable
class InferenceEngine(Protocol):
    """Generates for many concurrent requests. Implementations batch internally."""

    @property
    def version(self) -> int:
        """Version of the weights currently used for new tokens."""
        ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate a continuation of prompt_ids. Safe to call from many asyncio tasks at once."""
        ...

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Swap in new weights; requests submitted afterwards (and resumed ones) use them."""
        ...

    def close(self) -> None:
        ...
