"""``RunConfig``: the whole run, and ``load_config``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, model_validator

from tether.config.actor import ActorWorkerConfig
from tether.config.base import *  # noqa: F401,F403
from tether.config.base import _SECRET_NAME, _check  # noqa: F401
from tether.config.cluster import RayConfig, ResourcePoolConfig
from tether.config.environment import *  # noqa: F401,F403
from tether.config.monitors import MonitorsConfig
from tether.config.policy import *  # noqa: F401,F403
from tether.config.reward import RewardConfig, check_reward
from tether.config.sections import *  # noqa: F401,F403
from tether.config.sections import PIPELINES
from tether.config.support import REFUSED_SECTIONS
from tether.config.teacher import TeacherConfig

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
    rollouter: RollouterConfig = RollouterConfig()
    """Rollouter."""
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

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        self._pipeline_classes()
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
        self._one_partial_rollout_switch()
        self._trainer_step_size()
        self._one_group_size()
        b, g = self.learner.batch_size, self.policy_optimization.advantage.group_size
        _check(
            b % g == 0,
            "learner.batch_size must be a multiple of policy_optimization.advantage.group_size "
            "(a group is trained as a unit)",
            **{"learner.batch_size": b, "policy_optimization.advantage.group_size": g},
        )
        self._algorithm_defaults()
        check_reward(self)
        _name_secrets(self, "")
        return self

    def _pipeline_classes(self) -> None:
        """``trainer.class`` / ``rollouter.class`` name the pipeline, ``rollout.mode`` names it too: the classes
        given (either or both) must name one pipeline; with ``rollout.mode`` unset they set it, set it must
        agree; unset classes follow the mode (``PIPELINES``), so the dump shows a coherent triple."""
        ro, tr, rr = self.rollout, self.trainer, self.rollouter
        mode_of = {cls: mode for mode, pair in PIPELINES.items() for cls in pair}
        given = {k: c for k, c in (("trainer.class", tr.class_), ("rollouter.class", rr.class_)) if c is not None}
        modes = {mode_of[c] for c in given.values()}
        pairs = "; ".join(f"{t} + {r} run {m}" for m, (t, r) in PIPELINES.items())
        _check(len(modes) <= 1, f"trainer.class and rollouter.class name one pipeline ({pairs})", **given)
        if modes:
            (mode,) = modes
            if "mode" in ro.model_fields_set:
                _check(ro.mode == mode, f"{' and '.join(dict.fromkeys(given.values()))} run rollout.mode {mode}: "
                                        f"set the mode to {mode}, or unset the class keys to follow the mode",
                       **{"rollout.mode": ro.mode, **given})
            ro.mode = mode
        tr.class_, rr.class_ = PIPELINES[ro.mode]

    def _one_group_size(self) -> None:
        """``rollout_allocation.base_rollouts_per_prompt`` and ``advantage.group_size`` are the rollouts a task gets
        before any reallocation: set on one side it sets both; set on both they must agree."""
        adv, ra = self.policy_optimization.advantage, self.policy_optimization.rollout_allocation
        g_set, b_set = "group_size" in adv.model_fields_set, "base_rollouts_per_prompt" in ra.model_fields_set
        if g_set and b_set:
            _check(adv.group_size == ra.base_rollouts_per_prompt,
                   "policy_optimization.advantage.group_size and rollout_allocation.base_rollouts_per_prompt are "
                   "one number (rollouts per task before reallocation): make them equal",
                   **{"policy_optimization.advantage.group_size": adv.group_size,
                      "policy_optimization.rollout_allocation.base_rollouts_per_prompt": ra.base_rollouts_per_prompt})
        elif b_set:
            adv.group_size = ra.base_rollouts_per_prompt
        else:
            ra.base_rollouts_per_prompt = adv.group_size
        _check(ra.max_rollouts_per_prompt >= ra.base_rollouts_per_prompt,
               "max_rollouts_per_prompt must be >= base_rollouts_per_prompt (= advantage.group_size)",
               **{"policy_optimization.rollout_allocation.max_rollouts_per_prompt": ra.max_rollouts_per_prompt,
                  "policy_optimization.advantage.group_size": adv.group_size})

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

    def _one_partial_rollout_switch(self) -> None:
        """``rollouter.partial_rollout`` (fully_async_ppo.yaml) and ``rollout.partial_rollout.enabled``
        (async_pipeline.yaml) name one switch: set on one side it sets both; set on both they must agree."""
        ro, pr = self.rollouter, self.rollout.partial_rollout
        ro_set, pr_set = "partial_rollout" in ro.model_fields_set, "enabled" in pr.model_fields_set
        if ro_set and pr_set:
            _check(ro.partial_rollout == pr.enabled,
                   "rollouter.partial_rollout and rollout.partial_rollout.enabled name one switch: make them equal",
                   **{"rollouter.partial_rollout": ro.partial_rollout,
                      "rollout.partial_rollout.enabled": pr.enabled})
        elif ro_set or pr_set:
            ro.partial_rollout = pr.enabled = ro.partial_rollout if ro_set else pr.enabled

    def _trainer_step_size(self) -> None:
        """The async trainer's vocabulary for the step size: ``require_batches`` queue batches of
        ``ppo_mini_batch_size`` samples make one trainer step, i.e. ``learner.batch_size``."""
        tr, lc = self.trainer, self.learner
        if not {"ppo_mini_batch_size", "require_batches"} & tr.model_fields_set:
            if lc.batch_size % tr.require_batches:  # learner side (or defaults) only: the trainer follows
                tr.require_batches = 1
            tr.ppo_mini_batch_size = lc.batch_size // tr.require_batches
            return
        step = tr.ppo_mini_batch_size * tr.require_batches
        if "batch_size" in lc.model_fields_set:
            _check(step == lc.batch_size,
                   "trainer.ppo_mini_batch_size × trainer.require_batches is the samples of one trainer step, "
                   "which learner.batch_size also sets: make them equal (or set only one side)",
                   **{"trainer.ppo_mini_batch_size": tr.ppo_mini_batch_size,
                      "trainer.require_batches": tr.require_batches, "learner.batch_size": lc.batch_size})
        else:
            lc.batch_size = step
            if "mini_batch_size" not in lc.model_fields_set and step % lc.mini_batch_size:
                lc.mini_batch_size = tr.ppo_mini_batch_size
            # pydantic types a @model_validator method as its descriptor proxy; calling it works (re-runs the check).
            lc._batches_divide()  # type: ignore[operator]

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

    def warnings(self) -> list[str]:
        """Values that are valid but cannot act within this run (e.g. an interval longer than the run), one
        sentence each, naming the key; printed at ``tether train`` start and by ``tether config``."""
        from tether.config.inert import inert_values  # noqa: PLC0415 — that module reads RunConfig's fields

        return inert_values(self)

    def redacted_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-ready, keys as in the files); secrets as ``***`` or ``${VAR}``. The sections
        whose feature is not built (``support.REFUSED_SECTIONS``) are left out, so that the dump loads back."""
        data = self.model_dump(mode="json", by_alias=True, exclude=set(REFUSED_SECTIONS))
        return _redact_by_name(data)

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
    (Implemented in ``tether.config.io``; imported here lazily because that module imports this one.)"""
    from tether.config.io import load_config as load

    return load(paths, overrides)
