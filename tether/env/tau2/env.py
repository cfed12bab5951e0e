"""``Tau2Env``: one tau2-bench domain (``mock``, ``retail``, ``airline``) behind tether's ``Env`` protocol.

Each ``reset`` builds tau2's own domain ``Environment`` for the episode (its database loaded fresh from tau2's data,
then the task's ``initial_state`` applied: initialization data, initialization actions, message history), so
episodes share nothing and run concurrently in separate instances. The agent sees tau2's tools with tau2's own
schemas (``Tool.openai_schema``) plus one tool of tether's: ``respond_to_user(message)`` in user-simulator mode
(the agent loop delivers plain assistant text through it) or ``done()`` in solo mode (tau2's solo agent's stop
tool). Every step is recorded as the tau2 messages tau2's orchestrator would have recorded (an
``AssistantMessage`` with the tool call, the ``ToolMessage`` tau2's ``Environment.get_response`` returned; the
agent's text and the user's reply), and the finished episode is scored by tau2's own evaluator on those messages
(``tether.env.tau2.scoring``).

**Modes.** Solo (``environment.user_simulator: scripted``, the default; tau2 has no scripted user): no user; the
system prompt is tau2's solo-agent prompt with the policy and the ticket (the task's ``ticket``, or its
``user_scenario`` where the task has none, as in retail and airline); the episode ends when the agent calls
``done`` (tau2's ``AGENT_STOP``). tau2 itself has a solo mode for mock only (retail and airline raise); there
tether's solo episode runs tau2's environment and evaluator in their normal mode, which differs from solo mode
only in routing user tools, which these domains do not have. User simulator (``user_simulator: llm``): the
system prompt is tau2's agent prompt with the domain policy; the conversation opens with tau2's greeting and the
simulated user's first message; it ends when the user writes a stop token (``USER_STOP``). Anything else that
ends an episode (``max_steps``: ``environment.state.max_turns``; ``max_errors``: ``environment.termination.
tool_error_threshold``; the agent loop's limits; a solo turn without a tool call) is one of tau2's premature
terminations, which tau2 scores 0.

**Anti-hacking.** ``environment.verifier.anti_hacking``'s call patterns are watched per step (each successful call
of a tool tau2 types as a write is reported to the detector as a state change, so a read repeated after it is not a
stale repeat: ``tether.env.anti_hacking``); at the end, an
episode that passed while leaving both databases as they were at the start (tau2's own hashes) is flagged
``no_op_pass``: tau2's database check passes a do-nothing agent on every task whose gold actions write nothing.
``no_op_pass`` is watched whether or not ``detect_patterns`` lists it (``anti_hacking.enabled: false`` turns every
pattern off). Flags cost ``anti_hacking.penalty`` reward (``no_op_pass``: none unless ``penalty.no_op_pass`` is set,
since a correct refusal is also a pass that writes nothing); ``info["tau2_reward"]`` keeps tau2's reward.

End-of-episode ``info``: ``termination`` (tether's reason: tau2's termination value or the agent loop's),
``tau2_termination``, ``truncated``, ``reward_components`` (``db``, ``env_assertion``, ``action``,
``communicate``, ``nl``: what tau2 evaluated), ``reward_basis``, ``skipped_components``, ``tau2_reward``,
``hacking_flags``, ``hacking_penalty``, ``success`` (tau2's pass, nothing skipped), ``wrote_db`` (whether the
databases differ from the start; None when the episode did not pass: it is computed for passes only), ``num_turns``,
``tool_errors``, ``compute_score_s``, ``note``; ``messages`` (tau2 message objects) is ``tau2_messages``.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tether.env.tau2.scoring as scoring
from tether.config.environment import TAU2_MAX_ERRORS, TAU2_MAX_STEPS
from tether.env.anti_hacking import HackingDetector, penalty_of
from tether.env.base import Action, Observation, StepOutput, run_step
from tether.env.memory import make_memory
from tether.env.tau2._load import load, make_environment, tasks_by_id, tau2_solo
from tether.env.tau2.user import is_stop
from tether.env.termination import CUT_REASONS
from tether.env.tools import parse_action

NO_OP_PASS = "no_op_pass"  # the anti-hacking pattern (``environment.verifier.anti_hacking``)
RESPOND = "respond_to_user"
DONE = "done"
SENT = '{"sent": true}'
SOLO_STOP = "###STOP###"
GREETING = "Hi! How can I help you today?"  # tau2's DEFAULT_FIRST_AGENT_MESSAGE
SOLO_OPENING = "Solve the ticket in your instructions."
RESPOND_SCHEMA = {"type": "function", "function": {
    "name": RESPOND, "description": "Send a message to the user; returns their reply.",
    "parameters": {"type": "object", "properties": {"message": {"type": "string", "description": "The message."}},
                   "required": ["message"]}}}
DONE_SCHEMA = {"type": "function", "function": {
    "name": DONE, "description": "Call this function when you are done with the task.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}
User = Callable[[list[Any]], str]


class EpisodeEndedError(RuntimeError):
    """step() after the episode ended, or before reset()."""


@functools.cache
def _tau2_schemas(domain: str, solo: bool) -> tuple[dict[str, Any], ...]:
    env = make_environment(domain, solo=solo)
    return tuple(t.openai_schema for t in env.get_tools())


@functools.cache
def _write_tools(domain: str, solo: bool) -> frozenset[str]:
    """The names of ``domain``'s tools that tau2 types as writes (``ToolType.WRITE``)."""
    from tau2.environment.toolkit import ToolType  # noqa: PLC0415 — the optional extra ``tau2``

    tools = make_environment(domain, solo=solo).tools
    return frozenset(n for n in tools.get_tools() if tools.tool_type(n) == ToolType.WRITE)


def _initial_digest(domain: str, task: Any, solo: bool) -> tuple[str | None, str | None]:
    """The databases' hashes at the start of an episode of ``task`` (one per domain for tasks without an
    initial state, one per task otherwise)."""
    return _digest_of(domain, task.id if task.initial_state is not None else None, solo)


@functools.cache
def _digest_of(domain: str, task_id: str | None, solo: bool) -> tuple[str | None, str | None]:
    if task_id is None:
        return scoring.db_digest(make_environment(domain, solo=solo))
    env, _ = _fresh(domain, tasks_by_id(domain)[task_id], solo)
    return scoring.db_digest(env)


def _fresh(domain: str, task: Any, solo: bool) -> tuple[Any, list[Any]]:
    """tau2's environment for ``task`` with its initial state applied, and the initial message history."""
    env = make_environment(domain, solo=solo)
    init = task.initial_state
    history = list(init.message_history or []) if init is not None else []
    env.set_state(initialization_data=init.initialization_data if init is not None else None,
                  initialization_actions=init.initialization_actions if init is not None else None,
                  message_history=history)
    return env, copy.deepcopy(history)


def solo_compatible(task: Any) -> bool:
    """Whether a task can be played solo: its initial history holds no user message (tau2 refuses them in a
    solo episode's history, ``Environment.set_state``; with no user, nothing would answer them either)."""
    from tau2.data_model.message import UserMessage  # noqa: PLC0415 — the optional extra ``tau2``

    history = (task.initial_state.message_history or []) if task.initial_state is not None else []
    return not any(isinstance(m, UserMessage) for m in history)


@dataclass
class _Episode:
    task: Any
    env: Any
    messages: list[Any]
    start_digest: tuple[str | None, str | None]
    detector: HackingDetector
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    steps: int = 0
    tool_errors: int = 0
    calls: int = 0
    ending: str | None = None
    final: tuple[float, dict[str, Any]] | None = None


class Tau2Env:
    """One tau2 domain. ``user``: a callable ``(text messages) -> reply`` (``tether.env.tau2.user``), or a factory
    ``task -> user`` (``user_factory``); required in user-simulator mode (``solo=False``). ``judge``: the NL
    assertions' judge (``scoring.Judge``); None = NL assertions skipped. ``anti_hacking``: an
    ``AntiHackingConfig`` (None: only ``no_op_pass`` watched, no penalty). ``memory``: a ``MemoryConfig`` for the
    agent loop's context bound (``context_memory``)."""

    def __init__(self, domain: str, *, solo: bool = True, user_factory: Callable[[Any], User] | None = None,
                 judge: scoring.Judge | None = None, max_steps: int = TAU2_MAX_STEPS, max_errors: int = TAU2_MAX_ERRORS,
                 anti_hacking: Any = None, memory: Any = None, task_ids: list[str] | None = None,
                 user_timeout_s: float | None = None):
        load()
        self.domain, self.solo = domain, solo
        self.user_factory, self.judge = user_factory, judge
        self.max_steps, self.max_errors = max_steps, max_errors
        self.anti_hacking, self.memory = anti_hacking, memory
        self.user_timeout_s = user_timeout_s  # a user reply slower than this is a failed respond_to_user
        if not solo and user_factory is None:
            raise ValueError("a tau2 episode with a user needs a user simulator (environment.user_llm)")
        self._tasks = tasks_by_id(domain)
        self._train = list(task_ids) if task_ids is not None else list(self._tasks)
        names = {s["function"]["name"] for s in _tau2_schemas(domain, solo)}
        own = DONE if solo else RESPOND
        if own in names:
            raise ValueError(f"tau2 domain {domain!r} has a tool named {own!r}, which tether reserves")
        self.verifier = self  # the Env protocol's verifier: scoring is tau2's evaluator (``scoring.score``)
        self._next = 0
        self._ep: _Episode | None = None
        self._user: User | None = None
        self._system = ""

    # -- episode set-up --------------------------------------------------------------------------------
    def reset(self, task_id: str | None = None, *, seed: int | None = None) -> Observation:
        if task_id is None:
            task_id = self._train[self._next % len(self._train)]
            self._next += 1
        try:
            task = self._tasks[task_id]
        except KeyError:
            raise KeyError(f"unknown tau2 {self.domain} task id {task_id!r}") from None
        if self.solo and not solo_compatible(task):
            raise ValueError(f"tau2 {self.domain} task {task_id!r} opens with user messages: it has no solo mode")
        from tau2.agent.llm_agent import (  # noqa: PLC0415 — the optional extra ``tau2``
            AGENT_INSTRUCTION,
            AGENT_SOLO_INSTRUCTION,
            SYSTEM_PROMPT,
            SYSTEM_PROMPT_SOLO,
        )
        from tau2.data_model.message import AssistantMessage, UserMessage  # noqa: PLC0415 — the optional extra ``tau2``

        env, messages = _fresh(self.domain, task, self.solo)
        ah = self.anti_hacking  # the call patterns; no_op_pass is judged at the end (``_end``)
        detector = HackingDetector(ah.enabled, [p for p in ah.detect_patterns if p != NO_OP_PASS], ah.repeat_window,
                                   ah.max_repeats) if ah is not None else HackingDetector(patterns=[])
        self._ep = ep = _Episode(task, env, messages, _initial_digest(self.domain, task, self.solo), detector)
        policy = env.get_policy()
        if self.solo:
            ticket = task.ticket or str(task.user_scenario)
            self._system = SYSTEM_PROMPT_SOLO.format(
                agent_instruction=AGENT_SOLO_INSTRUCTION.format(stop_function_name=DONE, stop_token=SOLO_STOP),
                domain_policy=policy, ticket=ticket)
            return self._obs(None, _render_history(messages) + SOLO_OPENING, False)
        self._system = SYSTEM_PROMPT.format(agent_instruction=AGENT_INSTRUCTION, domain_policy=policy)
        assert self.user_factory is not None
        self._user = self.user_factory(task)
        prior = _render_history(messages)
        if not messages or not isinstance(messages[-1], AssistantMessage):
            messages.append(AssistantMessage(role="assistant", content=GREETING))
        reply = self._user(_text_messages(messages))
        messages.append(UserMessage(role="user", content=reply))
        if is_stop(reply):  # the user ended the conversation before the agent acted
            self._end(ep, "user_stop")
        return self._obs(None, prior + reply, False)

    # -- stepping ---------------------------------------------------------------------------------------
    def step(self, action: Action) -> StepOutput:
        return run_step(self.astep, action)

    async def astep(self, action: Action) -> StepOutput:
        ep = self._ep
        if ep is None:
            raise EpisodeEndedError("no episode: call reset() first")
        async with ep.lock:  # the calls of one assistant turn are recorded one after the other
            if ep.final is not None:  # ended (by the user's first message, or another call of this turn)
                obs = self._obs("error: the episode has ended", None, True)
                return obs, ep.final[0], True, {**ep.final[1], "after_end": True}
            obs, termination, flags = await self._act(ep, action)
            ep.steps += 1
            if termination is None and ep.tool_errors >= self.max_errors:
                termination = "too_many_errors"
            if termination is None and ep.steps >= self.max_steps:
                termination = "max_steps"
            info: dict[str, Any] = {"turn": ep.steps, "tool_error": obs["tool_error"], "hacking": flags}
            if termination is None:
                return obs, 0.0, False, info
            reward, end_info = await asyncio.to_thread(self._end, ep, termination)
            return obs, reward, True, {**info, **end_info}

    async def _act(self, ep: _Episode, action: Action) -> tuple[Observation, str | None, list[str]]:
        from tau2.data_model.message import AssistantMessage, ToolCall, UserMessage  # noqa: PLC0415 — the optional extra ``tau2``

        name, params, problem = parse_action(action)
        flags = ep.detector.observe(name, params)
        if problem is not None:
            ep.tool_errors += 1
            return self._obs(f"error: {problem}", None, True), None, flags
        if name == RESPOND and not self.solo:
            text = params.get("message") if isinstance(params, dict) else None
            if not isinstance(text, str) or not text.strip():
                ep.tool_errors += 1
                return self._obs("error: respond_to_user takes a non-empty 'message' string", None, True), None, flags
            assert self._user is not None
            said = AssistantMessage(role="assistant", content=text)
            try:
                reply = await asyncio.wait_for(asyncio.to_thread(self._user, _text_messages([*ep.messages, said])),
                                               self.user_timeout_s)
            except TimeoutError:
                ep.tool_errors += 1
                return self._obs(f"error: the user did not answer within {self.user_timeout_s:g} s "
                                 "(action_space respond_to_user timeout_ms)", None, True), None, flags
            ep.messages += [said, UserMessage(role="user", content=reply)]
            return self._obs(SENT, reply, False), ("user_stop" if is_stop(reply) else None), flags
        if name == DONE and self.solo:
            ep.messages.append(AssistantMessage(role="assistant", content=SOLO_STOP))
            return self._obs("done", None, False), "agent_stop", flags
        ep.calls += 1
        call = ToolCall(id=f"call_{ep.calls}", name=name, arguments=dict(params or {}), requestor="assistant")
        ep.messages.append(AssistantMessage(role="assistant", tool_calls=[call]))
        result = ep.env.get_response(call)
        ep.messages.append(result)
        if result.error:
            ep.tool_errors += 1
        elif name in _write_tools(self.domain, self.solo):  # a write took effect: re-reading is not a stale repeat
            ep.detector.state_changed()
        return self._obs(result.content, None, bool(result.error)), None, flags

    def _obs(self, last: str | None, user_reply: str | None, error: bool) -> Observation:
        return {"last_tool_result": last, "user_reply": user_reply, "tool_error": error}

    # -- the end of an episode --------------------------------------------------------------------------
    def _end(self, ep: _Episode, reason: str) -> tuple[float, dict[str, Any]]:
        t = time.perf_counter()
        tau2_reason = reason if reason in _TAU2_REASONS else ("agent_error" if reason == "no_action" else "max_steps")
        s = scoring.score(self.domain, ep.task, ep.messages, tau2_reason, solo=tau2_solo(self.domain, self.solo),
                          judge=self.judge)
        # whether the databases changed matters to a pass only (a hash costs ~0.2 s on retail's database)
        wrote = scoring.db_digest(ep.env) != ep.start_digest if s.passed else None
        ah = self.anti_hacking
        flags = {p: n for p, n in ep.detector.flags.items() if n}
        if s.passed and not wrote and (ah is None or ah.enabled):
            flags[NO_OP_PASS] = 1
        penalty = penalty_of(flags, ah.penalty) if ah is not None and ah.enabled else 0.0
        reward = s.reward - penalty
        info = {"termination": reason, "tau2_termination": tau2_reason,
                "truncated": reason in CUT_REASONS or reason == "max_steps",
                "reward_components": dict(s.components), "reward_basis": list(s.basis),
                "skipped_components": list(s.skipped), "tau2_reward": s.reward, "hacking_flags": flags,
                "hacking_penalty": penalty, "success": s.passed, "wrote_db": wrote, "num_turns": ep.steps,
                "tool_errors": ep.tool_errors, "compute_score_s": time.perf_counter() - t, "note": s.note}
        ep.ending, ep.final = reason, (reward, info)
        return reward, dict(info)

    def finalize(self, termination: str) -> tuple[float, dict[str, Any]]:
        """End the episode for a reason decided outside (the agent loop's limits); tau2 scores it 0 unless it
        already ended by a stop."""
        ep = self._ep
        if ep is None:
            raise EpisodeEndedError("no episode: call reset() first")
        if ep.final is not None:
            return ep.final[0], dict(ep.final[1])
        return self._end(ep, termination)

    # why ``tether verify env`` has no expert here (its expert probes are skipped, saying this)
    no_expert_reason = ("tau2's gold actions are no solo expert: a solo episode cannot tell a user the task's "
                        "communicate_info, and the user-simulator mode needs a model; the gold replays are checked "
                        "against tau2's own evaluator by tests/test_tau2_adapter.py")

    def stop_action(self) -> Action | None:
        """The action that ends an episode having done nothing (``tether verify env``'s no-op probe): ``done`` in
        solo mode; None with a user (the user ends the conversation)."""
        return {"name": DONE, "params": {}} if self.solo else None

    # -- what the model sees ----------------------------------------------------------------------------
    def tool_schemas(self) -> list[dict[str, Any]]:
        own = DONE_SCHEMA if self.solo else RESPOND_SCHEMA
        return [copy.deepcopy(s) for s in _tau2_schemas(self.domain, self.solo)] + [copy.deepcopy(own)]

    def system_prompt(self) -> str:
        return self._system

    def context_memory(self) -> Any:
        if self.memory is None:
            return None
        return make_memory(self.memory)

    # -- inspection -------------------------------------------------------------------------------------
    @property
    def tau2_messages(self) -> list[Any]:
        """The episode's tau2 messages (what tau2's evaluator scores)."""
        return list(self._ep.messages) if self._ep else []

    @property
    def tau2_task(self) -> Any:
        return self._ep.task if self._ep else None

    @property
    def tau2_env(self) -> Any:
        return self._ep.env if self._ep else None

    @property
    def done(self) -> bool:
        return self._ep is not None and self._ep.ending is not None

    def close(self) -> None:
        self._ep = None


_TAU2_REASONS = {"user_stop", "agent_stop", "max_steps", "too_many_errors", "agent_error", "user_error"}


def _text_messages(messages: list[Any]) -> list[Any]:
    """What the user sees: the agent's and the user's text (tool calls and results stay with the agent)."""
    from tau2.data_model.message import AssistantMessage, UserMessage  # noqa: PLC0415 — the optional extra ``tau2``

    return [m for m in messages if isinstance(m, (AssistantMessage, UserMessage))
            and not m.is_tool_call() and m.content]


def _render_history(messages: list[Any]) -> str:
    """A task's initial message history as text for the agent's opening turn ("" when there is none)."""
    if not messages:
        return ""
    lines = []
    for m in messages:
        for c in getattr(m, "tool_calls", None) or []:
            lines.append(f"assistant called {c.name}({c.arguments})")
        if m.content:
            lines.append(f"{m.role}: {m.content}")
    return "Earlier in this conversation:\n" + "\n".join(lines) + "\n\n"
