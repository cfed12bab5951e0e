"""The ``environment`` section: tools (action space), state, termination, the hybrid verifier."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tether.config.base import *  # noqa: F401,F403 — the shared types
from tether.config.base import NonNegInt, PosInt, Section, Weight, _check  # noqa: F401

# ----------------------------------------------------------------------------- environment

HackPattern = Literal["repeated_tool_calls", "context_stuffing"]
ObservationField = Literal["last_tool_result", "user_intent", "order_status", "inventory_snapshot"]


class LatencySpec(Section):
    """Simulated tool latency: lognormal around ``median``, capped at ``max``."""

    median: NonNegFloat
    """Median latency, in ms."""
    sigma: NonNegFloat = 0.0
    """Lognormal spread (sigma of log-latency); 0 = always the median."""
    max: NonNegFloat | None = None
    """Cap on one call's latency, in ms; None = no cap."""

    @model_validator(mode="after")
    def _max_above_median(self) -> LatencySpec:
        if self.max is not None:
            _check(self.max >= self.median, "max must be >= median", max=self.max, median=self.median)
        return self


class ToolSpec(Section):
    """One tool of the action space; must match the real deployment."""

    name: str
    """Tool name the model calls; it must be a tool the environment implements."""
    params: list[str] = []
    """Parameter names the tool takes, in order."""
    timeout_ms: PosInt
    """A call still running after this many ms fails with a timeout observation."""
    latency_ms: LatencySpec | None = None
    """Simulated latency of the reference environment; None = instant."""


def _default_tools() -> list[ToolSpec]:
    return [
        ToolSpec(name="query_inventory", params=["sku_id"], timeout_ms=3000),
        ToolSpec(name="check_refund_policy", params=["order_id", "reason_code"], timeout_ms=2000),
        ToolSpec(name="escalate_to_human", params=["summary", "priority"], timeout_ms=500),
        ToolSpec(name="respond_to_user", params=["message"], timeout_ms=100),
    ]


class MemoryConfig(Section):
    """How the conversation history is kept within the context window."""

    type: Literal["keep_recent_k"] = "keep_recent_k"
    """Memory policy: keep the most recent ``k`` tool-call records verbatim. keep_recent_k is the only value
    today."""
    k: PosInt = 5
    """Recent tool-call records kept verbatim, in records."""
    summary_enabled: bool = True
    """Replace older records by a summary instead of dropping them."""


class StateConfig(Section):
    """Episode state: trajectory history + tool results + memory summary."""

    max_turns: PosInt = 20
    """Maximum environment steps (tool calls, ``respond_to_user`` included) of one episode; then
    termination.max_turns_exceeded applies. Unreachable above agent_loop.max_assistant_turns ×
    max_parallel_calls (a warning at start)."""
    context_window: PosInt = 32768
    """Maximum length of prompt + response, in tokens; the episode ends (truncated) when it is reached."""
    memory: MemoryConfig = MemoryConfig()
    """History handling."""
    observation_fields: list[ObservationField] = [
        "last_tool_result",
        "user_intent",
        "order_status",
        "inventory_snapshot",
    ]
    """Fields included in each observation."""


class TerminationConfig(Section):
    """When an episode ends."""

    success_criteria: Literal["user_issue_resolved"] = "user_issue_resolved"
    """What counts as success. user_issue_resolved (the simulated user declares the issue resolved) is the only
    value today."""
    max_turns_exceeded: Literal["truncate", "fail"] = "truncate"
    """At ``max_turns``: truncate (score what was done) or fail (reward 0)."""
    tool_error_threshold: PosInt = 3
    """End the episode after this many tool-error observations, in errors."""


class RuleCheck(Section):
    """A rule-based reward component."""

    check: Literal["refund_amount_correct", "policy_compliance"]
    """Which rule (``tether.env.customer_service.grading``)."""
    weight: Weight
    """Weight of this component in the reward, in [0, 10]."""


class RubricCheck(Section):
    """A rubric-scored reward component."""

    rubric: Literal["response_quality", "efficiency"]
    """Which rubric (scored by the deterministic judge)."""
    weight: Weight
    """Weight of this component in the reward, in [0, 10]."""


class AntiHackingConfig(Section):
    """Reward-hacking detection: flagged patterns are penalised and logged as ``reward/hacking/*``."""

    enabled: bool = True
    """Detect and penalise hacking patterns."""
    detect_patterns: list[HackPattern] = ["repeated_tool_calls", "context_stuffing"]
    """Patterns to detect."""
    penalty: dict[HackPattern, NonNegFloat] = {"repeated_tool_calls": 0.1, "context_stuffing": 0.1}
    """Reward subtracted per detected pattern, in reward units."""
    repeat_window: PosInt = 4
    """Previous tool calls looked back when detecting repeated identical calls, in calls."""
    judge: Literal["deterministic"] = "deterministic"
    """Who scores rubrics. deterministic (plain functions, no judge model is called) is the only value today."""


class VerifierConfig(Section):
    """The reward function: weighted rule checks and rubrics."""

    type: Literal["hybrid", "rule", "model"] = "hybrid"
    """Which components count: rules and rubrics (hybrid), rules only (rule) or rubrics only (model)."""
    rule_based: list[RuleCheck] = [
        RuleCheck(check="refund_amount_correct", weight=0.4),
        RuleCheck(check="policy_compliance", weight=0.3),
    ]
    """Rule-based components."""
    model_based: list[RubricCheck] = [
        RubricCheck(rubric="response_quality", weight=0.2),
        RubricCheck(rubric="efficiency", weight=0.1),
    ]
    """Rubric-based components."""
    anti_hacking: AntiHackingConfig = AntiHackingConfig()
    """Reward-hacking detection."""


class EnvironmentConfig(Section):
    """The environment the agent acts in (defaults: the seed's customer-service agent)."""

    name: str = "customer_service_agent"
    """Registered environment name (``tether.runtime.ENVIRONMENTS``)."""
    type: Literal["gym_like"] = "gym_like"
    """Interface. gym_like (``reset``/``step``) is the only value today."""
    action_space: list[ToolSpec] = Field(default_factory=_default_tools)
    """The tools the agent may call."""
    state: StateConfig = StateConfig()
    """Episode state and memory."""
    termination: TerminationConfig = TerminationConfig()
    """When an episode ends."""
    verifier: VerifierConfig = VerifierConfig()
    """The reward function."""
    seed: int = 0
    """Seed of task generation and simulated users."""
    num_train_tasks: PosInt = 256
    """Generated training tasks, in tasks."""
    num_eval_tasks: PosInt = 64
    """Generated held-out tasks, in tasks."""


