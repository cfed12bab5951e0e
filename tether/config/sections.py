"""The sections beside ``environment``: agent loop, parser, client, model, engine, rollout, buffer,
learner, policy optimisation, trainer and placement."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import core_schema

from tether.config.base import *  # noqa: F401,F403 — the shared types
from tether.config.base import _check, _ENV_REF, interpolate  # noqa: F401

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
    """A weight sync interrupts in-flight generations, which resume under the new weights; false = the sync
    waits for them to finish under the old ones."""
    segment_length: PosInt = 8
    """Decode steps between interruption points: every generation gets at least this many tokens from a
    version before the next weight sync is applied."""
    replay_buffer_size: PosInt = 512
    """Finished groups the priority replay buffer holds (buffer.type: priority)."""
    reuse_policy: Literal["on_policy_segment_only", "all"] = "on_policy_segment_only"
    """Which tokens of a partial rollout are trained on: only those of its last (newest) version — earlier
    segments stay as context — or all of them."""


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
    tis_cap: PosFloat = 2.0
    """TIS cap C: importance weights above it are truncated to it (verl's rollout_is_threshold)."""


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


# ----------------------------------------------------------------------------- components and placement


class TrainerConfig(Section):
    """The trainer component and the run length."""

    class_: Literal["FullyAsyncTrainer", "Trainer"] = Field("FullyAsyncTrainer", alias="class")
    """Trainer implementation."""
    ppo_mini_batch_size: PosInt = 64
    """Samples the trainer takes from the message queue per batch."""
    require_batches: PosInt = 2
    """Queue batches per trainer step: ppo_mini_batch_size × require_batches = learner.batch_size (set either side)."""
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


