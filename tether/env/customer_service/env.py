"""``CustomerServiceEnv``: the seed's customer-service agent environment (tau-bench retail in miniature).

One instance plays one episode at a time (``reset`` → ``step``/``astep`` … → done); run many instances
for concurrency — each episode has its own copy of the database. ``reset(task_id=None)`` takes the next
train task, cycling in order (``train_000``, ``train_001``, …).

Each step is one action ``{"name": tool, "params": {...}}``. Observation keys: the configured
``observation_fields`` (``last_tool_result`` — short JSON, ``user_intent``, ``order_status``,
``inventory_snapshot``) plus ``user_reply`` (str | None), ``tool_error`` (bool) and ``memory``
(``{"recent": [...], "summary": str | None}``). ``respond_to_user``'s tool result is ``{"sent": true}``;
what the user answered is ``user_reply``. Per-step reward is 0; the step that ends the episode returns
the verifier's total and ``info`` with ``termination``, ``truncated``, ``reward_components``,
``reward_weights``, ``hacking_flags``, ``hacking_penalty``, ``success``, ``ended_as_required``,
``partial_credit``, ``max_turns_failed``, ``num_turns``, ``tool_errors`` and ``compute_score_s``. Stepping a
finished episode raises ``EpisodeEndedError``; ``finalize(reason)`` ends an episode from outside (agent-loop
limits).

Config keys felt here: ``state.observation_fields`` picks the observation's keys (the agent loop shows every
listed one to the policy, see ``tether.agent.chat.observation_text``); ``state.memory`` is the env's
``observation["memory"]`` and, through ``context_memory()``, the bound on the policy's context (the agent
loop's segments); ``termination.max_turns_exceeded`` decides how an episode that reached ``state.max_turns``
is scored: ``truncate`` on what was done (``verify(partial=True)``: the rule checks count when
``grading.work_done``; ``info["truncated"]``), ``fail`` as a failure (``Verdict.as_failure``: every
component 0; ``info["max_turns_failed"]``).

Every episode can call every configured tool (the seed's own flow calls ``query_inventory`` in a refund
task). ``Task.tools`` (built-in tasks: their intent's tools, ``tasks.TOOLS``) is the *agent loop's*
per-sample selection (``agent_loop.tool_selection``): the loop lists only those tools and refuses the others
without an environment step.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.config import EnvironmentConfig, RunConfig
from tether.env.anti_hacking import HackingDetector
from tether.env.base import Action, Observation, StepOutput
from tether.env.customer_service import grading
from tether.env.customer_service.tasks import generate
from tether.env.customer_service.user_sim import UserSimulator
from tether.env.customer_service.world import PRIORITIES, REASON_CODES, World
from tether.env.memory import KeepRecentK, TurnRecord, make_memory
from tether.env.termination import MAX_TURNS, Ending, TerminationRule
from tether.env.tools import Latency, Param, Tool, ToolBox, ToolResult, error_text, parse_action
from tether.env.verifier import DeterministicJudge, HybridVerifier, Transcript
from tether.types import Task

SENT = '{"sent": true}'
TERMINAL_TOOLS = ("escalate_to_human",)
# What each tool does and its parameters; the config's action_space picks tools and sets their timing.
TOOL_DOCS: dict[str, tuple[str, tuple[Param, ...]]] = {
    "query_inventory": ("Get the stock level of a product.",
                        (Param("sku_id", "Product id, e.g. SKU-123."),)),
    "check_refund_policy": ("Apply the refund policy to an order. Records the refund when approved.",
                            (Param("order_id", "Order id, e.g. O-1042."),
                             Param("reason_code", "Why the user wants a refund.", REASON_CODES))),
    "escalate_to_human": ("Hand the case to a human agent. Ends the conversation.",
                          (Param("summary", "One line: the order id and the issue."),
                           Param("priority", "Priority the policy gave.", PRIORITIES))),
    "respond_to_user": ("Send a message to the user; returns their reply.",
                        (Param("message", "A short message."),)),
}
SYSTEM_PROMPT = (
    "You are a customer service agent. Be brief.\n"
    "Refund: get the order ID (ask if missing), then call check_refund_policy with the reason code "
    f"({', '.join(REASON_CODES)}). If approved or refused, tell the user. "
    "If it says escalate, call escalate_to_human with that priority.\n"
    "Stock question: call query_inventory and tell the user the number."
)


def _unbound(**params: Any) -> Any:
    raise RuntimeError("tool called outside an episode")


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
        from tether.config import load_config

        return load_config(config).environment
    if isinstance(config, Mapping):
        if "environment" not in config:
            return EnvironmentConfig.model_validate(config)
        if set(config) == {"environment"}:
            return EnvironmentConfig.model_validate(config["environment"])
        return RunConfig.model_validate(config).environment
    raise TypeError(f"CustomerServiceEnv config must be a RunConfig, EnvironmentConfig, path or dict, "
                    f"got {type(config).__name__}")


def tasks(split: str, config: Any = None) -> list[Task]:
    """The ``"train"`` or ``"eval"`` tasks of ``config`` (default: the seed's environment)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    cfg = environment_config(config)
    bundle = generate(cfg.seed, cfg.num_train_tasks, cfg.num_eval_tasks)
    return list(bundle.train if split == "train" else bundle.eval)


@dataclass
class _Episode:
    task: Task
    world: World
    user: UserSimulator
    toolbox: ToolBox
    memory: KeepRecentK
    detector: HackingDetector
    rng: random.Random
    started: int = 0  # steps begun (several may run at once: parallel calls of one assistant turn)
    finished: int = 0  # steps completed
    tool_errors: int = 0
    order_status: str | None = None
    inventory: dict[str, int] = field(default_factory=dict)
    records: list[TurnRecord] = field(default_factory=list)
    ending: Ending | None = None
    final: tuple[float, dict[str, Any]] | None = None


class CustomerServiceEnv:
    def __init__(self, config: Any = None):
        self.config = cfg = environment_config(config)
        self._specs = self._check_action_space(cfg)
        self._bundle = generate(cfg.seed, cfg.num_train_tasks, cfg.num_eval_tasks)
        self.termination = TerminationRule.from_config(
            cfg.termination, cfg.state.max_turns, [n for n in TERMINAL_TOOLS if n in self._specs])
        self.verifier = HybridVerifier.from_config(
            cfg.verifier, rule_fns=grading.RULES, judge=DeterministicJudge(grading.RUBRICS),
            gate=grading.ended_as_required, gated=grading.GATED, progress=grading.work_done)
        self.observation_fields = list(cfg.state.observation_fields)
        self._next_train = 0
        self._ep: _Episode | None = None

    @staticmethod
    def _check_action_space(cfg: EnvironmentConfig) -> dict[str, Any]:
        specs = {}
        for i, spec in enumerate(cfg.action_space):
            key = f"environment.action_space[{i}]"
            if spec.name not in TOOL_DOCS:
                raise ValueError(f"{key}: tool {spec.name!r} is not a customer-service tool; "
                                 f"known: {list(TOOL_DOCS)}")
            want = [p.name for p in TOOL_DOCS[spec.name][1]]
            if sorted(spec.params) != sorted(want):
                raise ValueError(f"{key}: {spec.name} takes params {want}, the config lists {spec.params}")
            specs[spec.name] = spec
        return specs

    # -- tasks and episode set-up -----------------------------------------------------------------------
    def tasks(self, split: str) -> list[Task]:
        """This environment's ``"train"`` or ``"eval"`` tasks."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return list(self._bundle.train if split == "train" else self._bundle.eval)

    def get_task(self, task_id: str) -> Task:
        try:
            return self._bundle.by_id[task_id]
        except KeyError:
            cfg = self.config
            raise KeyError(f"unknown task id {task_id!r}: ids are train_000..train_{cfg.num_train_tasks - 1:03d} "
                           f"and test_000..test_{cfg.num_eval_tasks - 1:03d}") from None

    def _tools(self, world: World | None = None, user: UserSimulator | None = None) -> list[Tool]:
        """The configured tools bound to one episode's world and user (unbound: for schemas only)."""
        fns: dict[str, Callable[..., Any]] = {}
        if world is not None and user is not None:
            fns = {"query_inventory": world.query_inventory, "check_refund_policy": world.check_refund_policy,
                   "escalate_to_human": world.escalate_to_human, "respond_to_user": user.reply}
        out = []
        for name, spec in self._specs.items():
            description, params = TOOL_DOCS[name]
            ordered = tuple(sorted(params, key=lambda p: spec.params.index(p.name)))
            out.append(Tool(name, description, ordered, fns.get(name, _unbound), spec.timeout_ms,
                            Latency.from_spec(spec.latency_ms)))
        return out

    def reset(self, task_id: str | None = None, *, task: Task | None = None, seed: int | None = None) -> Observation:
        """Start an episode of ``task_id`` (None: the next train task), or of an explicit ``task`` whose data
        refers to this world. ``seed`` varies the simulated latencies between episodes of one task."""
        if task is None:
            if task_id is None:
                train = self._bundle.train
                task = train[self._next_train % len(train)]
                self._next_train += 1
            else:
                task = self.get_task(task_id)
        self.close()
        world = World.from_image(self._bundle.image)
        user = UserSimulator(task)
        ah = self.config.verifier.anti_hacking
        self._ep = _Episode(
            task=task, world=world, user=user, toolbox=ToolBox(self._tools(world, user)),
            memory=make_memory(self.config.state.memory), detector=HackingDetector.from_config(ah),
            rng=random.Random(f"{self.config.seed}:{task.id}:{seed or 0}"))
        return self._observation(self._ep, None, user.opening(), False)

    # -- stepping -------------------------------------------------------------------------------------
    def step(self, action: Action) -> StepOutput:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.astep(action))
        with ThreadPoolExecutor(1) as pool:  # called from inside an event loop: run on a helper thread
            return pool.submit(asyncio.run, self.astep(action)).result()

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
        ending = self.termination.check(resolved=ep.user.resolved, terminal_call=terminal,
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
        value = result.value
        if result.name == "respond_to_user":
            return SENT, value, False
        if result.name == "query_inventory":
            ep.inventory[value["sku_id"]] = value["stock"]
        elif result.name == "check_refund_policy":
            ep.order_status = value["status"]
        return result.text, None, result.name in self.termination.terminal_tools

    def _observation(self, ep: _Episode, last: str | None, user_reply: str | None, error: bool) -> Observation:
        available = {"last_tool_result": last, "user_intent": ep.task.data["intent"],
                     "order_status": ep.order_status, "inventory_snapshot": dict(ep.inventory)}
        obs: dict[str, Any] = {f: available[f] for f in self.observation_fields}
        obs.update(user_reply=user_reply, tool_error=error, memory=ep.memory.view())
        return obs

    def _end(self, ep: _Episode, ending: Ending) -> tuple[float, dict[str, Any]]:
        t = time.perf_counter()
        verdict = self.verifier.verify(ep.world, Transcript(list(ep.records), ending.reason), ep.task,
                                       dict(ep.detector.flags), partial=ending.reason == MAX_TURNS and ending.truncated)
        if ending.failed:
            verdict = verdict.as_failure()
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
        return ToolBox(self._tools()).schemas()

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def context_memory(self) -> KeepRecentK:
        """A fresh ``state.memory`` for the agent loop: it bounds how many turns the policy sees verbatim."""
        return make_memory(self.config.state.memory)

    # -- inspection -----------------------------------------------------------------------------------
    @property
    def task(self) -> Task | None:
        return self._ep.task if self._ep else None

    @property
    def world(self) -> World | None:
        """The current episode's database (for tests and debugging)."""
        return self._ep.world if self._ep else None

    @property
    def done(self) -> bool:
        return self._ep is not None and self._ep.ending is not None

    def close(self) -> None:
        if self._ep is not None:
            self._ep.world.close()
            self._ep = None
