"""``RunConfig``: the whole run (loaded from files by ``tether.config.io.load_config``)."""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import model_validator

from tether.config.actor import ActorWorkerConfig
from tether.config.agent import AgentLoopConfig, ToolParserConfig
from tether.config.aliases import fold
from tether.config.base import *  # noqa: F401,F403
from tether.config.base import _check
from tether.config.cluster import RayConfig, ResourcePoolConfig
from tether.config.environment import *  # noqa: F401,F403
from tether.config.monitors import MonitorsConfig
from tether.config.policy import *  # noqa: F401,F403
from tether.config.reward import RewardConfig, check_reward
from tether.config.sections import *  # noqa: F401,F403
from tether.config.support import REFUSED_SECTIONS
from tether.config.teacher import TeacherConfig
from tether.secrets import name_secrets, redact_by_name

# ----------------------------------------------------------------------------- the run


class RunConfig(Section):
    """A whole run: every section has defaults, so ``RunConfig()`` is valid. Each value is held once, under its
    canonical key: the seeds' aliases (``rollouter.max_queue_size``, ``trainer.class``, …) are folded into it
    before validation (``tether.config.aliases``)."""

    environment: EnvironmentConfig = EnvironmentConfig()
    """The environment."""
    agent_loop: AgentLoopConfig = AgentLoopConfig()
    """The agent loop."""
    tool_parser: ToolParserConfig = ToolParserConfig()
    """Tool-call parsing."""
    llm_client: LLMClientConfig = LLMClientConfig()
    """OpenAI-compatible endpoint (``tether.llm.LLMClient.from_config``, ``tether ping``)."""
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
    message_queue: MessageQueueConfig = MessageQueueConfig()
    """Rollouter → trainer queue."""
    resource_pool: ResourcePoolConfig = ResourcePoolConfig()
    """Resource pools of the Ray backend (``tether.config.cluster``)."""
    actor_worker: ActorWorkerConfig = ActorWorkerConfig()
    """The trainer's worker: π_prox across a sync window, sharding (``tether.config.actor``)."""
    backend: Literal["local", "ray"] = "local"
    """local: one process (asyncio + threads; ``breakpoint()`` works). ray: the rollouter, the MessageQueue and
    the trainer as Ray actors (``tether.distributed``; the ``ray`` extra)."""
    ray: RayConfig = RayConfig()
    """The Ray cluster and weight transfer (``backend: ray``)."""
    metrics: MetricsConfig = MetricsConfig()
    """Metric sinks."""
    reward: RewardConfig = RewardConfig()
    """The reward loop and the LLM judge of the rubrics (``tether.config.reward``, ``tether.reward``)."""
    monitors: MonitorsConfig = MonitorsConfig()
    """Checks that watch the run while it trains (``tether.pipeline.monitors``)."""
    teacher: TeacherConfig = TeacherConfig()
    """On-policy distillation from a teacher model (``tether.config.teacher``, ``tether.teacher``)."""

    @model_validator(mode="before")
    @classmethod
    def _fold_aliases(cls, data: Any) -> Any:
        """Data given in Python (``RunConfig.model_validate``, ``RunConfig(**sections)``) folds the seeds' aliases
        as a file does; ``load_config`` has folded them already, naming the files."""
        if not isinstance(data, dict):
            return data
        data = _copy_mappings(data)
        problems = fold(data)
        if problems:
            raise problems[0]
        return data

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        self._queue_batch()
        b, g = self.learner.batch_size, self.policy_optimization.advantage.group_size
        _check(
            b % g == 0,
            "learner.batch_size must be a multiple of policy_optimization.advantage.group_size "
            "(a group is trained as a unit)",
            **{"learner.batch_size": b, "policy_optimization.advantage.group_size": g},
        )
        ra = self.policy_optimization.rollout_allocation
        _check(ra.max_rollouts_per_prompt >= g,
               "max_rollouts_per_prompt must be >= base_rollouts_per_prompt (= advantage.group_size)",
               **{"policy_optimization.rollout_allocation.max_rollouts_per_prompt": ra.max_rollouts_per_prompt,
                  "policy_optimization.advantage.group_size": g})
        ranks = self.resource_pool.trainer_pool.num_ranks
        _check(ranks is None or ranks == 1 or self.actor_worker.strategy in ("fsdp", "fsdp2"),
               "several trainer ranks shard one model: set actor_worker.strategy: fsdp2 (or num_ranks: 1)",
               **{"resource_pool.trainer_pool.num_ranks": ranks, "actor_worker.strategy": self.actor_worker.strategy})
        self._lora_alone()
        self._constrained_tool_calls()
        self._algorithm_defaults()
        self._lr_decay_horizon()
        check_reward(self)
        name_secrets(self)
        return self

    def _lora_alone(self) -> None:
        """``model.lora`` trains with every trainer layout (plain, FSDP2, several ranks) and engine; what is refused
        with it names both keys."""
        if self.model.lora is None:
            return
        _check(self.engine.weight_sync_dir is None, "model.lora pushes the adapter to a remote engine in the request "
               "body (tether serve's /update_lora_adapter_from_tensor), not through a folder: unset "
               "engine.weight_sync_dir or remove model.lora",
               **{"model.lora.rank": self.model.lora.rank, "engine.weight_sync_dir": self.engine.weight_sync_dir})

    def _constrained_tool_calls(self) -> None:
        """``agent_loop.constrained_tool_calls`` masks the local engine's logits with a hermes tool-call grammar."""
        if not self.agent_loop.constrained_tool_calls:
            return
        _check(self.engine.type != "remote", "agent_loop.constrained_tool_calls decodes under a grammar in the "
               "in-process engine; a remote server's engine does not take one: set engine.type: local",
               **{"agent_loop.constrained_tool_calls": True, "engine.type": self.engine.type})
        _check(self.tool_parser.name in ("hermes", "function_call_parser"), "agent_loop.constrained_tool_calls "
               "writes hermes tool-call blocks: use tool_parser.name hermes or function_call_parser",
               **{"agent_loop.constrained_tool_calls": True, "tool_parser.name": self.tool_parser.name})
        _check(self.engine.min_tokens == 0, "agent_loop.constrained_tool_calls: the grammar decides where a turn ends, "
               "engine.min_tokens would hold its end back: set engine.min_tokens: 0",
               **{"agent_loop.constrained_tool_calls": True, "engine.min_tokens": self.engine.min_tokens})

    def _queue_batch(self) -> None:
        """The async trainer takes a step's ``learner.batch_size`` samples from the queue in queue batches of
        ``trainer.ppo_mini_batch_size``: unset, half the step (the seed's two batches), or all of it when odd."""
        tr, b = self.trainer, self.learner.batch_size
        if "ppo_mini_batch_size" not in tr.model_fields_set:
            tr.ppo_mini_batch_size = b // 2 if b % 2 == 0 else b
        _check(b % tr.ppo_mini_batch_size == 0,
               "trainer.ppo_mini_batch_size (the queue batch) must divide learner.batch_size (the step)",
               **{"trainer.ppo_mini_batch_size": tr.ppo_mini_batch_size, "learner.batch_size": b})

    def _algorithm_defaults(self) -> None:
        """``policy_optimization.algorithm`` fills the keys the config leaves unset with its recipe's values,
        so that the dump (and ``tether config``) shows what will run."""
        from tether.algo.variants import algorithm_spec  # noqa: PLC0415 — torch, only when a config is built

        po = self.policy_optimization
        spec = algorithm_spec(po.algorithm)
        ex, adv, kl = po.exploration, po.advantage, po.kl_control
        unset = lambda section, key: key not in section.model_fields_set  # noqa: E731
        if unset(po, "loss_agg_mode") or po.loss_agg_mode is None:
            po.loss_agg_mode = spec.agg_mode
        if unset(po, "clip_ratio_low") and po.algorithm == "gspo":  # a sequence ratio: its own scale
            po.clip_ratio_low = spec.clip_low
        if unset(ex, "clip_higher"):
            ex.clip_higher = spec.clip_high
        if unset(ex, "entropy_coef"):
            ex.entropy_coef = spec.entropy_coef
        if unset(adv, "normalization"):
            adv.normalization = spec.normalization
        if unset(adv.degenerate_group_filter, "enabled"):
            adv.degenerate_group_filter.enabled = spec.filter_degenerate_groups
        if spec.kl_coef == 0.0 and unset(kl, "type"):
            kl.type = "none"
        elif spec.kl_coef > 0.0 and unset(kl, "init_coef"):
            kl.init_coef = spec.kl_coef

    def _lr_decay_horizon(self) -> None:
        """A decaying lr schedule with ``decay_steps`` unset ends at the run's planned last optimizer update."""
        lc, opt = self.learner, self.policy_optimization.optimizer
        if opt.lr_scheduler != "constant" and opt.decay_steps is None:
            opt.decay_steps = (self.trainer.total_steps * (lc.batch_size // lc.mini_batch_size)
                               * lc.update_frequency)

    def warnings(self) -> list[str]:
        """Values that are valid but cannot act within this run (e.g. an interval longer than the run), one
        sentence each, naming the key; printed at ``tether train`` start and by ``tether config``."""
        from tether.config.inert import inert_values  # noqa: PLC0415 — that module reads RunConfig's fields

        return inert_values(self)

    def redacted_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-ready, keys as in the files); secrets as ``***`` or ``${VAR}``. The sections
        whose feature is not built (``support.REFUSED_SECTIONS``) are left out, so that the dump loads back."""
        data = self.model_dump(mode="json", by_alias=True, exclude=set(REFUSED_SECTIONS))
        return redact_by_name(data)

    def to_yaml(self) -> str:
        """The resolved config as YAML that loads back to an equal config (secrets redacted)."""
        return yaml.safe_dump(self.redacted_dict(), sort_keys=False, allow_unicode=True)


def _copy_mappings(data: dict[Any, Any]) -> dict[Any, Any]:
    """``data`` with its nested mappings copied (folding changes them; the caller's stay as given)."""
    return {k: _copy_mappings(v) if isinstance(v, dict) else v for k, v in data.items()}
