"""The two paths of ``tether verify consistency``, each reduced to one ``Turn`` per assistant generation.

**Training path**: the agent loop's trajectories (token-in/token-out on the local engine). A turn is one run of
mask-1 tokens in a segment: its prompt is everything before the run (the segment's prompt and the response so
far), its output the run, and its action is read from the run's text with the configured tool parser, as the
loop read it.

**Deployment path** (``DeployClient``): a client of ``tether serve`` over the OpenAI chat protocol. It keeps the
conversation as text messages, sends them with the task's tool schemas, and acts on the tool calls the server
parsed out of its answer. It plays the environment by the agent loop's rules (``tether.agent.loop``): a text
answer is said to the user (``respond_to_user``) when the task offers that tool, at most ``max_parallel_calls``
calls run per turn (the rest get an error message), a call to a tool the task does not list gets an error
observation, tool results show ``observation_text``, the user's replies follow as user messages, the episode
ends on the environment's done, ``max_user_turns``, ``max_assistant_turns`` or a turn without action; a bounded
memory (``environment.state.memory``) continues in a new context of header, summary and the last k turns, as
messages. So the two paths differ only where training and serving differ: the prompt's tokens (tokenizer, chat
template, tool schemas), the sampling settings, the parsing of the answer.

An action is the tuple of ``(tool name, arguments as canonical JSON)`` of one turn, in the order written; a text
answer is ``respond_to_user`` with the text stripped (the loop strips it before delivering it); a malformed call
(training path only: the server returns it as text) is ``(MALFORMED, reason)``; a turn with neither is ``()``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from tether.agent.chat import observation_text
from tether.agent.loop import SUMMARY_PREFIX, USER_TOOL, LoopLimits
from tether.agent.parsers import ParsedTurn, ToolParser
from tether.agent.rules import refused_call
from tether.env.base import Env
from tether.env.memory import TurnRecord
from tether.llm import BadRequest, LLMClient
from tether.types import Task, Trajectory

MALFORMED = "<malformed tool call>"
Action = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Settings:
    """The sampling settings one generation ran under."""

    temperature: float
    top_p: float
    max_tokens: int
    stop_ids: tuple[int, ...]


@dataclass
class Turn:
    action: Action
    prompt_ids: list[int]  # what the engine was given
    output_ids: list[int]  # what it generated (stop id included)
    settings: Settings


@dataclass
class Episode:
    """One path's play of one task."""

    task_id: str
    turns: list[Turn] = field(default_factory=list)
    header: list[dict[str, Any]] = field(default_factory=list)  # system prompt + opening request
    tools: list[dict[str, Any]] = field(default_factory=list)  # the schemas the prompt listed
    error: str | None = None  # why the episode stopped early, when it did (deployment path)


def canonical(args: Any) -> str:
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


def action_of(calls: list[tuple[str, Any]], errors: list[str], content: str, tool_names: set[str]) -> Action:
    """The action of one turn (module docstring)."""
    if calls or errors:
        return tuple((name, canonical(args)) for name, args in calls) + tuple((MALFORMED, e) for e in errors)
    content = content.strip()
    if content and USER_TOOL in tool_names:
        return ((USER_TOOL, canonical({"message": content})),)
    return ()


def task_schemas(env: Env, task: Task, limits: LoopLimits) -> list[dict[str, Any]]:
    """The tool schemas the agent loop lists for ``task`` (``agent_loop.tool_selection``)."""
    schemas = env.tool_schemas()
    if limits.tool_selection == "per_sample" and task.tools is not None:
        schemas = [s for s in schemas if s["function"]["name"] in task.tools]
    return schemas


# ------------------------------------------------------------------------------------------ training path


def training_episode(traj: Trajectory, env: Env, task: Task, *, tokenizer: Any, parse: ToolParser,
                     settings: Settings, limits: LoopLimits) -> Episode:
    """The turns of one agent-loop trajectory. ``settings.max_tokens`` is the loop's per-request maximum; each
    turn's is the part of it the context window left (as the loop computes its budget). ``env``: any instance of
    the environment (for the task's tool schemas)."""
    env.reset(task_id=task.id)
    tools = task_schemas(env, task, limits)
    names = {s["function"]["name"] for s in tools}
    ep = Episode(task.id, header=[dict(m) for m in traj.messages[:2]], tools=tools)
    for seg in traj.segments:
        mask, i = seg.response_mask, 0
        while i < len(mask):
            if not mask[i]:
                i += 1
                continue
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            prompt, out = seg.prompt_ids + seg.response_ids[:i], seg.response_ids[i:j]
            ids = out[:-1] if out[-1] in settings.stop_ids else out
            turn: ParsedTurn = parse(tokenizer.decode(ids, skip_special_tokens=False))
            action = action_of([(c.name, c.arguments) for c in turn.calls], [e.reason for e in turn.errors],
                               turn.content, names)
            budget = min(settings.max_tokens, limits.context_window - len(prompt))
            ep.turns.append(Turn(action, prompt, out, Settings(settings.temperature, settings.top_p, budget,
                                                               settings.stop_ids)))
            i = j
    return ep


# ---------------------------------------------------------------------------------------- deployment path


@dataclass
class DeployClient:
    """Plays tasks through an OpenAI-compatible chat endpoint (module docstring). ``request``: the sampling fields
    every request sends (``temperature``, ``top_p``, ``max_tokens``); ``stop_ids``: the server's end-of-turn ids,
    recorded with each turn's settings."""

    client: LLMClient
    limits: LoopLimits
    request: dict[str, Any]
    stop_ids: tuple[int, ...]

    @property
    def settings(self) -> Settings:
        return Settings(float(self.request["temperature"]), float(self.request["top_p"]),
                        int(self.request["max_tokens"]), self.stop_ids)

    async def play(self, env: Env, task: Task) -> Episode:
        obs = env.reset(task_id=task.id)
        tools = task_schemas(env, task, self.limits)
        names = {s["function"]["name"] for s in tools}
        header = [{"role": "system", "content": env.system_prompt()},
                  {"role": "user", "content": obs.get("user_reply") or ""}]
        ep = Episode(task.id, header=header, tools=tools)
        state = _State(env, names, header)
        context_memory = getattr(env, "context_memory", None)
        memory = context_memory() if context_memory is not None else None
        while len(ep.turns) < self.limits.max_assistant_turns:
            try:
                body = await self.client.chat(state.messages, tools=tools or None, return_token_ids=True,
                                              **self.request)
            except BadRequest as e:
                if "context_length_exceeded" not in (e.body or ""):
                    raise
                ep.error = str(e)  # the conversation outgrew the model's context: the episode ends there
                break
            choice = body["choices"][0]
            msg = choice["message"]
            wire_calls = msg.get("tool_calls") or []
            calls = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in wire_calls]
            content = msg.get("content") or ""
            action = action_of([(n, a) for _, n, a in calls], [], content, names)
            ep.turns.append(Turn(action, list(body["prompt_token_ids"]), list(choice["token_ids"]), self.settings))
            if not action:
                break
            said: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
            if wire_calls:
                said["tool_calls"] = wire_calls
            records = await state.act(len(ep.turns), said, calls, content.strip(), self.limits)
            if memory is not None:
                for record in records:
                    memory.add(record)
            if state.done or state.user_turns >= self.limits.max_user_turns:
                break
            if memory is not None and len(state.turns) > memory.k:  # the loop's new segment, as messages
                summary = memory.summary()
                extra = [{"role": "system", "content": SUMMARY_PREFIX + summary}] if summary else []
                state.turns = state.turns[-memory.k:]
                state.messages = [*header, *extra, *(m for t in state.turns for m in t)]
        return ep


class _State:
    """The conversation of one deployment episode and the environment it drives."""

    def __init__(self, env: Env, names: set[str], header: list[dict[str, Any]]):
        self.env, self.names = env, names
        self.messages = list(header)
        self.turns: list[list[dict[str, Any]]] = []  # completed turns in context: the assistant message + answers
        self.user_turns = 0
        self.done = False

    async def act(self, turn: int, said: dict[str, Any], calls: list[tuple[str, str, Any]], text: str,
                  limits: LoopLimits) -> list[TurnRecord]:
        """Carry out one assistant turn; append it and what answered it to the conversation."""
        new: list[dict[str, Any]] = []
        replies: list[str] = []
        records: list[TurnRecord] = []
        if not calls:  # text: said to the user
            obs = await self._step(USER_TOOL, {"message": text})
            shown = observation_text(obs)
            if obs.get("tool_error"):
                new.append({"role": "tool", "content": shown})
            if obs.get("user_reply"):
                replies.append(obs["user_reply"])
            records.append(TurnRecord(turn, USER_TOOL, {"message": text}, shown, bool(obs.get("tool_error")),
                                      obs.get("user_reply")))
        else:
            run = calls[: limits.max_parallel_calls]
            results = await asyncio.gather(*(self._step(name, args) for _, name, args in run))
            for (ident, name, args), obs in zip(run, results):
                shown = observation_text(obs)
                new.append({"role": "tool", "tool_call_id": ident, "content": shown})
                if obs.get("user_reply"):
                    replies.append(obs["user_reply"])
                records.append(TurnRecord(turn, name, args, shown, bool(obs.get("tool_error")),
                                          obs.get("user_reply")))
            for n, (ident, name, args) in enumerate(calls[limits.max_parallel_calls:], limits.max_parallel_calls + 1):
                err = refused_call(name, self.names, env_done=self.done, call_in_turn=n,
                                   max_parallel_calls=limits.max_parallel_calls)
                assert err is not None  # beyond max_parallel_calls: refused whatever the call
                new.append({"role": "tool", "tool_call_id": ident, "content": err})
                records.append(TurnRecord(turn, name, args, err, True))
        new += [{"role": "user", "content": r} for r in replies]
        self.user_turns += len(replies)
        self.turns.append([said, *new])
        self.messages += [said, *new]
        return records

    async def _step(self, name: str, args: Any) -> dict[str, Any]:
        err = refused_call(name, self.names, env_done=self.done)  # calls past the limit never get here
        if err is not None:
            return {"last_tool_result": err, "tool_error": True}
        obs, _, done, _ = await self.env.astep({"name": name, "params": args})
        self.done = self.done or done
        return dict(obs)
