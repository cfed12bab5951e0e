"""``LLMJudge``: one rubric prompt → one score in [0, 1], from an OpenAI-compatible endpoint.

One request per (rubric, trajectory): the system message ``JUDGE_SYSTEM`` and the rendered rubric prompt,
with ``n = samples`` answers (one request, so the endpoint's request bucket is charged once and its token
bucket for all of them), each parsed strictly (``rubrics.parse_score``) and averaged. Timeouts, retries and the
endpoint's limits (requests and tokens per minute, a concurrency cap) are the client's (``tether.llm``); what
the client raises after its retries, an answer with fewer choices than asked, and an unparseable answer all
propagate as exceptions — the reward loop records and counts them.
"""

from __future__ import annotations

from typing import Any

from tether.llm import LLMClient, MalformedResponse
from tether.reward.rubrics import JUDGE_SYSTEM, parse_score


class LLMJudge:
    def __init__(self, client: LLMClient, *, samples: int = 1, temperature: float = 0.0, max_tokens: int = 256):
        if samples < 1:
            raise ValueError(f"reward.judge_samples must be >= 1, got {samples}")
        self.client, self.samples, self.temperature, self.max_tokens = client, samples, temperature, max_tokens

    @classmethod
    def from_config(cls, reward: Any) -> LLMJudge:
        """From the ``reward`` section (``tether.config.reward.RewardConfig``)."""
        client = LLMClient.from_config(reward.judge_client)
        return cls(client, samples=reward.judge_samples, temperature=reward.judge_temperature,
                   max_tokens=reward.judge_max_tokens)

    @property
    def identity(self) -> str:
        """What, besides the prompt, decides the answer: part of the cache key."""
        return f"{self.client.base_url}|{self.client.model}|n={self.samples}|t={self.temperature}|max={self.max_tokens}"

    async def score(self, prompt: str, rubric: str) -> float:
        params: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.samples > 1:
            params["n"] = self.samples
        body = await self.client.chat([{"role": "system", "content": JUDGE_SYSTEM},
                                       {"role": "user", "content": prompt}], **params)
        answers = [(c.get("message") or {}).get("content") or "" for c in body["choices"] if isinstance(c, dict)]
        if len(answers) != self.samples:
            raise MalformedResponse(f"the judge at {self.client.base_url} answered {len(answers)} choices for rubric "
                                    f"{rubric!r}, {self.samples} were asked (reward.judge_samples, sent as `n`): "
                                    "does the endpoint support n > 1?", url=self.client.base_url)
        scores = [parse_score(a, rubric) for a in answers]
        return sum(scores) / len(scores)
