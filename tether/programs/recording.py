"""Every engine call of an agent program's episode, recorded exactly as the engine made it.

The gateway (``gateway.py``) serves tether serve's app over a ``RecordingEngine``; its session router sets
``current_session`` for the request, so each ``generate`` the app makes for that request — one per choice — runs
under the episode's ``Session``. The session enforces the run's sampling and limits before the call (the recorded
logprobs must be those of the distribution the learner recomputes) and keeps ``(prompt ids, result)`` after it.
"""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from tether.agent.loop import turn_seed
from tether.engine.base import GenerationResult, InferenceEngine, SamplingParams


@dataclass(frozen=True)
class Call:
    """One generation of the episode: what the engine was given and what it produced (stop id included)."""

    prompt_ids: list[int]
    result: GenerationResult
    seconds: float


class SessionLimit(ValueError):
    """A call the episode's limits refuse; the request gets a 400 with this message (the engine's ValueError)."""


class Session:
    """One episode's calls, and the run's sampling and limits applied to each.

    sampling: the run's parameters (temperature, top_p, penalties, stop ids, max_tokens); a call's own values are
        replaced, its stop ids and grammar kept. seed: the episode's (call k is seeded ``turn_seed(seed, k)``, as the
        tool_agent loop seeds its turns). window: prompt + completion tokens one call may hold. max_calls: generations
        per episode (``agent_loop.max_assistant_turns``).
    """

    def __init__(self, ident: str, *, sampling: SamplingParams, seed: int | None, window: int, max_calls: int):
        self.ident, self.sampling, self.seed, self.window, self.max_calls = ident, sampling, seed, window, max_calls
        self.calls: list[Call] = []
        self.started = 0  # calls admitted (some may still run)
        self.ending: str | None = None  # the limit that refused a call: "max_assistant_turns", "context_window"
        self.closed = False
        self.episode: Any = None  # the program's Episode (the gateway's /episode routes act on it)
        self._lock = threading.Lock()

    def admit(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """The parameters the engine uses for this call; SessionLimit when the episode may not make it."""
        with self._lock:
            if self.closed:
                raise SessionLimit("this episode has ended; its endpoint takes no more calls")
            if self.started >= self.max_calls:
                self.ending = self.ending or "max_assistant_turns"
                raise SessionLimit(f"this episode has made its {self.max_calls} calls (agent_loop.max_assistant_turns)")
            budget = min(self.sampling.max_tokens, params.max_tokens, self.window - len(prompt_ids))
            if budget <= 0:
                self.ending = self.ending or "context_window"
                raise SessionLimit(f"the prompt ({len(prompt_ids)} tokens) leaves no room in the episode's context "
                                   f"window ({self.window} tokens)")
            index = self.started
            self.started += 1
        stops = tuple(sorted(set(self.sampling.stop_token_ids) | set(params.stop_token_ids)))
        return replace(self.sampling, max_tokens=budget, seed=turn_seed(self.seed, index), stop_token_ids=stops,
                       constraint=params.constraint)

    def record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def close(self) -> None:
        with self._lock:
            self.closed = True


current_session: ContextVar[Session | None] = ContextVar("tether_program_session", default=None)


class RecordingEngine:
    """``engine`` for the gateway's app: each call admitted and recorded by the request's session. It has no
    ``stream``, so a streamed request is told when its choice is finished; weight updates go to the engine itself,
    never through the gateway."""

    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self.model: Any = getattr(engine, "model", None)  # the app reads max_model_len from it

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        session = current_session.get()
        if session is None:  # the router only forwards a session's requests
            raise SessionLimit("no episode session for this request")
        params = session.admit(prompt_ids, params)
        t = time.perf_counter()
        out = await self.engine.generate(prompt_ids, params)
        if len(out.versions) != len(out.token_ids):  # an engine that does not tell: the version it serves now
            out = replace(out, versions=[self.engine.version] * len(out.token_ids))
        session.record(Call(list(prompt_ids), out, time.perf_counter() - t))
        return out

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        raise RuntimeError("the agent-program gateway does not take weights; the run syncs its engine")

    def close(self) -> None:
        """The engine is the run's; nothing to close here."""
