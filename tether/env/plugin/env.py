"""``ToolEnvironment`` (what a user writes) and ``ToolEnv`` (one episode at a time, the ``Env`` protocol).

A ``ToolEnvironment`` is tools as plain functions, tasks (a file or a function), the episode's state, and the
verifier's parts as functions over that state; everything else — timeouts and simulated latency, argument
checks, memory, termination, the hybrid verifier and anti-hacking — comes from the config's ``environment``
section through the same building blocks the customer-service environment is made of (it is one of these)::

    environment = ToolEnvironment(
        tools=[add, submit],                       # functions; a ``state`` parameter is the episode's state
        tasks=HERE / "tasks.jsonl",                # or a function (split, config) -> tasks
        system_prompt="Compute the answer with the tools, then submit it.",
        new_state=lambda task: {"answer": None},   # a fresh state per episode
        rules={"correct": lambda state, transcript, task: float(state["answer"] == task.data["answer"])},
        terminal_tools=("submit",), terminal_reason="submitted",
    )

``environment.name: my_package.module:environment`` selects it (``tether.env.plugin.registry``); the
config's ``action_space`` binds tools to the functions (``functions.bind``), ``verifier.rule_based`` /
``model_based`` name the ``rules`` / ``rubrics`` and weigh them, ``state.observation_fields`` picks among
``last_tool_result`` and the ``observations`` functions.

An episode (``ToolEnv``) runs like the customer-service one (``tether.env.base`` has the protocol): each step is
one tool call, checked and run under its timeout; ``on_result(state, result)`` updates the state's view after
a successful call; a call of ``user_tool`` (``respond_to_user``) is a message to the user: the model sees
``{"sent": true}`` and the function's return value is the user's reply (``observation["user_reply"]``).
After every step ``TerminationRule`` decides: ``resolved(state)`` (the success criterion), a terminal tool
(ending ``terminal_reason``), the tool-error threshold or ``max_turns``. The step that ends the episode returns
the verifier's reward with its breakdown and the hacking flags in ``info``.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tether.config import EnvironmentConfig, RunConfig, load_config
from tether.env.anti_hacking import HackingDetector, penalty_of, state_digest
from tether.env.base import Action, Observation, StepOutput, run_step
from tether.env.mcp import McpEpisode, McpTools
from tether.env.memory import KeepRecentK, TurnRecord, make_memory
from tether.env.plugin.functions import bind, tool_functions
from tether.env.plugin.tasks import SPLITS, TaskSource, tasks_from
from tether.env.termination import MAX_TURNS, Ending, TerminationRule
from tether.env.tools import ToolBox, ToolResult, error_text, parse_action
from tether.env.verifier import (
    DeterministicJudge,
    GateFn,
    HybridVerifier,
    Judge,
    ProgressFn,
    RubricFn,
    RuleFn,
    Transcript,
    Verdict,
)
from tether.types import Task

SENT = '{"sent": true}'
USER_TOOL = "respond_to_user"


class EpisodeEndedError(RuntimeError):
    """step() after the episode ended, or before reset()."""


def environment_config(config: Any = None) -> EnvironmentConfig:
    """Accept a RunConfig, an EnvironmentConfig, a YAML path, or a dict (with or without ``environment:``)."""
    if config is None:
        return EnvironmentConfig()
    if isinstance(config, EnvironmentConfig):
        return config
    if isinstance(config, RunConfig):
        return config.environment
    if isinstance(config, (str, Path)):
        return load_config(config).environment
    if isinstance(config, Mapping):
        if "environment" not in config:
            return EnvironmentConfig.model_validate(config)
        if set(config) == {"environment"}:
            return EnvironmentConfig.model_validate(config["environment"])
        return RunConfig.model_validate(config).environment
    raise TypeError(f"an environment's config must be a RunConfig, EnvironmentConfig, path or dict, "
                    f"got {type(config).__name__}")


def _opening(task: Task) -> str:
    try:
        return str(task.data["prompt"])
    except KeyError:
        raise KeyError(f"task {task.id!r} has no 'prompt' (the user's first message); give the environment an "
                       f"opening(task) function or the tasks a prompt") from None


@dataclass(frozen=True)
class ToolEnvironment:
    """A user's environment: see the module docstring. Only ``tools``, ``tasks`` and ``system_prompt`` are needed."""

    tools: Sequence[Callable[..., Any]] | Mapping[str, Callable[..., Any]]
    tasks: TaskSource
    system_prompt: str | Callable[[Task], str]
    new_state: Callable[[Task], Any] = lambda task: {}
    rules: Mapping[str, RuleFn] = field(default_factory=dict)  # (state, transcript, task) -> [0, 1]
    rubrics: Mapping[str, RubricFn] = field(default_factory=dict)  # (transcript, task) -> [0, 1]
    judge: Judge | None = None  # scores the rubrics instead (e.g. an LLM judge); None = DeterministicJudge(rubrics)
    gate: GateFn = lambda transcript, task: True  # the rules (and ``gated`` rubrics) score 0 unless it holds
    gated: Sequence[str] = ()
    progress: ProgressFn = lambda state, transcript, task: False  # partial credit of a truncated episode
    opening: Callable[[Task], str] = _opening  # the user's first message
    observations: Mapping[str, Callable[[Any, Task], Any]] = field(default_factory=dict)  # observation fields
    on_result: Callable[[Any, ToolResult], None] | None = None  # after a successful call, while the episode runs
    resolved: Callable[[Any], bool] | None = None  # the success criterion (termination.success_criteria)
    terminal_tools: Sequence[str] = ()
    terminal_reason: str = "terminal_tool"
    user_tool: str = USER_TOOL
    digest: Callable[[Any], str] = state_digest  # the state's fingerprint (anti-hacking ``no_op_pass``)
    close_state: Callable[[Any], None] | None = None
    # a policy that solves a task (task -> observation -> action): ``tether verify env`` plays it to check that a
    # solved episode scores the maximum, to take valid arguments for each tool and to plant hacks in; None: those
    # probes are skipped, saying so
    expert: Callable[[Task], Callable[[Observation], Action]] | None = None

    # -- the registry's pair: make_env(config), list_tasks(split, config) ------------------------------------
    def make_env(self, config: Any = None) -> ToolEnv:
        return ToolEnv(self, config)

    def list_tasks(self, split: str, config: Any = None) -> list[Task]:
        """The ``split`` tasks, at most ``environment.num_train_tasks`` / ``num_eval_tasks`` of them."""
        cfg = environment_config(config)
        tasks = tasks_from(self.tasks, split, cfg)
        return tasks[: cfg.num_train_tasks if split == "train" else cfg.num_eval_tasks]


@dataclass
class _Episode:
    task: Task
    state: Any
    toolbox: ToolBox
    memory: KeepRecentK
    detector: HackingDetector
    rng: random.Random
    start_digest: str | None = None
    started: int = 0  # steps begun (several may run at once: parallel calls of one assistant turn)
    finished: int = 0  # steps completed
    tool_errors: int = 0
    records: list[TurnRecord] = field(default_factory=list)
    ending: Ending | None = None
    final: tuple[float, dict[str, Any]] | None = None
    mcp: McpEpisode | None = None  # the episode's MCP tools and sessions (``environment.mcp_servers``)


def with_flags(verdict: Verdict, flags: Mapping[str, int], penalty: Mapping[str, float]) -> Verdict:
    """``verdict`` re-priced for ``flags`` (end-of-episode patterns found after scoring)."""
    pen = round(penalty_of(flags, penalty), 9)
    return replace(verdict, hacking_flags=dict(flags), hacking_penalty=pen,
                   reward=round(verdict.reward + verdict.hacking_penalty - pen, 9))


class ToolEnv:
    """One ``ToolEnvironment`` under one config; plays one episode at a time (run many for concurrency)."""

    def __init__(self, definition: ToolEnvironment, config: Any = None):
        self.definition = d = definition
        self.config = cfg = environment_config(config)
        functions = tool_functions(d.tools)
        self._ep: _Episode | None = None
        self._mcp: McpTools | None = None
        if cfg.mcp_servers:  # started and listed now (the mcp SDK imported then): a clash or a dead server fails here
            self._mcp = McpTools(cfg.mcp_servers, functions, cfg.action_space)
        self._owner = True  # this environment (not one spawned from it) closes the MCP servers
        try:
            self._build(d, cfg, functions)
        except BaseException:
            self.close()
            raise

    def _build(self, d: ToolEnvironment, cfg: EnvironmentConfig, functions: dict[str, Callable[..., Any]]) -> None:
        self._bound = bind(functions, cfg.action_space, self._mcp.names if self._mcp else ())
        names = [b.name for b in self._bound] + (self._mcp.names if self._mcp else [])
        self.termination = TerminationRule.from_config(cfg.termination, cfg.state.max_turns,
                                                       [n for n in d.terminal_tools if n in names], d.terminal_reason)
        judge = d.judge if d.judge is not None else DeterministicJudge(d.rubrics)
        self.verifier = HybridVerifier.from_config(cfg.verifier, rule_fns=d.rules, judge=judge, gate=d.gate,
                                                   gated=d.gated, progress=d.progress)
        known = ["last_tool_result", *d.observations]
        unknown = [f for f in cfg.state.observation_fields if f not in known]
        if unknown:
            raise ValueError(f"environment.state.observation_fields lists {unknown}; this environment observes {known}")
        self.observation_fields = list(cfg.state.observation_fields)
        self._tasks = {split: self.definition.list_tasks(split, cfg) for split in SPLITS}
        self._by_id = {t.id: t for split in SPLITS for t in self._tasks[split]}
        self._next_train = 0

    def spawn(self) -> ToolEnv:
        """Another environment of this definition and config, with no episode begun. It shares what is built per
        config (bound tools and their schemas, the termination rule, the verifier, the task lists), so that one made
        per episode costs only the episode (``tether.runtime.env_factory`` makes the rollouts' environments so).
        A subclass with attributes of its own that an episode changes must copy them here."""
        env = copy.copy(self)
        env._ep, env._next_train, env._owner = None, 0, False
        return env

    # -- tasks and episode set-up -----------------------------------------------------------------------
    def tasks(self, split: str) -> list[Task]:
        """This environment's ``"train"`` or ``"eval"`` tasks."""
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return list(self._tasks[split])

    def get_task(self, task_id: str) -> Task:
        try:
            return self._by_id[task_id]
        except KeyError:
            raise KeyError(f"unknown task id {task_id!r}; this environment has {len(self._tasks['train'])} train and "
                           f"{len(self._tasks['eval'])} eval tasks") from None

    def reset(self, task_id: str | None = None, *, task: Task | None = None, seed: int | None = None) -> Observation:
        """Start an episode of ``task_id`` (None: the next train task, cycling in order), or of an explicit ``task``.
        ``seed`` varies the simulated latencies between episodes of one task."""
        if task is None:
            if task_id is None:
                train = self._tasks["train"]
                task = train[self._next_train % len(train)]
                self._next_train += 1
            else:
                task = self.get_task(task_id)
        self._end_episode()
        d = self.definition
        state = d.new_state(task)
        detector = HackingDetector.from_config(self.config.verifier.anti_hacking)
        mcp = self._mcp.episode() if self._mcp is not None else None  # episode-scope servers start now, in background
        self._ep = _Episode(
            task=task, state=state, toolbox=ToolBox([b.tool(state) for b in self._bound] + (mcp.tools if mcp else [])),
            mcp=mcp,
            memory=make_memory(self.config.state.memory), detector=detector,
            rng=random.Random(f"{self.config.seed}:{task.id}:{seed or 0}"),
            start_digest=d.digest(state) if detector.wants_finish else None)
        return self._observation(self._ep, None, d.opening(task), False)

    # -- stepping -------------------------------------------------------------------------------------
    def step(self, action: Action) -> StepOutput:
        return run_step(self.astep, action)

    async def astep(self, action: Action) -> StepOutput:
        ep = self._ep
        if ep is None:
            raise EpisodeEndedError("no episode: call reset() first")
        if ep.ending is not None:
            raise EpisodeEndedError(f"the episode of {ep.task.id} has ended ({ep.ending.reason}); call reset()")
        ep.started += 1
        turn = ep.started
        name, params, problem = parse_action(action)
        flags = ep.detector.observe(name, params)
        if problem is not None:
            result = ToolResult(str(name), params, error_text(problem), True)
        else:
            if ep.mcp is not None:  # the episode's servers have started (not counted in a call's timeout)
                await ep.mcp.ready()
            result = await ep.toolbox.call(name, params, ep.rng)
        if ep.ending is not None:  # another call of this turn ended the episode while this one ran
            obs = self._observation(ep, result.text, None, result.error)
            return obs, 0.0, True, {"turn": turn, "tool_error": result.error, "termination": ep.ending.reason,
                                    "after_end": True}
        ep.finished += 1
        shown, user_reply, terminal = self._absorb(ep, result)
        record = TurnRecord(turn, str(name), params, shown, result.error, user_reply)
        ep.records.append(record)
        ep.memory.add(record)
        info: dict[str, Any] = {"turn": turn, "tool_error": result.error, "hacking": flags,
                                "latency_ms": result.latency_ms}
        obs = self._observation(ep, shown, user_reply, result.error)
        resolved = self.definition.resolved
        ending = self.termination.check(resolved=bool(resolved and resolved(ep.state)), terminal_call=terminal,
                                        tool_errors=ep.tool_errors, turns=ep.finished)
        if ending is None:
            return obs, 0.0, False, info
        reward, end_info = self._end(ep, ending)
        return obs, reward, True, {**info, **end_info}

    def _absorb(self, ep: _Episode, result: ToolResult) -> tuple[str, str | None, bool]:
        """Update the episode from a result: (text shown to the model, user reply, terminal call)."""
        if result.error:
            ep.tool_errors += 1
            return result.text, None, False
        if result.name == self.definition.user_tool:
            return SENT, result.value, False
        if self.definition.on_result is not None:
            self.definition.on_result(ep.state, result)
        return result.text, None, result.name in self.termination.terminal_tools

    def _observation(self, ep: _Episode, last: str | None, user_reply: str | None, error: bool) -> Observation:
        obs: dict[str, Any] = {}
        for f in self.observation_fields:
            obs[f] = last if f == "last_tool_result" else self.definition.observations[f](ep.state, ep.task)
        obs.update(user_reply=user_reply, tool_error=error, memory=ep.memory.view())
        return obs

    def _end(self, ep: _Episode, ending: Ending) -> tuple[float, dict[str, Any]]:
        t = time.perf_counter()
        verdict = self.verifier.verify(ep.state, Transcript(list(ep.records), ending.reason), ep.task,
                                       dict(ep.detector.flags), partial=ending.reason == MAX_TURNS and ending.truncated)
        if ending.failed:
            verdict = verdict.as_failure()
        if ep.detector.wants_finish:
            wrote = self.definition.digest(ep.state) != ep.start_digest
            if ep.detector.finish(wrote=wrote, passed=verdict.success):
                verdict = with_flags(verdict, {p: n for p, n in ep.detector.flags.items() if n}, self.verifier.penalty)
        info = {"termination": ending.reason, "truncated": ending.truncated, "max_turns_failed": ending.failed,
                **verdict.info(),
                "num_turns": ep.finished, "tool_errors": ep.tool_errors,
                "compute_score_s": time.perf_counter() - t}
        ep.ending, ep.final = ending, (verdict.reward, info)
        return verdict.reward, dict(info)

    def finalize(self, reason: str) -> tuple[float, dict[str, Any]]:
        """End the episode for a reason decided outside (e.g. the agent loop's ``max_assistant_turns``) and
        score it; returns the stored result when it has already ended."""
        ep = self._ep
        if ep is None:
            raise EpisodeEndedError("no episode: call reset() first")
        if ep.final is not None:
            return ep.final[0], dict(ep.final[1])
        return self._end(ep, TerminationRule.external(reason))

    # -- what the model sees --------------------------------------------------------------------------
    def tool_schemas(self) -> list[dict[str, Any]]:
        if self._ep is not None:
            return self._ep.toolbox.schemas()
        return [b.tool().schema() for b in self._bound] + (self._mcp.schemas() if self._mcp else [])

    def system_prompt(self) -> str:
        prompt = self.definition.system_prompt
        if isinstance(prompt, str):
            return prompt
        task = self._ep.task if self._ep is not None else None
        if task is None:
            raise RuntimeError("this environment's system prompt depends on the task: call reset() first")
        return prompt(task)

    def context_memory(self) -> KeepRecentK:
        """A fresh ``state.memory`` for the agent loop: it bounds how many turns the policy sees verbatim."""
        return make_memory(self.config.state.memory)

    # -- inspection -----------------------------------------------------------------------------------
    @property
    def task(self) -> Task | None:
        return self._ep.task if self._ep else None

    @property
    def state(self) -> Any:
        """The current episode's state (for tests and debugging)."""
        return self._ep.state if self._ep else None

    @property
    def done(self) -> bool:
        return self._ep is not None and self._ep.ending is not None

    def _end_episode(self) -> None:
        if self._ep is not None:
            ep, self._ep = self._ep, None
            if ep.mcp is not None:
                ep.mcp.close()
            if self.definition.close_state is not None:
                self.definition.close_state(ep.state)

    def shutdown(self) -> None:
        """At the end of the run (``tether.runtime.shutdown_environment``): what the episodes share stops."""
        self.close()

    def close(self) -> None:
        """End the episode; the environment that was built (not one ``spawn``ed from it) also stops its MCP servers,
        waiting for every server process of its episodes to exit."""
        self._end_episode()
        if getattr(self, "_owner", False) and self._mcp is not None:
            self._mcp.close()
