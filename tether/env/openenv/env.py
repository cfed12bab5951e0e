"""``OpenEnvEpisode``: one episode over its own WebSocket session of an OpenEnv server (the server builds an
environment instance per session, so episodes run concurrently and share nothing), behind tether's ``Env`` protocol.

- ``reset(task_id)`` opens the session, resets it with the task's seed and lists the server's MCP tools
  (``ListToolsAction``); they are the episode's ``tool_schemas()``. The reset observation is the model's first user
  message: its one text field, or the observation as JSON.
- an action ``{"name", "params"}`` is a ``CallToolAction(tool_name=name, arguments=params)``; the model sees the
  result's text content (or its structured data as JSON); a tool error (unknown tool, bad arguments, an exception
  in the tool, the result's ``is_error``) is an error observation, the model's to fix, not a server fault.
- the server's ``reward`` of each step adds up to the episode's reward (``reward_components["openenv"]``) and its
  ``done`` ends the episode (termination ``env_done``); ``success`` is the server state's boolean ``success`` when it
  has one, else reward >= ``environment.openenv.success_threshold``.
- a server fault (``pool``) fails the episode or stops the run.

openenv-core's ``MCPToolClient`` speaks the protocol; ``_Client`` keeps the raw reply of each message (its parser
keeps only the MCP observation types, and a reset observation's own fields are the task) and the whole state.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tether.config.openenv import OpenEnvConfig
from tether.env.base import Action, Observation, StepOutput, run_step
from tether.env.openenv.pool import Endpoint, ServerPool


def _client_class() -> type:
    from openenv.core.env_server.types import State  # noqa: PLC0415 — the optional extra ``openenv``
    from openenv.core.mcp_client import MCPToolClient  # noqa: PLC0415 — the optional extra ``openenv``

    class _Client(MCPToolClient):
        last: dict[str, Any] = {}

        def _parse_result(self, payload: dict[str, Any]) -> Any:
            self.last = payload
            return super()._parse_result(payload)

        def _parse_state(self, payload: dict[str, Any]) -> Any:
            return State.model_validate(payload)

    return _Client


def first_message(observation: dict[str, Any]) -> str:
    """What the model reads of a reset observation: its one non-empty text field, else the observation as JSON."""
    texts = [v for v in observation.values() if isinstance(v, str) and v.strip()]
    return texts[0] if len(texts) == 1 else json.dumps(observation, sort_keys=True, default=str)


def tool_text(observation: dict[str, Any]) -> tuple[str, bool]:
    """(the text the model sees, whether it is an error) of a ``CallToolObservation``'s fields."""
    error = observation.get("error")
    if error:
        return f"error: {error.get('error_type', 'error')}: {error.get('message', '')}", True
    result = observation.get("result")
    if isinstance(result, dict) and ("content" in result or "is_error" in result):
        texts = [c.get("text", "") for c in result.get("content") or [] if c.get("type") == "text"]
        shown = "\n".join(texts) if texts else json.dumps(result.get("structured_content") or result.get("data"),
                                                          default=str)
        return shown, bool(result.get("is_error"))
    return (result if isinstance(result, str) else json.dumps(result, default=str)), False


def tool_schema(tool: Any) -> dict[str, Any]:
    """An MCP tool (openenv's ``Tool``) as an OpenAI function definition."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.input_schema or {"type": "object", "properties": {}}}}


def task_seed(task_id: str | None) -> int | None:
    if task_id is None:
        return None
    head, _, number = task_id.rpartition("-")
    if head != "seed" or not number.isdigit():
        raise KeyError(f"unknown OpenEnv task id {task_id!r}: the tasks are 'seed-<N>' (list_tasks)")
    return int(number)


class OpenEnvEpisode:
    def __init__(self, pool: ServerPool, cfg: OpenEnvConfig):
        self.pool, self.cfg = pool, cfg
        self.verifier = self  # the Env protocol's verifier: the server scores its own episodes
        self._client: Any = None
        self._where: Endpoint | None = None
        self._schemas: list[dict[str, Any]] | None = None
        self.reward, self.steps = 0.0, 0
        self.final: tuple[float, dict[str, Any]] | None = None

    def spawn(self) -> OpenEnvEpisode:
        """A new episode on the same servers (``tether.runtime.env_factory`` makes every rollout's this way)."""
        return OpenEnvEpisode(self.pool, self.cfg)

    def shutdown(self) -> None:
        """Stop the servers tether started for this environment (at the end of the run)."""
        self.pool.shutdown()

    # -- the session -------------------------------------------------------------------------------------
    def _open(self) -> tuple[Any, Endpoint]:
        if self._client is None:
            where = self.pool.endpoint()
            t = self.cfg.request_timeout_s
            client = _client_class()(base_url=where.url, connect_timeout_s=t, message_timeout_s=t)
            self.pool.call_sync(where, client.connect())
            self._client, self._where = client, where
        assert self._where is not None
        return self._client, self._where

    def reset(self, task_id: str | None = None) -> Observation:
        client, where = self._open()
        seed = task_seed(task_id)

        async def begin() -> tuple[dict[str, Any], list[Any]]:
            await client.reset(seed=seed, episode_id=f"{task_id or 'episode'}-{uuid.uuid4().hex[:8]}")
            payload = client.last
            return payload, await client.list_tools(use_cache=False)

        payload, tools = self.pool.call_sync(where, begin())
        self._schemas = [tool_schema(t) for t in tools]
        self.reward, self.steps, self.final = float(payload.get("reward") or 0.0), 0, None
        if payload.get("done"):  # over before it began: scored as it stands
            self.final = self._score_sync("env_done")
        return {"last_tool_result": None, "user_reply": first_message(payload.get("observation") or {}),
                "tool_error": False}

    def step(self, action: Action) -> StepOutput:
        return run_step(self.astep, action)

    async def astep(self, action: Action) -> StepOutput:
        if self.final is not None:
            return self._obs("error: the episode has ended", True), self.final[0], True, dict(self.final[1])
        from openenv.core.env_server.mcp_types import CallToolAction  # noqa: PLC0415 — the optional extra ``openenv``

        client, where = self._open()
        params = action.get("params")
        call = CallToolAction(tool_name=str(action.get("name")), arguments=params if isinstance(params, dict) else {})

        async def act() -> dict[str, Any]:
            await client.step(call)
            return dict(client.last)

        payload = await self.pool.call(where, act())
        self.steps += 1
        self.reward += float(payload.get("reward") or 0.0)
        text, error = tool_text(payload.get("observation") or {})
        obs = self._obs(text, error)
        if not payload.get("done"):
            return obs, 0.0, False, {"turn": self.steps, "tool_error": error}
        success = await self.pool.call(where, self._success())
        self.final = self._end("env_done", success)
        return obs, self.final[0], True, {"turn": self.steps, "tool_error": error, **self.final[1]}

    def finalize(self, termination: str) -> tuple[float, dict[str, Any]]:
        """The episode ended by the agent loop (out of turns, no call): scored by the rewards the server gave."""
        if self.final is None:
            self.final = self._score_sync(termination)
        return self.final[0], dict(self.final[1])

    def _score_sync(self, termination: str) -> tuple[float, dict[str, Any]]:
        client, where = self._open()
        return self._end(termination, self.pool.call_sync(where, self._success()))

    async def _success(self) -> bool | None:
        """The server state's own ``success`` flag, None when it has none."""
        state = await self._client.state()
        flag = (state.model_extra or {}).get("success")
        return flag if isinstance(flag, bool) else None

    def _end(self, termination: str, flag: bool | None) -> tuple[float, dict[str, Any]]:
        success = flag if flag is not None else self.reward >= self.cfg.success_threshold
        return self.reward, {"termination": termination, "reward_components": {"openenv": self.reward},
                             "success": success, "success_from": "server" if flag is not None else "threshold",
                             "num_turns": self.steps, "hacking_flags": {}}

    @staticmethod
    def _obs(text: str, error: bool) -> Observation:
        return {"last_tool_result": text, "user_reply": None, "tool_error": error}

    # -- what the model sees -------------------------------------------------------------------------------
    def tool_schemas(self) -> list[dict[str, Any]]:
        if self._schemas is None:  # asked before reset (tether sft): the server lists its tools without one
            client, where = self._open()
            self._schemas = [tool_schema(t) for t in self.pool.call_sync(where, client.list_tools(use_cache=False))]
        return [dict(s) for s in self._schemas]

    def system_prompt(self) -> str:
        return self.cfg.system_prompt

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            self.pool.detach(client.close())
