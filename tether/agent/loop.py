"""Agent loops: ``AgentLoopBase`` with ``@register(name)`` and the ``tool_agent`` state machine.

    PENDING ──▶ GENERATING ──(tool calls / text to the user)──▶ PROCESSING_TOOLS ──▶ GENERATING …
                    │                                               │
                    └──────────────▶ TERMINATED ◀───────────────────┘

One ``run(task, env)`` is one episode. Generation is token-in/token-out against an ``InferenceEngine``;
tool results and user replies are appended with mask 0 (see ``chat.py``). Departures from verl's
``ToolAgentLoop``: an assistant turn with text and no tool call is delivered to the user (as
``respond_to_user``) when the task offers that tool, because in customer service talking to the user is
the action; calls beyond ``max_parallel_calls`` get an error observation instead of being dropped
silently; a turn cut by ``max_tokens`` is closed with the end-of-turn token at mask 0.

**Memory segments** (``environment.state.memory``, through the env's ``context_memory()``; an env without it
has no bound). A *turn* is one assistant message together with the tool results and user replies that answer
it. When a turn completes and the current segment's context then holds more than ``k`` completed turns, the
episode continues in a new segment instead of appending to the old one (which ends with that turn's assistant
tokens). The new segment's prompt is the system prompt, the opening request (the task; it is never dropped),
the memory's summary of every turn before the last ``k`` as a system message (``summary_enabled``; nothing
otherwise) and the last ``k`` turns — their token ids as generated and observed. So the policy never
generates with more than ``k`` completed turns in view; after the first cut every further turn starts a
segment (a sliding window of ``k``). Each segment is its own token-in/token-out sequence (``Segment``); the
context window bounds each segment.

**Observations.** A tool message shows ``observation_text(obs)``: ``last_tool_result`` plus a ``state:`` line
with the other listed ``observation_fields``.

**Tool selection.** ``per_sample``: only the task's ``Task.tools`` are listed in the prompt and callable (a
call to another tool gets an error observation, no environment step); ``all``: every tool of the env.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tether.agent.chat import ChatAssembler, TokenBuffer, observation_text
from tether.agent.parsers import ParsedTurn, ToolCall, get_parser
from tether.agent.rules import EPISODE_ENDED, apply_final_info, refused_call
from tether.engine.base import InferenceEngine, SamplingParams
from tether.engine.grammar import Grammar, Grammars, ToolSpec
from tether.env.base import Action, Env
from tether.env.memory import KeepRecentK, TurnRecord
from tether.types import USER_TOOL, Segment, Task, Trajectory

SUMMARY_PREFIX = "Earlier turns (summary): "
_REGISTRY: dict[str, type[AgentLoopBase]] = {}


def register(name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Class decorator: make an agent loop selectable by ``agent_loop.name``."""

    def deco(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"agent loop {name!r} is already registered by {_REGISTRY[name].__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return deco


def make_agent_loop(name: str, **kwargs: Any) -> AgentLoopBase:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown agent_loop.name {name!r}; registered: {sorted(_REGISTRY)}") from None
    return cls(**kwargs)


@dataclass(frozen=True)
class LoopLimits:
    """The agent_loop section's limits plus the context budget, in one place."""

    max_user_turns: int = 3
    max_assistant_turns: int = 5
    max_parallel_calls: int = 2
    tool_selection: str = "per_sample"  # "per_sample": Task.tools restricts the tools; "all": it does not
    context_window: int = 32768  # tokens of prompt + response

    @classmethod
    def from_config(cls, agent_loop: Any, context_window: int) -> LoopLimits:
        return cls(agent_loop.max_user_turns, agent_loop.max_assistant_turns, agent_loop.max_parallel_calls,
                   agent_loop.tool_selection, context_window)


class AgentLoopBase(ABC):
    def __init__(self, engine: InferenceEngine, tokenizer: Any, *, sampling: SamplingParams,
                 limits: LoopLimits = LoopLimits(), parser: str = "hermes",
                 stop_token_ids: tuple[int, ...] = (), grammars: Grammars | None = None):
        """grammars: decode every turn under a grammar of free text or schema-valid tool calls of the episode's
        tools (``agent_loop.constrained_tool_calls``); None: unconstrained."""
        self.engine = engine
        self.grammars = grammars
        self._grammar_of: dict[str, Grammar] = {}  # by the tools' schemas (JSON): compiled once per tool set
        self.tokenizer = tokenizer
        self.limits = limits
        self.parser_name = parser
        self.parse = get_parser(parser)
        vocab = len(tokenizer)
        bad = [i for i in stop_token_ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"tool_parser.stop_token_ids {bad} are outside the tokenizer's vocabulary "
                             f"(size {vocab}); use ids of this model's tokenizer")
        eos = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if
               isinstance(i, int) and 0 <= i < vocab}
        self.stop_ids = tuple(sorted(eos | set(stop_token_ids)))
        self.sampling = replace(sampling, stop_token_ids=self.stop_ids)

    def tool_grammar(self, schemas: list[dict[str, Any]]) -> Grammar | None:
        """The grammar of an episode offering ``schemas`` (None without ``grammars`` or tools)."""
        if self.grammars is None or not schemas:
            return None
        key = json.dumps(schemas, sort_keys=True)
        if key not in self._grammar_of:
            tools = [ToolSpec(s["function"]["name"], s["function"].get("parameters")) for s in schemas]
            self._grammar_of[key] = self.grammars.tool_calls(tools, required=False, parallel=True)
        return self._grammar_of[key]

    @abstractmethod
    async def run(self, task: Task, env: Env, *, seed: int | None = None) -> Trajectory:
        """Play one episode of ``task`` in ``env`` (already constructed, not yet reset)."""

    def close(self) -> None:  # noqa: B027 — most loops start nothing
        """Release what the loop started (servers, threads); the engine is its owner's."""


class AgentState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of an episode's ``turn``-th generation (None when the episode has none): a hash, so turns differ."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    async def run(self, task: Task, env: Env, *, seed: int | None = None) -> Trajectory:
        ep = _Episode(self, task, env, seed)
        state = AgentState.PENDING
        while state is not AgentState.TERMINATED:
            if state is AgentState.PENDING:
                state = ep.start()
            elif state is AgentState.GENERATING:
                state = await ep.generate()
            else:
                state = await ep.process_tools()
        return ep.finish()


class _Episode:
    """Mutable state of one ToolAgentLoop run; each method is one state of the machine."""

    def __init__(self, loop: ToolAgentLoop, task: Task, env: Env, seed: int | None):
        self.loop, self.task, self.env, self.seed = loop, task, env, seed
        self.t0 = time.perf_counter()
        self.traj = Trajectory(task_id=task.id, prompt_ids=[])
        self.messages: list[dict[str, Any]] = []
        self.buf: TokenBuffer  # the current segment (set by start)
        self.closed: list[TokenBuffer] = []  # earlier segments
        self.memory: KeepRecentK | None = None
        self.header: list[dict[str, Any]] = []  # system prompt + opening request: every segment starts with them
        self.spans: list[list[int]] = []  # token ids of every completed turn (assistant tokens + what answered)
        self.turn_start = 0  # where the current turn's assistant tokens begin in buf.response_ids
        self.turns_in_context = 0  # completed turns in the current segment's context
        self.asm: ChatAssembler  # set by start
        self.tool_names: set[str] = set()
        self.grammar: Grammar | None = None  # agent_loop.constrained_tool_calls: the turns' grammar (set by start)
        self.parsed: ParsedTurn  # set by generate
        self.user_turns = 0
        self.assistant_turns = 0
        self.env_done = False
        self.final_info: dict[str, Any] = {}

    # -- PENDING -------------------------------------------------------------------------------------
    def start(self) -> AgentState:
        obs = self.env.reset(task_id=self.task.id)
        schemas = self.env.tool_schemas()
        if self.loop.limits.tool_selection == "per_sample" and self.task.tools is not None:
            schemas = [s for s in schemas if s["function"]["name"] in self.task.tools]
        self.tool_names = {s["function"]["name"] for s in schemas}
        self.asm = ChatAssembler(self.loop.tokenizer, schemas)
        self.grammar = self.loop.tool_grammar(schemas)
        context_memory = getattr(self.env, "context_memory", None)
        self.memory = context_memory() if context_memory is not None else None
        self.messages = [{"role": "system", "content": self.env.system_prompt()},
                         {"role": "user", "content": obs.get("user_reply") or ""}]
        self.header = list(self.messages)
        self.buf = TokenBuffer(self.asm.prompt(self.messages))
        self.traj.prompt_ids = list(self.buf.prompt_ids)
        if len(self.buf) >= self.loop.limits.context_window:
            return self._terminate("context_window")
        return AgentState.GENERATING

    # -- GENERATING ----------------------------------------------------------------------------------
    async def generate(self) -> AgentState:
        limits = self.loop.limits
        if self.assistant_turns >= limits.max_assistant_turns:
            return self._terminate("max_assistant_turns")
        budget = min(self.loop.sampling.max_tokens, limits.context_window - len(self.buf))
        if budget <= 0:
            return self._terminate("context_window")
        params = replace(self.loop.sampling, max_tokens=budget, seed=turn_seed(self.seed, self.assistant_turns),
                         constraint=self.grammar)
        t = time.perf_counter()
        out = await self.loop.engine.generate(self.buf.ids, params)
        self.traj.metrics.generate_sequences += time.perf_counter() - t
        self.traj.metrics.num_preempted += out.num_preempted
        self.assistant_turns += 1
        versions = out.versions or [self.loop.engine.version] * len(out.token_ids)
        self.turn_start = len(self.buf.response_ids)
        self.buf.add_model_tokens(list(out.token_ids), list(out.logprobs), list(versions))
        ids = list(out.token_ids)
        if ids and ids[-1] in self.loop.stop_ids:
            ids = ids[:-1]
        else:  # cut by max_tokens: close the turn so the conversation stays well-formed
            self.buf.add_context_tokens([self.asm.end_of_turn_id])
        text = self.loop.tokenizer.decode(ids, skip_special_tokens=False)
        self.parsed = self.loop.parse(text)
        msg: dict[str, Any] = {"role": "assistant", "content": self.parsed.content}
        if self.parsed.calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.parsed.calls]
        self.messages.append(msg)
        self.traj.errors += [f"turn {self.assistant_turns}: malformed tool call: {e.reason}"
                             for e in self.parsed.errors]
        if self.parsed.calls or self.parsed.errors:
            return AgentState.PROCESSING_TOOLS
        if self.parsed.content and USER_TOOL in self.tool_names:
            return AgentState.PROCESSING_TOOLS
        return self._terminate("no_action")

    # -- PROCESSING_TOOLS ----------------------------------------------------------------------------
    async def process_tools(self) -> AgentState:
        parsed, limits = self.parsed, self.loop.limits
        new_messages: list[dict[str, Any]] = []
        replies: list[str] = []
        turn = self.assistant_turns
        records: list[TurnRecord] = []  # this turn as the memory summarises it
        if not parsed.calls and not parsed.errors:  # plain text: it is said to the user
            results = await self._execute([ToolCall(USER_TOOL, {"message": parsed.content})])
            obs = results[0]
            shown = observation_text(obs)
            if obs.get("tool_error"):
                new_messages.append({"role": "tool", "content": shown})
            if obs.get("user_reply"):
                replies.append(obs["user_reply"])
            records.append(TurnRecord(turn, USER_TOOL, {"message": parsed.content}, shown,
                                      bool(obs.get("tool_error")), obs.get("user_reply")))
        else:
            calls = parsed.calls[: limits.max_parallel_calls]
            results = await self._execute(calls)
            for call, obs in zip(calls, results):
                shown = observation_text(obs)
                new_messages.append({"role": "tool", "tool_call_id": call.id, "content": shown})
                if obs.get("user_reply"):
                    replies.append(obs["user_reply"])
                records.append(TurnRecord(turn, call.name, call.arguments, shown, bool(obs.get("tool_error")),
                                          obs.get("user_reply")))
            for n, call in enumerate(parsed.calls[limits.max_parallel_calls:], limits.max_parallel_calls + 1):
                err = refused_call(call.name, self.tool_names, env_done=self.env_done, call_in_turn=n,
                                   max_parallel_calls=limits.max_parallel_calls)
                assert err is not None  # beyond max_parallel_calls: refused whatever the call
                self.traj.errors.append(err)
                new_messages.append({"role": "tool", "tool_call_id": call.id, "content": err})
                records.append(TurnRecord(turn, call.name, call.arguments, err, True))
            for e in parsed.errors:
                err = f"error: could not parse tool call: {e.reason}"
                new_messages.append({"role": "tool", "content": err})
                records.append(TurnRecord(turn, "malformed_call", None, err, True))
        new_messages += [{"role": "user", "content": r} for r in replies]
        self.user_turns += len(replies)
        self.messages += new_messages
        if self.memory is not None:
            for record in records:
                self.memory.add(record)
        if self.env_done:
            return AgentState.TERMINATED
        if self.user_turns >= limits.max_user_turns:
            return self._terminate("max_user_turns")
        suffix = self.asm.suffix_after_assistant({"role": "assistant", "content": "a"}, new_messages)
        self.spans.append(self.buf.response_ids[self.turn_start:] + suffix)
        self.turns_in_context += 1
        if self.memory is not None and self.turns_in_context > self.memory.k:
            return self._new_segment()
        if len(self.buf) + len(suffix) >= limits.context_window:
            return self._terminate("context_window")
        self.buf.add_context_tokens(suffix)
        return AgentState.GENERATING

    def _new_segment(self) -> AgentState:
        """Continue in a fresh context: header, summary of what fell out, the last k turns (module docstring)."""
        assert self.memory is not None  # only a bounded memory starts a segment (process_tools)
        k = self.memory.k
        messages = list(self.header)
        summary = self.memory.summary()
        if summary:
            messages.append({"role": "system", "content": SUMMARY_PREFIX + summary})
        prompt = self.asm.prompt(messages) + [t for span in self.spans[-k:] for t in span]
        if len(prompt) >= self.loop.limits.context_window:
            return self._terminate("context_window")
        self.closed.append(self.buf)
        self.buf = TokenBuffer(prompt)
        self.turns_in_context = k
        return AgentState.GENERATING

    async def _execute(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """Run the calls of one turn concurrently; every outcome becomes an observation."""
        t = time.perf_counter()
        actions: list[Action] = [{"name": c.name, "params": c.arguments} for c in calls]
        outcomes = await asyncio.gather(*(self._step(a) for a in actions))
        self.traj.metrics.tool_calls += time.perf_counter() - t
        self.traj.num_tool_calls += sum(1 for c in calls if c.name != USER_TOOL)
        return outcomes

    async def _step(self, action: Action) -> dict[str, Any]:
        name = action["name"]
        err = refused_call(name, self.tool_names, env_done=self.env_done)  # calls past the limit never get here
        if err is not None:
            if err != EPISODE_ENDED:  # that one is no error of the call: an earlier call of this turn ended the episode
                self.traj.errors.append(err)
            return {"last_tool_result": err, "tool_error": True}
        obs, reward, done, info = await self.env.astep(action)
        if obs.get("tool_error"):
            self.traj.errors.append(f"tool {name}: {obs.get('last_tool_result', '')}")
        if done and not self.env_done:
            self.env_done = True
            self.traj.reward = float(reward)
            self.final_info = dict(info)
        return obs

    # -- TERMINATED ----------------------------------------------------------------------------------
    def _terminate(self, reason: str) -> AgentState:
        if not self.env_done:
            t = time.perf_counter()
            reward, info = self.env.finalize(reason)
            self.traj.metrics.compute_score += time.perf_counter() - t
            self.traj.reward = float(reward)
            self.final_info = dict(info)
            self.final_info.setdefault("termination", reason)
            self.env_done = True
        return AgentState.TERMINATED

    def finish(self) -> Trajectory:
        tr, info = self.traj, self.final_info
        first, *rest = [*self.closed, self.buf]
        tr.prompt_ids, tr.response_ids, tr.response_mask = first.prompt_ids, first.response_ids, first.response_mask
        tr.logprobs, tr.versions = first.logprobs, first.versions
        tr.continuations = [Segment(b.prompt_ids, b.response_ids, b.response_mask, b.logprobs, b.versions)
                            for b in rest]
        tr.messages = self.messages
        apply_final_info(tr, info)
        tr.num_user_turns, tr.num_assistant_turns = self.user_turns, self.assistant_turns
        tr.metrics.num_turns = self.user_turns + self.assistant_turns + 1
        tr.check()
        return tr


def transcript(traj: Trajectory) -> str:
    """A readable rendering of a trajectory's conversation (for tables and debugging)."""
    lines = []
    for m in traj.messages:
        body = m.get("content", "")
        for c in m.get("tool_calls", []):
            body += f" [call {c['function']['name']}({json.dumps(c['function']['arguments'])})]"
        lines.append(f"{m['role']}: {body}")
    return "\n".join(lines)
