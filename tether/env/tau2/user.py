"""The simulated user of a tau2 episode (user-simulator mode).

``LLMUser`` is tau2's user simulator with its model call made through tether's OpenAI-compatible client
(``tether.llm.LLMClient``, the endpoint of ``environment.user_llm.client``) instead of litellm: the system prompt
is tau2's own (``tau2.user.user_simulator.UserSimulator.system_prompt``: tau2's simulation guidelines plus the task's
``user_scenario``, as tau2's runner builds it) and the history is tau2's role flip of the conversation
(``UserState.flip_roles``: the agent's text becomes the user turn, tool calls are not shown). The user ends the
conversation by writing one of tau2's control tokens (``###STOP###``, ``###TRANSFER###``, ``###OUT-OF-SCOPE###``).

``ScriptedUser`` replies with fixed lines (tests, offline checks): its last line is normally ``###STOP###``.

A user is a plain synchronous callable ``reply(text_messages) -> str``: the environment calls it from a helper
thread, so that the agent loop's event loop is not blocked by the user's model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from tether.env.tau2._load import load
from tether.llm import LLMClient

STOP_TOKENS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")
ChatFn = Callable[[list[dict[str, Any]]], str]  # OpenAI-style messages -> reply text (blocking)


def is_stop(text: str | None) -> bool:
    """tau2's ``UserSimulator.is_stop``: the user's message holds a control token."""
    return bool(text) and any(t in str(text) for t in STOP_TOKENS)


def client_chat(section: Any, *, max_tokens: int = 512, temperature: float = 0.0) -> ChatFn:
    """A blocking chat call to the endpoint of an ``llm_client``-style section, through ``tether.llm``: one fresh
    client per call (each call runs in its own event loop on a helper thread; the endpoint's limits are shared
    across loops by ``tether.llm.limits``)."""
    def chat(messages: list[dict[str, Any]]) -> str:
        async def once() -> str:
            async with LLMClient.from_config(section) as client:
                body = await client.chat(messages, max_tokens=max_tokens, temperature=temperature)
            return str(body["choices"][0]["message"].get("content") or "")

        return asyncio.run(once())

    return chat


class LLMUser:
    """tau2's user simulator for one task, answering through ``chat``."""

    def __init__(self, task: Any, chat: ChatFn):
        load()
        from tau2.user.user_simulator import UserSimulator  # noqa: PLC0415 — the optional extra ``tau2``

        self.chat = chat
        self.system_prompt = UserSimulator(instructions=str(task.user_scenario)).system_prompt

    def __call__(self, conversation: Sequence[Any]) -> str:
        from tau2.user.base import UserState  # noqa: PLC0415 — the optional extra ``tau2``

        flipped = UserState(system_messages=[], messages=list(conversation)).flip_roles()
        messages = [{"role": "system", "content": self.system_prompt}]
        messages += [{"role": m.role, "content": m.content or ""} for m in flipped]
        return self.chat(messages)


class ScriptedUser:
    """Replies with ``lines`` in order; past the end, ``###STOP###``."""

    def __init__(self, lines: Sequence[str]):
        self.lines = list(lines)
        self.calls = 0

    def __call__(self, conversation: Sequence[Any]) -> str:
        self.calls += 1
        return self.lines[self.calls - 1] if self.calls <= len(self.lines) else "###STOP###"
