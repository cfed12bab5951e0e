"""The InferenceEngine protocol: token ids in, token ids and logprobs out.

Logprobs are those of the *sampling* distribution before top-p truncation: log_softmax(logits / T).
The trainer computes its logprobs the same way, so at equal weights the ratio is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0.0 = greedy
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (it is kept)
    seed: int | None = None  # per-request seed for reproducible sampling


@dataclass
class GenerationResult:
    token_ids: list[int]  # [N] newly generated ids, including the stop id when finish_reason == "stop"
    logprobs: list[float]  # [N] log_softmax(logits / T) of each chosen id (T = 1 when greedy)
    finish_reason: FinishReason
    versions: list[int] = field(default_factory=list)  # [N] weight version that produced each token
    num_preempted: int = 0  # times this request was interrupted by a weight swap and resumed


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
