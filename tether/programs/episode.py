"""What an agent program is handed for one episode: its endpoint, the task, and the environment's tools.

    def agent(ep: Episode) -> None:
        client = OpenAI(base_url=ep.base_url, api_key=ep.api_key)
        messages = ep.messages()
        while not ep.done:
            r = client.chat.completions.create(model=ep.model, messages=messages, tools=ep.tools, **ep.sampling)
            ...
            obs = ep.call_tool(call.function.name, call.function.arguments)

``call_tool`` runs the call in the environment as the ``tool_agent`` loop would: a tool the task does not offer,
a call after the environment ended the episode, or more than ``agent_loop.max_parallel_calls`` calls after one
generation get an error observation instead. ``respond_to_user`` is the user channel: the user's answer is
``Observation.user_reply`` (a user message), its ``text`` the tool message an explicit call of it shows; the
``tool_agent`` loop sends an assistant's plain text there and shows nothing but the reply (unless it failed).
It is safe from the program's thread (sync programs) and ``acall_tool`` from the rollout's event loop (async ones).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from tether.agent.chat import observation_text
from tether.agent.rules import EPISODE_ENDED, refused_call
from tether.env.base import Env
from tether.programs.recording import Session
from tether.types import USER_TOOL, Task


@dataclass(frozen=True)
class Observation:
    """One tool call's outcome: ``text`` is the tool message's content (what the ``tool_agent`` loop shows)."""

    text: str
    user_reply: str | None = None  # what the user said, when the call reached the user
    error: bool = False
    done: bool = False  # the environment ended the episode with this call


@dataclass
class Limits:
    max_user_turns: int
    max_assistant_turns: int
    max_parallel_calls: int


@dataclass
class Episode:
    """One episode of an agent program (``agent_loop.program``); see the module docstring."""

    task: Task
    system_prompt: str
    prompt: str  # the opening user message
    tools: list[dict[str, Any]]  # OpenAI tool schemas the task offers
    base_url: str  # this episode's OpenAI-compatible endpoint (…/v1)
    api_key: str
    model: str
    sampling: dict[str, Any]  # temperature, top_p, max_tokens of the run (the gateway applies them anyway)
    env: Env = field(repr=False)
    session: Session = field(repr=False)
    limits: Limits = field(repr=False)
    loop: asyncio.AbstractEventLoop = field(repr=False)
    env_done: bool = False
    reward: float | None = None  # the environment's, when it ended the episode
    info: dict[str, Any] = field(default_factory=dict)
    user_turns: int = 0
    tool_calls: int = 0
    tool_s: float = 0.0  # wall seconds in the environment's steps (agent/tool_calls)
    errors: list[str] = field(default_factory=list)
    events: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (calls made before, message)
    _turn_calls: tuple[int, int] = (0, 0)  # (generations so far, tool calls since the last one)
    _ended: bool = False

    def messages(self) -> list[dict[str, Any]]:
        """The opening conversation: the system prompt and the user's first message."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": self.prompt}]

    @property
    def done(self) -> bool:
        """The episode is over: the environment ended it, or a limit of ``agent_loop`` was reached."""
        return self._ended or self.env_done or self.limit_reached is not None

    @property
    def limit_reached(self) -> str | None:
        """The ``agent_loop`` limit the episode has reached (``max_user_turns``, ``max_assistant_turns``), or None."""
        if self.user_turns >= self.limits.max_user_turns:
            return "max_user_turns"
        if self.session.started >= self.limits.max_assistant_turns:
            return "max_assistant_turns"
        return None

    def call_tool(self, name: str, arguments: dict[str, Any] | str | None = None) -> Observation:
        """Run one tool call (arguments as a dict or the JSON string of a tool call); from a program's thread."""
        if self._ended:
            raise RuntimeError("this episode has ended (agent_loop.program_timeout_s or the program returned)")
        future = asyncio.run_coroutine_threadsafe(self.acall_tool(name, arguments), self.loop)
        return future.result()

    async def acall_tool(self, name: str, arguments: dict[str, Any] | str | None = None) -> Observation:
        """``call_tool`` for an ``async`` program, on the rollout's event loop."""
        if self._ended:
            raise RuntimeError("this episode has ended (agent_loop.program_timeout_s or the program returned)")
        made = len(self.session.calls)
        before, in_turn = self._turn_calls
        in_turn = in_turn + 1 if before == made else 1
        self._turn_calls = (made, in_turn)
        obs = await self._step(name, arguments, in_turn)
        if obs.text and (obs.error or name != USER_TOOL):
            self.events.append((made, {"role": "tool", "name": name, "content": obs.text}))
        if obs.user_reply:
            self.user_turns += 1
            self.events.append((made, {"role": "user", "content": obs.user_reply}))
        return obs

    async def _step(self, name: str, arguments: dict[str, Any] | str | None, in_turn: int) -> Observation:
        refusal = refused_call(name, [t["function"]["name"] for t in self.tools], env_done=self.env_done,
                               call_in_turn=in_turn, max_parallel_calls=self.limits.max_parallel_calls)
        if refusal == EPISODE_ENDED:
            return Observation(refusal, error=True, done=True)
        if refusal is not None:
            return self._error(refusal)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                return self._error(f"error: could not parse the arguments of '{name}' as JSON: {e}")
        if name != USER_TOOL:
            self.tool_calls += 1
        t = time.perf_counter()
        obs, reward, done, info = await self.env.astep({"name": name, "params": arguments or {}})
        self.tool_s += time.perf_counter() - t
        if obs.get("tool_error"):
            self.errors.append(f"tool {name}: {obs.get('last_tool_result', '')}")
        if done and not self.env_done:
            self.env_done, self.reward, self.info = True, float(reward), dict(info)
        return Observation(observation_text(obs), obs.get("user_reply"), bool(obs.get("tool_error")), bool(done))

    def _error(self, message: str) -> Observation:
        self.errors.append(message)
        return Observation(message, error=True)

    def end(self) -> None:
        """No more calls: the program returned, failed or ran out of time (a stray thread's calls are refused)."""
        self._ended = True
        self.session.close()
