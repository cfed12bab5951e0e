"""Typed run configuration: one ``RunConfig`` whose sections cover every key of the seed configs.

Every model forbids unknown keys, documents every field (the docstring under it) and has defaults, so
``RunConfig()`` is valid and a file with one section loads. Loading, merging, ``--set`` overrides and
error messages that name the key, the file and what is allowed live in ``tether.config_io``.

Secrets (``api_key`` and any ``*_key`` / ``*token*`` / ``*secret*`` / ``password`` string field) are
``Secret`` values: a literal or a ``${VAR}`` reference that is resolved only when used (``.get()``), so
validating a file needs no secret, and no dump, ``repr`` or log ever shows the value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import core_schema


class ConfigError(Exception):
    """A config that cannot be used; the message names the key, the file and what is allowed."""


class CrossFieldError(ValueError):
    """A rule between several keys; ``values`` maps each key (relative to the model) to its value, so
    that the loader can name the full key paths and the files that set them."""

    def __init__(self, rule: str, values: dict[str, Any]):
        super().__init__(rule)
        self.rule = rule
        self.values = values


# ----------------------------------------------------------------------------- ${VAR} and secrets

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ONLY_REFS = re.compile(r"(?:\$\{[A-Za-z_][A-Za-z0-9_]*\})+")
_SECRET_NAME = re.compile(r"(^|_)key$|token|secret|password")


def interpolate(value: str, key_path: str) -> str:
    """Replace each ``${VAR}`` in ``value`` by ``os.environ[VAR]``; a missing variable is a ConfigError
    naming the variable and the key path the value came from."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise ConfigError(
                f"`{key_path}` refers to environment variable {name}, which is not set; "
                f"export {name}=... before running"
            )
        return os.environ[name]

    return _ENV_REF.sub(sub, value)


class Secret:
    """A secret config value: a literal or a ``${VAR}`` reference, resolved by ``get()`` at use time."""

    __slots__ = ("_raw", "key_path")

    def __init__(self, raw: str, key_path: str = "") -> None:
        self._raw = raw
        self.key_path = key_path  # set by RunConfig after validation, for error messages

    def get(self) -> str:
        """The secret's value, with ``${VAR}`` references read from the environment now."""
        return interpolate(self._raw, self.key_path or "secret")

    def redacted(self) -> str:
        """``${VAR}`` when the value is only environment references, else ``***``."""
        return self._raw if _ONLY_REFS.fullmatch(self._raw) else "***"

    def __repr__(self) -> str:
        return f"Secret({self.redacted()!r})"

    __str__ = redacted

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)

    @classmethod
    def _validate(cls, value: Any) -> Secret:
        if isinstance(value, Secret):
            return cls(value._raw, value.key_path)
        if not isinstance(value, str):
            raise ValueError("expected a string (a literal secret or a ${VAR} reference)")
        return cls(value)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        # Serialising (model_dump, to_yaml) always redacts: there is no dump that shows the value.
        return core_schema.no_info_plain_validator_function(
            cls._validate,
            serialization=core_schema.plain_serializer_function_ser_schema(lambda s: s.redacted()),
        )

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: Any) -> dict[str, Any]:
        return {"type": "string", "format": "password"}


# ----------------------------------------------------------------------------- shared pieces

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
Unit = Annotated[float, Field(ge=0, le=1)]  # [0, 1]
OpenUnit = Annotated[float, Field(gt=0, lt=1)]  # (0, 1)
Weight = Annotated[float, Field(ge=0, le=10)]


class Section(BaseModel):
    """Base of every config model: unknown keys are errors, the docstring under a field is its doc."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, info in cls.model_fields.items():
            if _SECRET_NAME.search(name) and info.annotation in (str, str | None):
                raise TypeError(f"{cls.__name__}.{name} looks like a secret: annotate it as Secret")


def _check(ok: bool, rule: str, **values: Any) -> None:
    if not ok:
        raise CrossFieldError(rule, values)


# ----------------------------------------------------------------------------- environment

HackPattern = Literal["repeated_tool_calls", "context_stuffing"]
ObservationField = Literal["last_tool_result", "user_intent", "order_status", "inventory_snapshot"]


class LatencySpec(Section):
    """Simulated tool latency: lognormal around ``median``, capped at ``max``."""

    median: NonNegFloat
    """Median latency, ms."""
    sigma: NonNegFloat = 0.0
    """Lognormal spread (sigma of log-latency); 0 = always the median."""
    max: NonNegFloat | None = None
    """Cap on one call's latency, ms; None = no cap."""

    @model_validator(mode="after")
    def _max_above_median(self) -> LatencySpec:
        if self.max is not None:
            _check(self.max >= self.median, "max must be >= median", max=self.max, median=self.median)
        return self


class ToolSpec(Section):
    """One tool of the action space; must match the real deployment."""

    name: str
    """Tool name the model calls."""
    params: list[str] = []
    """Parameter names the tool takes."""
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
    """Memory policy: keep the most recent ``k`` turns verbatim."""
    k: PosInt = 5
    """Number of recent turns kept verbatim."""
    summary_enabled: bool = True
    """Replace older turns by a summary instead of dropping them."""


class StateConfig(Section):
    """Episode state: trajectory history + tool results + memory summary."""

    max_turns: PosInt = 20
    """Maximum turns of one episode."""
    context_window: PosInt = 32768
    """Maximum tokens of prompt + response."""
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
    """What counts as success."""
    max_turns_exceeded: Literal["truncate", "fail"] = "truncate"
    """At ``max_turns``: truncate (score what was done) or fail (reward 0)."""
    tool_error_threshold: PosInt = 3
    """End the episode after this many tool errors."""


class RuleCheck(Section):
    """A rule-based reward component."""

    check: Literal["refund_amount_correct", "policy_compliance"]
    """Which rule."""
    weight: Weight
    """Weight of this component in the reward."""


class RubricCheck(Section):
    """A rubric-scored reward component."""

    rubric: Literal["response_quality", "efficiency"]
    """Which rubric."""
    weight: Weight
    """Weight of this component in the reward."""


class AntiHackingConfig(Section):
    """Reward-hacking detection: flagged patterns are penalised and logged as ``reward/hacking/*``."""

    enabled: bool = True
    """Detect and penalise hacking patterns."""
    detect_patterns: list[HackPattern] = ["repeated_tool_calls", "context_stuffing"]
    """Patterns to detect."""
    penalty: dict[HackPattern, NonNegFloat] = {"repeated_tool_calls": 0.1, "context_stuffing": 0.1}
    """Reward subtracted per detected pattern."""
    repeat_window: PosInt = 4
    """Turns looked back when detecting repeated identical tool calls."""
    judge: Literal["deterministic"] = "deterministic"
    """Who scores rubrics: a deterministic scorer (no judge model is called)."""


class VerifierConfig(Section):
    """The reward function: weighted rule checks and rubrics."""

    type: Literal["hybrid", "rule", "model"] = "hybrid"
    """Which components count: rules, rubrics or both."""
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
    """Registered environment name."""
    type: Literal["gym_like"] = "gym_like"
    """Interface: reset/step."""
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
    """Number of generated training tasks."""
    num_eval_tasks: PosInt = 64
    """Number of generated held-out tasks."""


# ----------------------------------------------------------------------------- agent, parser, client


class AgentLoopConfig(Section):
    """The multi-turn agent loop (GENERATING ⇄ PROCESSING_TOOLS)."""

    name: str = "tool_agent"
    """Registered agent loop, as in ``@register("tool_agent")``."""
    max_user_turns: PosInt = 3
    """Maximum (simulated) user turns per episode."""
    max_assistant_turns: PosInt = 5
    """Maximum assistant turns per episode."""
    max_parallel_calls: PosInt = 2
    """Maximum tool calls executed concurrently within one assistant turn."""
    tool_selection: Literal["per_sample", "all"] = "per_sample"
    """Offer each sample its task's tools (per_sample) or every tool (all)."""


class ToolParserConfig(Section):
    """How tool calls are parsed out of the model's text."""

    name: Literal["hermes", "function_call_parser"] = "hermes"
    """Registered tool-call parser."""
    stop_token_ids: list[NonNegInt] = []
    """Extra token ids that end a generation (e.g. the end-of-tool-call token)."""


class LLMClientConfig(Section):
    """An OpenAI-compatible endpoint (rollouts on a server, teachers, ``tether ping``).

    ``base_url`` and ``model`` may contain ``${VAR}``; like the key they are resolved at use time by
    ``resolved()``."""

    base_url: str = "https://api.example.com/v1"
    """Endpoint URL, http:// or https://."""
    api_key: Secret | None = None
    """API key, best given as ``${VAR}``; None = no Authorization header."""
    model: str = "your-rollout-model-id"
    """Model id sent with each request."""
    timeout_s: PosFloat = 60.0
    """Timeout of one request, seconds."""
    max_retries: NonNegInt = 3
    """Retries of a request that failed in a retryable way (429, 5xx, refused connection)."""

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith("${"):  # a ${VAR} reference is checked when resolved
            _check_url(v)
        return v

    def resolved(self) -> dict[str, str | None]:
        """``base_url``, ``api_key`` and ``model`` with ``${VAR}`` read from the environment now."""
        url = interpolate(self.base_url, "llm_client.base_url")
        try:
            _check_url(url)
        except ValueError as e:
            raise ConfigError(f"`llm_client.base_url` resolved to {url!r}: {e}") from None
        return {
            "base_url": url,
            "api_key": self.api_key.get() if self.api_key is not None else None,
            "model": interpolate(self.model, "llm_client.model"),
        }


def _check_url(url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https:// (or be a ${VAR} reference)")


# ----------------------------------------------------------------------------- model and engine


class ModelConfig(Section):
    """The policy model: the built-in tiny preset or a Hugging Face folder (exactly one)."""

    preset: Literal["tiny"] | None = "tiny"
    """Built-in model built from a config (no download); cleared when only ``path`` is given."""
    path: str | None = None
    """Local Hugging Face model folder (``AutoModelForCausalLM``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path is not None and "preset" not in self.model_fields_set:
            self.preset = None  # giving a path replaces the default preset
        both = self.preset is not None and self.path is not None
        _check(
            (self.preset is None) != (self.path is None),
            "give exactly one of preset and path" + (" (set preset: null to use path)" if both else ""),
            preset=self.preset,
            path=self.path,
        )
        return self


class EngineConfig(Section):
    """Where and how the rollout policy samples."""

    type: Literal["local", "remote"] = "local"
    """In-process torch engine, or an OpenAI-compatible server (``llm_client``)."""
    max_batch_size: PosInt = 64
    """Maximum sequences decoded together."""
    temperature: NonNegFloat = 1.0
    """Sampling temperature; 0 = greedy."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    max_tokens: PosInt = 64
    """Maximum new tokens per assistant turn."""


# ----------------------------------------------------------------------------- rollout and buffer


class SchedulerConfig(Section):
    """Admission of rollouts under bounded staleness."""

    type: Literal["fifo", "windowed_fifo"] = "windowed_fifo"
    """Scheduling policy."""
    window_size: PosInt = 64
    """Tasks in flight in the window."""
    max_staleness: NonNegInt = 4
    """Maximum policy versions a rollout may lag behind the trainer when admitted."""


class PartialRolloutConfig(Section):
    """Interrupting generations at a weight sync and resuming them under the new weights."""

    enabled: bool = True
    """Resume interrupted generations instead of discarding them."""
    segment_length: PosInt = 8
    """Tokens generated per segment between interruption points."""
    replay_buffer_size: PosInt = 512
    """Interrupted rollouts kept for resumption."""
    reuse_policy: Literal["on_policy_segment_only", "all"] = "on_policy_segment_only"
    """Which segments of a resumed rollout are trained on."""


class WorkerConfig(Section):
    """Rollout workers."""

    num_workers: PosInt = 32
    """Number of rollout workers."""
    max_concurrent_tasks: PosInt = 128
    """Maximum episodes running at once across workers."""
    task_timeout_s: PosFloat = 600
    """An episode running longer than this fails, seconds."""
    retry_on_failure: NonNegInt = 2
    """Retries of a failed episode."""


class RolloutConfig(Section):
    """How rollouts are produced relative to training."""

    mode: Literal["sync", "one_step_off_policy", "fully_async"] = "sync"
    """sync: generate then train; one_step_off_policy: generate k+1 while training k; fully_async:
    continuous generation (the seed's ``async`` means fully_async)."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Admission control."""
    partial_rollout: PartialRolloutConfig = PartialRolloutConfig()
    """Interrupt/resume at weight syncs."""
    worker: WorkerConfig = WorkerConfig()
    """Rollout workers."""

    @field_validator("mode", mode="before")
    @classmethod
    def _seed_async(cls, v: Any) -> Any:
        return "fully_async" if v == "async" else v


class StaleFilterConfig(Section):
    """Drop samples at consumption whose policy lag is too large."""

    enabled: bool = True
    """Filter stale samples when the trainer takes them."""
    max_policy_lag: NonNegInt = 3
    """Maximum policy versions between a sample's behaviour policy and the trainer."""


class BufferConfig(Section):
    """The sample buffer between rollouts and the learner."""

    type: Literal["fifo", "priority"] = "priority"
    """Take samples in order or by priority."""
    freshness_weight: Unit = 0.7
    """Priority weight of freshness (low policy lag)."""
    diversity_weight: Unit = 0.3
    """Priority weight of diversity."""
    stale_filter: StaleFilterConfig = StaleFilterConfig()
    """Staleness filter at consumption."""


# ----------------------------------------------------------------------------- learner


class OffPolicyCorrectionConfig(Section):
    """Correction for the gap between the behaviour and the target policy."""

    method: Literal[
        "double_sided_importance_sampling", "truncated_importance_sampling", "decoupled_ppo", "none"
    ] = "double_sided_importance_sampling"
    """Correction method."""
    clip_ratio: OpenUnit = 0.2
    """Importance-ratio clip epsilon, in (0, 1)."""
    token_level_clipping: bool = True
    """Clip per token rather than per sequence."""
    tis_enabled: bool = True
    """Truncated importance sampling of the rollout/train logprob mismatch."""


class LearnerConfig(Section):
    """Batching of the policy update (trajectories, not prompts)."""

    batch_size: PosInt = 64
    """Trajectories per trainer step."""
    mini_batch_size: PosInt = 8
    """Trajectories per optimizer update; divides batch_size."""
    update_frequency: PosInt = 4
    """Passes (PPO epochs) over each trainer batch per trainer step; every pass reuses the behaviour logprobs as old logprobs."""
    gradient_accumulation_steps: PosInt = 2
    """Micro-batches accumulated per optimizer update; divides mini_batch_size."""
    off_policy_correction: OffPolicyCorrectionConfig = OffPolicyCorrectionConfig()
    """Off-policy correction."""

    @model_validator(mode="after")
    def _batches_divide(self) -> LearnerConfig:
        b, m, g = self.batch_size, self.mini_batch_size, self.gradient_accumulation_steps
        rule = "mini_batch_size must be <= batch_size and divide it"
        _check(m <= b and b % m == 0, rule, mini_batch_size=m, batch_size=b)
        rule = "gradient_accumulation_steps must divide mini_batch_size"
        _check(m % g == 0, rule, gradient_accumulation_steps=g, mini_batch_size=m)
        return self


# ----------------------------------------------------------------------------- policy optimization


class DiversityBonusConfig(Section):
    """A reward bonus for diverse responses within a group."""

    enabled: bool = True
    """Add the diversity bonus."""
    coef: NonNegFloat = 0.05
    """Bonus coefficient."""
    metric: Literal["semantic_cluster_count"] = "semantic_cluster_count"
    """How diversity is measured."""


class ExplorationConfig(Section):
    """Keeping exploration from collapsing."""

    entropy_coef: NonNegFloat = 0.01
    """Entropy bonus coefficient."""
    clip_higher: OpenUnit = 0.28
    """Upper clip epsilon (DAPO clip-higher), in (0, 1)."""
    diversity_bonus: DiversityBonusConfig = DiversityBonusConfig()
    """Diversity bonus."""


class DegenerateGroupFilterConfig(Section):
    """Groups whose rewards barely differ carry no signal: drop or resample them."""

    enabled: bool = True
    """Filter degenerate groups."""
    min_reward_std: NonNegFloat = 0.1
    """A group with reward std below this is degenerate."""
    resample_attempts: NonNegInt = 2
    """Times a degenerate group's task is resampled before it is dropped."""


class AdvantageConfig(Section):
    """Advantage estimation."""

    estimator: Literal["group_relative"] = "group_relative"
    """Advantage = reward relative to the task's group."""
    group_size: Annotated[int, Field(ge=2)] = 8
    """Trajectories per task (a group)."""
    normalization: Literal["group", "batch", "none"] = "batch"
    """Divide advantages by the std of the group, of the batch, or not at all."""
    degenerate_group_filter: DegenerateGroupFilterConfig = DegenerateGroupFilterConfig()
    """Degenerate-group filter."""


class RolloutAllocationConfig(Section):
    """How many rollouts each prompt gets."""

    strategy: Literal["fixed", "adaptive"] = "adaptive"
    """Same count for every prompt, or more for prompts with more signal."""
    base_rollouts_per_prompt: PosInt = 8
    """Rollouts per prompt before reallocation."""
    max_rollouts_per_prompt: PosInt = 32
    """Upper bound of rollouts per prompt; >= base_rollouts_per_prompt."""
    allocation_metric: Literal["gradient_variance_proxy"] = "gradient_variance_proxy"
    """Signal used to reallocate."""
    reallocation_interval: PosInt = 100
    """Trainer steps between reallocations."""

    @model_validator(mode="after")
    def _max_above_base(self) -> RolloutAllocationConfig:
        b, m = self.base_rollouts_per_prompt, self.max_rollouts_per_prompt
        rule = "max_rollouts_per_prompt must be >= base_rollouts_per_prompt"
        _check(m >= b, rule, max_rollouts_per_prompt=m, base_rollouts_per_prompt=b)
        return self


class KLControlConfig(Section):
    """KL penalty to the reference policy."""

    type: Literal["relative_entropy", "none"] = "relative_entropy"
    """KL penalty on, or off."""
    target_kl: PosFloat = 0.01
    """KL the adaptive coefficient steers towards."""
    adaptive: bool = True
    """Adapt the coefficient towards target_kl."""
    max_kl: PosFloat = 0.05
    """KL above which the step is flagged; >= target_kl."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3)."""
    init_coef: NonNegFloat = 0.001
    """Initial KL coefficient."""

    @model_validator(mode="after")
    def _max_above_target(self) -> KLControlConfig:
        rule = "max_kl must be >= target_kl"
        _check(self.max_kl >= self.target_kl, rule, max_kl=self.max_kl, target_kl=self.target_kl)
        return self


class OptimizerConfig(Section):
    """The optimizer."""

    type: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: PosFloat = 1e-6
    """Learning rate."""
    weight_decay: NonNegFloat = 0.01
    """Decoupled weight decay."""
    warmup_steps: NonNegInt = 50
    """Linear warm-up steps."""
    max_grad_norm: PosFloat = 1.0
    """Gradient-norm clip."""


class PolicyOptimConfig(Section):
    """The policy-gradient objective and its controls."""

    algorithm: Literal["grpo_variant", "grpo", "dapo", "dr_grpo", "gspo", "cispo"] = "grpo_variant"
    """Loss variant."""
    exploration: ExplorationConfig = ExplorationConfig()
    """Exploration controls."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimation."""
    rollout_allocation: RolloutAllocationConfig = RolloutAllocationConfig()
    """Rollouts per prompt."""
    kl_control: KLControlConfig = KLControlConfig()
    """KL control."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer."""


# ----------------------------------------------------------------------------- components and placement


class TrainerConfig(Section):
    """The trainer component and the run length."""

    class_: Literal["FullyAsyncTrainer", "Trainer"] = Field("FullyAsyncTrainer", alias="class")
    """Trainer implementation."""
    ppo_mini_batch_size: PosInt = 64
    """Samples the trainer takes from the queue per batch."""
    require_batches: PosInt = 2
    """Batches the trainer needs per update."""
    trigger_parameter_sync_step: PosInt = 4
    """Push weights to the rollouter every N trainer steps."""
    use_trainer_do_validate: bool = True
    """The trainer runs validation itself (mixed validation mode)."""
    total_steps: PosInt = 100
    """Trainer steps of the run."""
    eval_every: NonNegInt = 10
    """Held-out evaluation every N steps (also at step 0 and at the end); 0 = only those."""
    save_every: NonNegInt = 50
    """Checkpoint every N steps (also at the end); 0 = only at the end."""
    seed: int = 0
    """Seed of sampling, shuffling and initialisation."""
    eval_tasks: PosInt | None = None
    """Held-out tasks per evaluation; None = environment.num_eval_tasks."""


class RollouterConfig(Section):
    """The rollouter component."""

    class_: str = Field("FullyAsyncRollouter", alias="class")
    """Rollouter implementation."""
    max_queue_size: PosInt = 512
    """Message-queue capacity; when full the oldest sample is dropped."""
    partial_rollout: bool = True
    """Interrupted generations resume automatically."""


class MessageQueueConfig(Section):
    """The queue between rollouter and trainer."""

    class_: str = Field("MessageQueue", alias="class")
    """Queue implementation."""
    max_queue_size: PosInt = 512
    """Capacity; when full the oldest sample is dropped."""


class PoolConfig(Section):
    """A Ray resource pool."""

    num_gpus: NonNegInt = 8
    """GPUs in the pool (0 = CPU only)."""


class ResourcePoolConfig(Section):
    """Separate resource pools for training and rollout (``backend: ray``)."""

    trainer_pool: PoolConfig = PoolConfig()
    """Trainer resources."""
    rollout_pool: PoolConfig = PoolConfig()
    """Rollout resources."""


class ActorWorkerConfig(Section):
    """The trainer's actor worker."""

    class_: str = Field("DetachActorWorker", alias="class")
    """Worker implementation (DetachActorWorker can offload to CPU and restore)."""
    strategy: Literal["fsdp", "fsdp2", "veOmni", "megatron"] = "fsdp2"
    """Parallelism strategy."""


class MetricsConfig(Section):
    """Where metrics go (``metrics.jsonl`` is always written)."""

    tensorboard: bool = True
    """Write TensorBoard events."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: str | None = None
    """W&B project; None = "tether"."""


# ----------------------------------------------------------------------------- the run


class RunConfig(Section):
    """A whole run: every section has defaults, so ``RunConfig()`` is valid."""

    environment: EnvironmentConfig = EnvironmentConfig()
    """The environment."""
    agent_loop: AgentLoopConfig = AgentLoopConfig()
    """The agent loop."""
    tool_parser: ToolParserConfig = ToolParserConfig()
    """Tool-call parsing."""
    llm_client: LLMClientConfig = LLMClientConfig()
    """OpenAI-compatible endpoint."""
    model: ModelConfig = ModelConfig()
    """The policy model."""
    engine: EngineConfig = EngineConfig()
    """The rollout engine."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollout mode and workers."""
    buffer: BufferConfig = BufferConfig()
    """Sample buffer."""
    learner: LearnerConfig = LearnerConfig()
    """Update batching and off-policy correction."""
    policy_optimization: PolicyOptimConfig = PolicyOptimConfig()
    """Objective, exploration, advantages, KL, optimizer."""
    trainer: TrainerConfig = TrainerConfig()
    """Trainer and run length."""
    rollouter: RollouterConfig = RollouterConfig()
    """Rollouter."""
    message_queue: MessageQueueConfig = MessageQueueConfig()
    """Rollouter → trainer queue."""
    resource_pool: ResourcePoolConfig = ResourcePoolConfig()
    """Resource pools (ray)."""
    actor_worker: ActorWorkerConfig = ActorWorkerConfig()
    """Actor worker."""
    backend: Literal["local", "ray"] = "local"
    """One process (asyncio + threads), or Ray actors."""
    metrics: MetricsConfig = MetricsConfig()
    """Metric sinks."""

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        rq, mq = self.rollouter, self.message_queue
        rq_set, mq_set = "max_queue_size" in rq.model_fields_set, "max_queue_size" in mq.model_fields_set
        if rq_set and mq_set:
            _check(
                rq.max_queue_size == mq.max_queue_size,
                "message_queue.max_queue_size and rollouter.max_queue_size name one queue: make them equal",
                **{"message_queue.max_queue_size": mq.max_queue_size,
                   "rollouter.max_queue_size": rq.max_queue_size},
            )
        elif rq_set or mq_set:  # one queue: the size given on either side sets both
            rq.max_queue_size = mq.max_queue_size = (rq if rq_set else mq).max_queue_size
        b, g = self.learner.batch_size, self.policy_optimization.advantage.group_size
        _check(
            b % g == 0,
            "learner.batch_size must be a multiple of policy_optimization.advantage.group_size "
            "(a group is trained as a unit)",
            **{"learner.batch_size": b, "policy_optimization.advantage.group_size": g},
        )
        _name_secrets(self, "")
        return self

    def derived(self) -> dict[str, int]:
        """Totals computed from the config (printed at start; never computed in shell)."""
        b, m = self.learner.batch_size, self.learner.mini_batch_size
        g = self.policy_optimization.advantage.group_size
        return {
            "samples_per_step": b,
            "prompts_per_step": b // g,
            "group_size": g,
            "optimizer_updates_per_step": b // m,
            "micro_batch_size": m // self.learner.gradient_accumulation_steps,
            "eval_tasks": self.trainer.eval_tasks or self.environment.num_eval_tasks,
        }

    def redacted_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-ready, keys as in the files); secrets as ``***`` or ``${VAR}``."""
        return _redact_by_name(self.model_dump(mode="json", by_alias=True))

    def to_yaml(self) -> str:
        """The resolved config as YAML that loads back to an equal config (secrets redacted)."""
        return yaml.safe_dump(self.redacted_dict(), sort_keys=False, allow_unicode=True)


def _name_secrets(model: BaseModel, prefix: str) -> None:
    """Tell each Secret its key path, for the error raised when its variable is missing."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, Secret):
            value.key_path = path
        elif isinstance(value, BaseModel):
            _name_secrets(value, path + ".")


def _redact_by_name(data: Any) -> Any:
    """Belt and braces: any string under a secret-looking key is redacted even if not a Secret."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            hide = isinstance(v, str) and _SECRET_NAME.search(str(k))
            out[k] = Secret(v).redacted() if hide else _redact_by_name(v)
        return out
    if isinstance(data, list):
        return [_redact_by_name(v) for v in data]
    return data


def load_config(paths: Sequence[str | Path] | str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Merge the YAML ``paths`` in order, apply ``--set key.path=value`` ``overrides``, validate.

    Raises ConfigError naming the key path, the file that set it, the value and what is allowed.
    (Implemented in ``tether.config_io``; imported here lazily because that module imports this one.)"""
    from tether.config_io import load_config as load

    return load(paths, overrides)


