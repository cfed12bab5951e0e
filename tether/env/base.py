"""The environment protocol the agent loop drives.

Gym-like (like rLLM's BaseEnv and the seed's test_env.py): ``reset(task_id=...) -> observation`` and
``step(action) -> (observation, reward, done, info)``. An action is one tool call,
``{"name": str, "params": dict}``. The agent loop uses the async twin ``astep`` so that the tool calls
of one assistant turn run concurrently (``max_parallel_calls``) and tool latency never blocks the
event loop; ``step`` is ``astep`` run to completion for synchronous callers.

Observation (a dict): the configured ``observation_fields`` (e.g. ``last_tool_result``, ``user_intent``,
``order_status``, ``inventory_snapshot``) plus
  - ``user_reply``: str | None — what the (simulated) user said, when the action reached the user;
  - ``tool_error``: bool — the action failed (unknown tool, bad params, timeout, exception).
``last_tool_result`` is the text the model sees as the tool response.

``info`` carries ``termination`` (why the episode ended, when done) and, at the end of the episode,
``reward_components`` (per verifier component), ``hacking_flags`` and ``success``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

Action = dict[str, Any]  # {"name": tool name, "params": {...}}
Observation = dict[str, Any]
StepOutput = tuple[Observation, float, bool, dict[str, Any]]


@runtime_checkable
class Env(Protocol):
    verifier: Any  # the environment's reward function (see tether.env.verifier)

    def reset(self, task_id: str | None = None) -> Observation: ...

    def step(self, action: Action) -> StepOutput: ...

    async def astep(self, action: Action) -> StepOutput: ...

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI-format tool definitions ({"type": "function", "function": {...}}) of this episode."""
        ...

    def system_prompt(self) -> str:
        """Instructions (policy) the agent sees as its system message."""
        ...

    def finalize(self, termination: str) -> tuple[float, dict[str, Any]]:
        """Score an episode that the agent loop ended before the env said done (e.g. the assistant ran
        out of turns or context). Returns (reward, info) with the same end-of-episode info keys."""
        ...

    def close(self) -> None: ...


def run_step(astep: Callable[[Action], Awaitable[StepOutput]], action: Action) -> StepOutput:
    """``astep(action)`` run to completion for a synchronous caller (an environment's ``step``); called from inside a
    running event loop, it runs on a helper thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(astep(action))  # type: ignore[arg-type]
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, astep(action)).result()  # type: ignore[arg-type]
