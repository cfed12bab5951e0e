"""The ``environment`` section: tools (action space), state, termination, the hybrid verifier."""

from __future__ import annotations

import string
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tether.config.base import *  # noqa: F401,F403 — the shared types
from tether.config.base import NonNegInt, PosInt, Section, Weight, _check  # noqa: F401
from tether.config.openenv import OpenEnvConfig
from tether.config.sections import LLMClientConfig

# ----------------------------------------------------------------------------- environment

HackPattern = Literal["repeated_tool_calls", "context_stuffing", "no_op_pass"]
Word = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
# What the built-in customer-service environment offers (its env checks them too; here so that `tether config` does).
CUSTOMER_SERVICE = "customer_service_agent"
OPENENV_PREFIX = "openenv:"  # environment.name: openenv:<url | app> (tether.env.openenv)
CS_OBSERVATION_FIELDS = ("last_tool_result", "user_intent", "order_status", "inventory_snapshot")
CS_RULE_CHECKS = ("refund_amount_correct", "policy_compliance")
# tau2-bench's own episode limits (tau2.config DEFAULT_MAX_STEPS, DEFAULT_MAX_ERRORS), the defaults of
# ``state.max_turns`` and ``termination.tool_error_threshold`` under ``name: tau2:<domain>``. tau2 counts a step per
# message (the agent's call, then its result; the agent's text, then the user's reply): its 200 are 100 of tether's
# steps (one per tool call, ``respond_to_user`` included).
TAU2_PREFIX = "tau2:"
TAU2_MAX_STEPS = 100
TAU2_MAX_ERRORS = 10


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
    termination.max_turns_exceeded applies. Unset under ``name: tau2:<domain>``: tau2's own limit, 100 (its
    max_steps 200 counts messages, two per step). Unreachable above agent_loop.max_assistant_turns ×
    max_parallel_calls (a warning at start)."""
    context_window: PosInt = 32768
    """Maximum length of prompt + response, in tokens; the episode ends (truncated) when it is reached."""
    memory: MemoryConfig = MemoryConfig()
    """History handling."""
    observation_fields: list[Word] = [
        "last_tool_result",
        "user_intent",
        "order_status",
        "inventory_snapshot",
    ]
    """Fields included in each observation: last_tool_result and the environment's own (customer service:
    user_intent, order_status, inventory_snapshot; a plugin environment's ``observations``)."""


class TerminationConfig(Section):
    """When an episode ends."""

    success_criteria: Literal["user_issue_resolved"] = "user_issue_resolved"
    """What counts as success. user_issue_resolved (the simulated user declares the issue resolved) is the only
    value today."""
    max_turns_exceeded: Literal["truncate", "fail"] = "truncate"
    """At ``max_turns``: truncate (score what was done) or fail (reward 0)."""
    tool_error_threshold: PosInt = 3
    """End the episode after this many tool-error observations, in errors. Unset under ``name: tau2:<domain>``:
    tau2's own max_errors, 10."""


class RuleCheck(Section):
    """A rule-based reward component."""

    check: Word
    """Which rule check of the environment (customer service: refund_amount_correct, policy_compliance — see
    ``tether.env.customer_service.grading``; a plugin environment's ``rules``)."""
    weight: Weight
    """Weight of this component in the reward, in [0, 10]."""


RUBRIC_FIELDS = ("task", "conversation", "tool_calls", "final_answer")  # what a rubric prompt may refer to


class RubricCheck(Section):
    """A rubric-scored reward component: a name, a weight and, for the LLM judge, a prompt."""

    rubric: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    """The rubric's name (a word; it names the component ``reward/<rubric>``). The deterministic judge knows the
    environment's own rubrics (customer service: response_quality, efficiency); the LLM judge scores any rubric
    that has a ``prompt``, and the environment's own ones without one (their built-in prompts)."""
    weight: Weight
    """Weight of this component in the reward, in [0, 10]."""
    prompt: str | None = None
    """The LLM judge's instructions for this rubric, with the episode filled in where the text says
    ``{task}`` (the user's request), ``{conversation}``, ``{tool_calls}`` (each call, its arguments and result) and
    ``{final_answer}`` (write ``{{`` / ``}}`` for a literal brace); the answer format (a last line ``SCORE: <0..1>``)
    is appended by the judge. None = the environment's built-in prompt of this rubric. Read only with
    ``verifier.judge: llm``. tether's own key."""

    @field_validator("prompt")
    @classmethod
    def _known_fields(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(v) if name is not None]
        except ValueError as e:
            raise ValueError(f"not a valid template ({e}); write {{{{ and }}}} for literal braces") from None
        bad = sorted({n for n in names if n not in RUBRIC_FIELDS})
        if bad:
            raise ValueError(f"refers to {bad}; a rubric prompt may refer to {list(RUBRIC_FIELDS)} "
                             "(write {{ and }} for literal braces)")
        return v


class AntiHackingConfig(Section):
    """Reward-hacking detection: flagged patterns are penalised and logged as ``reward/hacking/*``."""

    enabled: bool = True
    """Detect and penalise hacking patterns."""
    detect_patterns: list[HackPattern] = ["repeated_tool_calls", "context_stuffing"]
    """Patterns to detect."""
    penalty: dict[HackPattern, NonNegFloat] = {"repeated_tool_calls": 0.1, "context_stuffing": 0.1}
    """Reward subtracted per detected pattern, in reward units."""
    repeat_window: PosInt = 2
    """How far back an identical call counts as a stale repeat, in calls: a call equal to one of the previous
    ``repeat_window`` calls, with the environment's state unchanged since (an environment that reports its writes,
    like tau2's adapter, exempts a re-read after a write), is flagged ``repeated_tool_calls``. 2: asking again for
    what the agent was just told; a re-check after looking at other records is left to ``max_repeats``
    (``tether.env.anti_hacking``). Was 4 before the detectors were calibrated on tau2's gold trajectories."""
    max_repeats: NonNegInt = 2
    """How many times one identical call may be repeated in an episode, whatever happened between, before each
    further repeat is flagged ``repeated_tool_calls`` (a loop, however far apart its calls), in repeats. 2: a
    call made a third time is fine, a fourth is flagged (tau2's gold trajectories make one call at most twice)."""


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
    judge: Literal["deterministic", "llm"] = "deterministic"
    """Who scores the rubrics of model_based: deterministic — plain functions of the environment, no model is
    called (the offline default); llm — an LLM judge at ``reward.judge_client``, one prompt per rubric, scored by
    the reward loop while generation goes on (``tether.reward``; the first source document's model-based rubrics).
    tether's own key (the issue's ``verifier.model_based.judge``: model_based is the seed's list)."""

    @model_validator(mode="after")
    def _rubrics(self) -> VerifierConfig:
        names = [r.rubric for r in self.model_based]
        dup = sorted({n for n in names if names.count(n) > 1})
        _check(not dup, f"rubric names must be unique; {dup} appear more than once", model_based=names)
        prompted = [i for i, r in enumerate(self.model_based) if r.prompt is not None]
        _check(self.judge == "llm" or not prompted,
               "a rubric prompt is read by the LLM judge only: set environment.verifier.judge: llm, or remove "
               f"the prompt of model_based{prompted}", judge=self.judge)
        return self


class UserLLMConfig(Section):
    """The LLM user simulator (``environment.user_simulator: llm``)."""

    client: LLMClientConfig
    """The simulator's OpenAI-compatible endpoint (base_url, model, api_key as ``${VAR}``, timeout_s, max_retries
    and the endpoint's limits); its system prompt holds the task's hidden user goal."""
    temperature: NonNegFloat = 0.7
    """Sampling temperature of the simulated user (unitless)."""
    max_tokens: PosInt = 128
    """Most tokens of one user reply, in tokens."""


class McpServerConfig(Section):
    """An MCP tool server whose tools become tools of every episode (``tether.env.mcp``, through the official ``mcp``
    SDK: the ``mcp`` extra). Give a stdio ``command`` or a streamable-HTTP ``url``. tether's own section."""

    name: Word
    """The server's name (a word), used in messages and in the server's log file."""
    command: list[str] | None = None
    """Start the server as a subprocess speaking MCP over stdio: the program and its arguments. A first element
    ``python`` runs the interpreter that runs tether (so the server sees the same installed packages)."""
    env: dict[str, Secret] = {}
    """Extra environment variables of a stdio server (over the SDK's safe defaults: HOME, PATH, ...); values are
    secrets (``${VAR}`` read from tether's environment at start; dumps show ``${VAR}`` or ``***``)."""
    cwd: str | None = None
    """Working directory of a stdio server; None = tether's current directory."""
    url: str | None = None
    """Connect to a streamable-HTTP MCP server at this http:// or https:// URL instead of starting one."""
    headers: dict[str, Secret] = {}
    """HTTP headers of a ``url`` server; each value reads an environment variable (``Bearer ${MCP_TOKEN}``), at
    connection time, and is never written to a log or dump."""
    scope: Literal["episode", "shared"] = "episode"
    """episode — a server process (or HTTP session) per episode, started at reset and stopped when the episode's
    environment is closed: every episode sees fresh server state; shared — one per environment (per rollout worker
    process), started when the environment is built and reused by its episodes (cheaper; state carries over)."""
    tools: list[str] | None = None
    """The server's tools to expose, by name; None = all it lists. A name it does not list is an error at start."""
    timeout_ms: PosInt = 10_000
    """A call still running after this many ms is an error observation (an ``action_space`` entry naming the tool
    sets its own ``timeout_ms`` instead)."""

    @model_validator(mode="after")
    def _transport(self) -> McpServerConfig:
        _check((self.command is None) != (self.url is None), "give exactly one of command (stdio) or url "
               "(streamable HTTP)", command=self.command, url=self.url)
        _check(self.command is None or len(self.command) > 0, "command needs at least the program", command=[])
        if self.url is not None:
            _check(self.url.startswith(("http://", "https://")), "must start with http:// or https://", url=self.url)
            _check(not self.env and self.cwd is None, "env and cwd are for a stdio server (command)",
                   env=sorted(self.env) or None, cwd=self.cwd)
        _check(self.url is not None or not self.headers, "headers are for an HTTP server (url)",
               headers=sorted(self.headers))
        for k, v in self.headers.items():
            _check(bool(v.variables()), "a header's value is read from the environment: write it as ${VAR} "
                   "(e.g. 'Bearer ${MCP_TOKEN}'), so that no secret sits in a config file",
                   **{f"headers.{k}": v.redacted()})
        return self


class EnvironmentConfig(Section):
    """The environment the agent acts in (defaults: the seed's customer-service agent)."""

    name: str = CUSTOMER_SERVICE
    """Which environment: a registered name (customer_service_agent), an import path ``package.module:attribute``,
    the name of a ``tether.environments`` entry point of an installed package, or ``tau2:<domain>``
    (``tether.env.plugin.registry``)."""
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
    """Generated training tasks, in tasks; a plugin environment with its own tasks uses at most this many (the
    first ones)."""
    num_eval_tasks: PosInt = 64
    """Generated held-out tasks, in tasks; a plugin environment with its own tasks uses at most this many."""
    user_simulator: Literal["scripted", "llm"] = "scripted"
    """Who plays the user: scripted — templated replies, resolved when a message states the right outcome (the
    offline default); llm — a model at ``user_llm.client`` that knows the task's hidden goal and says when it is
    resolved (tau-bench's user simulator). tether's own key."""
    user_llm: UserLLMConfig | None = None
    """The LLM user simulator's endpoint and sampling; required with ``user_simulator: llm``, refused otherwise."""
    openenv: OpenEnvConfig | None = None
    """How an OpenEnv environment (``name: openenv:<url | module | file.py | folder>``) is served and talked to;
    its defaults apply when not given; refused with any other ``name``."""

    @model_validator(mode="after")
    def _openenv(self) -> EnvironmentConfig:
        _check(self.openenv is None or self.name.startswith(OPENENV_PREFIX),
               "environment.openenv configures an OpenEnv environment: set environment.name: openenv:<url or app>, "
               "or remove the openenv section", name=self.name, openenv="set" if self.openenv is not None else None)
        return self

    mcp_servers: list[McpServerConfig] = []
    """MCP tool servers whose tools are added to every episode's tools (``tether.env.mcp``; the ``mcp`` extra):
    each a name, a stdio ``command`` or an HTTP ``url``, a scope, optionally a subset of ``tools`` and a
    ``timeout_ms``. Their tools are listed at start; a name that clashes with a tool of the environment (or of another
    server) is an error then. Plugin environments and customer_service_agent take them; tau2 does not. tether's own
    key."""

    @model_validator(mode="after")
    def _mcp_servers(self) -> EnvironmentConfig:
        names = [s.name for s in self.mcp_servers]
        dup = sorted({n for n in names if names.count(n) > 1})
        _check(not dup, f"MCP server names must be unique; {dup} appear more than once", mcp_servers=names)
        _check(not (self.mcp_servers and self.name.startswith("tau2:")), "tau2's environments keep their own tools: "
               "MCP servers are added to plugin environments and customer_service_agent only",
               name=self.name, mcp_servers=names)
        return self

    @model_validator(mode="after")
    def _user_llm(self) -> EnvironmentConfig:
        _check((self.user_simulator == "llm") == (self.user_llm is not None),
               "user_llm configures the LLM user simulator: give it exactly when user_simulator is llm",
               user_simulator=self.user_simulator, user_llm="set" if self.user_llm is not None else None)
        if self.user_llm is not None:  # the tool returns the user's reply: its timeout must cover the user's answer
            for i, spec in enumerate(self.action_space):
                need = self.user_llm.client.timeout_s * 1000
                _check(spec.name != "respond_to_user" or spec.timeout_ms >= need,
                       f"respond_to_user returns the simulated user's reply, so its timeout must cover one request to "
                       f"the LLM user: raise action_space[{i}].timeout_ms to at least {need:g} or lower "
                       f"user_llm.client.timeout_s",
                       **{f"action_space[{i}].timeout_ms": spec.timeout_ms,
                          "user_llm.client.timeout_s": self.user_llm.client.timeout_s})
        return self

    @model_validator(mode="after")
    def _tau2_limits(self) -> EnvironmentConfig:
        """Under ``name: tau2:<domain>`` the episode limits the config leaves unset are tau2's own (tau2 scores an
        episode it cuts 0, so a tighter cap than tau2's fails trajectories tau2 passes); a value given wins."""
        if self.name.startswith(TAU2_PREFIX):
            if "max_turns" not in self.state.model_fields_set:
                self.state.max_turns = TAU2_MAX_STEPS
            if "tool_error_threshold" not in self.termination.model_fields_set:
                self.termination.tool_error_threshold = TAU2_MAX_ERRORS
        return self

    @model_validator(mode="after")
    def _customer_service_names(self) -> EnvironmentConfig:
        if self.name != CUSTOMER_SERVICE:
            return self  # a plugin environment checks its own names when it is built
        for i, f in enumerate(self.state.observation_fields):
            _check(f in CS_OBSERVATION_FIELDS, f"the {CUSTOMER_SERVICE} environment observes "
                   + " or ".join(map(repr, CS_OBSERVATION_FIELDS)), **{f"state.observation_fields.{i}": f})
        for i, r in enumerate(self.verifier.rule_based):
            _check(r.check in CS_RULE_CHECKS, f"the {CUSTOMER_SERVICE} environment's rule checks are "
                   + " or ".join(map(repr, CS_RULE_CHECKS)), **{f"verifier.rule_based.{i}.check": r.check})
        return self
