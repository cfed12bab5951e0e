"""An engine that replays given assistant texts: teacher forcing through the real agent loop.

Used to turn demonstrations (a scripted expert's actions) into Trajectories whose tokens are exactly
what the agent loop assembles at RL time, so supervised warm-starting and RL train on one format.
"""

from __future__ import annotations

from typing import Any

from tether.engine.base import FinishReason, GenerationResult, SamplingParams


class ScriptedEngine:
    def __init__(self, tokenizer: Any, texts: list[str], *, logprob: float = 0.0, version: int = 0):
        self.tokenizer, self.texts, self.logprob, self._version = tokenizer, list(texts), logprob, version
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prompts: list[list[int]] = []

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if params.constraint is not None:
            raise ValueError("constraint: a ScriptedEngine replays its texts and cannot follow a grammar")
        self.prompts.append(list(prompt_ids))
        if not self.texts:
            raise RuntimeError("ScriptedEngine ran out of texts: the episode asked for more turns than scripted")
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False) + [self.end_of_turn]
        reason: FinishReason = "stop"
        if len(ids) > params.max_tokens:
            ids, reason = ids[: params.max_tokens], "length"
        return GenerationResult(ids, [self.logprob] * len(ids), reason, [self._version] * len(ids))

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self._version = version

    def close(self) -> None:
        pass
