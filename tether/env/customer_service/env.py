"""``CustomerServiceEnv``: the seed's customer-service agent environment (tau-bench retail in miniature).

Built on the plugin API (``tether.env.plugin``) like any user's environment: its four tools are the functions
below (schemas from their type hints and docstrings), bound by the config's ``action_space``; the episode's
state is an ``Episode`` (its own SQLite ``World`` copy, the scripted user, what the tools revealed); the rule
checks, rubrics, gate and progress are ``grading``'s functions; tasks are ``tasks.generate``'s.

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

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import tether.env.customer_service.grading as grading
from tether.env.customer_service.expert import ScriptedExpert
from tether.env.customer_service.tasks import Bundle, generate
from tether.env.customer_service.user_sim import LLMUserSimulator, UserSimulator, make_user
from tether.env.customer_service.world import PRIORITIES, REASON_CODES, World
from tether.env.plugin.env import EpisodeEndedError, ToolEnv, ToolEnvironment, environment_config
from tether.env.tools import ToolResult
from tether.env.verifier import DeterministicJudge, ProgressFn, RuleFn
from tether.types import Task

__all__ = ["CustomerServiceEnv", "EpisodeEndedError", "environment", "environment_config", "tasks"]

TERMINAL_TOOLS = ("escalate_to_human",)
SYSTEM_PROMPT = (
    "You are a customer service agent. Be brief.\n"
    "Refund: get the order ID (ask if missing), then call check_refund_policy with the reason code "
    f"({', '.join(REASON_CODES)}). If approved or refused, tell the user. "
    "If it says escalate, call escalate_to_human with that priority.\n"
    "Stock question: call query_inventory and tell the user the number."
)
ReasonCode = Literal["DAMAGED", "WRONG_ITEM", "LATE", "NOT_NEEDED", "USED", "FRAUD"]
Priority = Literal["low", "medium", "high"]
assert get_args(ReasonCode) == REASON_CODES and get_args(Priority) == PRIORITIES  # the schemas' enums = the policy's


@dataclass
class Episode:
    """The state of one episode: its own database copy, the user, and what the tools revealed so far."""

    world: World
    user: UserSimulator | LLMUserSimulator  # environment.user_simulator
    order_status: str | None = None
    inventory: dict[str, int] = field(default_factory=dict)


# -- the tools: what each does and its parameters are the model's schema ------------------------------------
def query_inventory(state: Episode, sku_id: str) -> dict[str, Any]:
    """Get the stock level of a product.

    Args:
        sku_id: Product id, e.g. SKU-123.
    """
    return state.world.query_inventory(sku_id)


def check_refund_policy(state: Episode, order_id: str, reason_code: ReasonCode) -> dict[str, Any]:
    """Apply the refund policy to an order. Records the refund when approved.

    Args:
        order_id: Order id, e.g. O-1042.
        reason_code: Why the user wants a refund.
    """
    return state.world.check_refund_policy(order_id, reason_code)


def escalate_to_human(state: Episode, summary: str, priority: Priority) -> dict[str, Any]:
    """Hand the case to a human agent. Ends the conversation.

    Args:
        summary: One line: the order id and the issue.
        priority: Priority the policy gave.
    """
    return state.world.escalate_to_human(summary, priority)


async def respond_to_user(state: Episode, message: str) -> str:
    """Send a message to the user; returns their reply.

    Args:
        message: A short message.
    """
    return await state.user.areply(message)


TOOLS = (query_inventory, check_refund_policy, escalate_to_human, respond_to_user)


def _absorb(state: Episode, result: ToolResult) -> None:
    """What a successful call reveals, for the observation fields."""
    if result.name == "query_inventory":
        state.inventory[result.value["sku_id"]] = result.value["stock"]
    elif result.name == "check_refund_policy":
        state.order_status = result.value["status"]


def _on_world(fn: Any) -> Any:
    """A grading function over the database, made a function over the episode's state."""
    return lambda state, transcript, task: fn(state.world, transcript, task)


def definition(bundle: Bundle, cfg: Any = None) -> ToolEnvironment:
    """The customer-service environment of one generated world and its tasks; ``cfg`` (an EnvironmentConfig)
    picks the user simulator (``environment.user_simulator``; None: scripted)."""
    rules: dict[str, RuleFn] = {name: _on_world(fn) for name, fn in grading.RULES.items()}
    progress: ProgressFn = _on_world(grading.work_done)
    return ToolEnvironment(
        tools=TOOLS,
        tasks=lambda split, cfg: bundle.train if split == "train" else bundle.eval,
        system_prompt=SYSTEM_PROMPT,
        new_state=lambda task: Episode(World.from_image(bundle.image), make_user(task, cfg)),
        rules=rules, judge=DeterministicJudge(grading.RUBRICS), gate=grading.ended_as_required,
        gated=grading.GATED, progress=progress,
        opening=lambda task: task.data["opening"],
        observations={"user_intent": lambda state, task: task.data["intent"],
                      "order_status": lambda state, task: state.order_status,
                      "inventory_snapshot": lambda state, task: dict(state.inventory)},
        on_result=_absorb, resolved=lambda state: state.user.resolved,
        terminal_tools=TERMINAL_TOOLS, terminal_reason="escalated",
        close_state=lambda state: state.world.close(), expert=lambda task: ScriptedExpert().act)


def tasks(split: str, config: Any = None) -> list[Task]:
    """The ``"train"`` or ``"eval"`` tasks of ``config`` (default: the seed's environment)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    cfg = environment_config(config)
    bundle = generate(cfg.seed, cfg.num_train_tasks, cfg.num_eval_tasks)
    return list(bundle.train if split == "train" else bundle.eval)


class CustomerServiceEnv(ToolEnv):
    def __init__(self, config: Any = None):
        cfg = environment_config(config)
        self._bundle = generate(cfg.seed, cfg.num_train_tasks, cfg.num_eval_tasks)
        super().__init__(definition(self._bundle, cfg), cfg)

    def get_task(self, task_id: str) -> Task:
        try:
            return self._bundle.by_id[task_id]
        except KeyError:
            cfg = self.config
            raise KeyError(f"unknown task id {task_id!r}: ids are train_000..train_{cfg.num_train_tasks - 1:03d} "
                           f"and test_000..test_{cfg.num_eval_tasks - 1:03d}") from None

    @property
    def world(self) -> World | None:
        """The current episode's database (for tests and debugging)."""
        return self.state.world if self.state is not None else None


# environment.name: customer_service_agent (tether.env.plugin.registry): make_env(config), list_tasks(split, config)
environment = (CustomerServiceEnv, lambda split, cfg: CustomerServiceEnv(cfg).tasks(split))
