"""The ``policy_optimization`` section: the objective and its controls (exploration, advantages, rollout
allocation, KL control, optimizer). The other sections are in sections.py and agent.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tether.config.base import *  # noqa: F401,F403 — the shared types
from tether.config.base import _check  # noqa: F401


class DiversityBonusConfig(Section):
    """A reward bonus for diverse responses within a group."""

    enabled: bool = True
    """Add the diversity bonus to the rewards of successful trajectories."""
    coef: NonNegFloat = 0.05
    """Bonus coefficient, in reward units: a group that solved its task in k distinct ways earns k × coef
    between its successful trajectories."""
    metric: Literal["semantic_cluster_count"] = "semantic_cluster_count"
    """How diversity is measured. semantic_cluster_count is the only value today: distinct strategies (tool
    calls with canonical arguments plus the final answer's facts; exact-match clusters, ``tether.algo.diversity``)."""


class ExplorationConfig(Section):
    """Keeping exploration from collapsing."""

    entropy_coef: NonNegFloat = 0.01
    """Entropy bonus coefficient (per-token entropy in nats, weighted into the loss); the algorithm's default
    when unset."""
    clip_higher: PosFloat = 0.28
    """Upper clip epsilon ε_high of the policy ratio (DAPO clip-higher); the algorithm's default when unset
    (GSPO 4e-4, CISPO 4.0)."""
    diversity_bonus: DiversityBonusConfig = DiversityBonusConfig()
    """Diversity bonus."""


class DegenerateGroupFilterConfig(Section):
    """Groups whose rewards barely differ carry no signal: drop or resample them."""

    enabled: bool = True
    """Resample, then drop, degenerate groups; the algorithm's default when unset."""
    min_reward_std: NonNegFloat = 0.1
    """A group whose reward std is at most this is degenerate, in reward units."""
    resample_attempts: NonNegInt = 2
    """Times a degenerate group is generated again (fresh seeds) before the group is dropped."""
    resample: Literal["same_task", "new_task"] = "same_task"
    """What a resample attempt generates: same_task — the degenerate group's task again; new_task — another train
    task, drawn for the attempt (from (seed, step, group, attempt), so a resumed run draws the same), as DAPO's
    dynamic sampling fills its batch with fresh prompts. A task every rollout solved (or failed) under the current
    policy mostly does so again, so a fresh one is likelier to carry signal (``rollout/resampled_groups`` against
    ``rollout/dropped_groups`` says how often each turns out informative)."""


class AdvantageConfig(Section):
    """Advantage estimation."""

    estimator: Literal["group_relative"] = "group_relative"
    """Advantage estimator. group_relative (reward minus its group's mean, GRPO) is the only value today."""
    group_size: Annotated[int, Field(ge=2)] = 8
    """Trajectories per task (a group), before any reallocation. The seed's
    ``rollout_allocation.base_rollouts_per_prompt`` is an alias of it."""
    normalization: Literal["group", "batch", "none"] = "batch"
    """Divide advantages by the reward std of the group, of the batch, or not at all; the algorithm's
    default when unset."""
    degenerate_group_filter: DegenerateGroupFilterConfig = DegenerateGroupFilterConfig()
    """Degenerate-group filter."""


class RolloutAllocationConfig(Section):
    """How many rollouts each prompt gets."""

    strategy: Literal["fixed", "adaptive"] = "adaptive"
    """Same count for every prompt (fixed), or more for prompts with more signal (adaptive; the step's total
    stays group_size × prompts)."""
    max_rollouts_per_prompt: PosInt = 32
    """Upper bound of rollouts per prompt, in rollouts; >= advantage.group_size (base_rollouts_per_prompt)."""
    allocation_metric: Literal["gradient_variance_proxy"] = "gradient_variance_proxy"
    """Signal used to reallocate. gradient_variance_proxy is the only value today: rollouts ∝ √(variance of the
    task's recent rewards) (``tether.algo.allocation``)."""
    reallocation_interval: PosInt = 100
    """Trainer steps between reallocations, in steps; the first happens at this step, so a value >=
    trainer.total_steps never reallocates (a warning at start)."""


class TaskSelectionConfig(Section):
    """Which train tasks a step draws (tether's own section; ``tether.pipeline.tasks``)."""

    enabled: bool = False
    """Draw by difficulty: a task whose last ``window`` groups (their first attempts) were all degenerate — every
    rollout scored alike, all passed or all failed, so no signal — is skipped for ``skip_steps`` steps and then drawn
    again (a re-probe); a task not drawn yet is judged by its kind's last ``window`` groups. The tasks that still
    teach take the skipped ones' places, in the epochs' shuffled order (online difficulty filtering, as DAPO's
    dynamic sampling does within a step). off: every task in turn (shuffled epochs)."""
    window: PosInt = 2
    """Degenerate groups in a row (first attempts) of a task, or of a kind for its tasks not drawn yet, that make it
    skipped, in groups."""
    skip_steps: PosInt = 8
    """How long a skipped task waits before it is drawn again, in trainer steps."""


class KLControlConfig(Section):
    """KL penalty to the reference policy."""

    type: Literal["relative_entropy", "none"] = "relative_entropy"
    """KL(π_θ ‖ π_ref) penalty in the loss (relative_entropy), or none (no penalty, no max-KL guard); none
    when unset and the algorithm uses no KL."""
    target_kl: PosFloat = 0.01
    """KL the adaptive coefficient steers towards, in nats per token."""
    adaptive: bool = True
    """Adapt the coefficient towards target_kl (Ziegler et al. 2019); false = init_coef throughout."""
    max_kl: PosFloat = 0.05
    """Per-token KL, in nats, above which a step's remaining optimizer updates are skipped; >= target_kl."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3)."""
    init_coef: NonNegFloat = 0.001
    """Initial KL coefficient β (unitless); the algorithm's default when unset."""
    horizon: PosInt = 10_000
    """Adaptive controller horizon, in trajectories: β moves by at most 20 % × batch_size / horizon per step."""

    @model_validator(mode="after")
    def _max_above_target(self) -> KLControlConfig:
        rule = "max_kl must be >= target_kl"
        _check(self.max_kl >= self.target_kl, rule, max_kl=self.max_kl, target_kl=self.target_kl)
        return self


class OptimizerConfig(Section):
    """The optimizer."""

    type: Literal["adamw"] = "adamw"
    """Optimizer. adamw (torch.optim.AdamW) is the only value today."""
    lr: PosFloat = 1e-6
    """Peak learning rate (per optimizer update)."""
    weight_decay: NonNegFloat = 0.01
    """Decoupled weight decay (AdamW), per update, as a fraction of lr × weight."""
    warmup_steps: NonNegInt = 50
    """Linear learning-rate warm-up, in optimizer updates (not trainer steps); 0 = none."""
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """After the warm-up: constant lr, or a cosine / linear decay from lr to lr × min_lr_ratio at update
    decay_steps (verl's ``optim.lr_scheduler_type`` and ``min_lr_ratio``; TRL's ``lr_scheduler_type``)."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    """The decay's end, as a fraction of lr (cosine / linear only)."""
    decay_steps: PosInt | None = None
    """The update (counting applied optimizer updates, the warm-up's included) at which the decay reaches
    lr × min_lr_ratio, then stays; None = the run's planned updates: trainer.total_steps × learner.batch_size /
    learner.mini_batch_size × learner.update_frequency (cosine / linear only)."""
    max_grad_norm: PosFloat = 1.0
    """Gradients are clipped to this global L2 norm before each update."""


class PolicyOptimConfig(Section):
    """The policy-gradient objective and its controls."""

    algorithm: Literal["grpo_variant", "grpo", "dapo", "dr_grpo", "gspo", "cispo"] = "grpo_variant"
    """Loss variant; its defaults (tether.algo.variants.ALGORITHMS) fill the keys the config leaves unset."""
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] | None = None
    """Per-token loss → scalar; None = the algorithm's."""
    clip_ratio_low: Annotated[float, Field(ge=0, lt=1)] | None = None
    """Lower clip ε_low of the policy ratio; None = learner.off_policy_correction.clip_ratio (GSPO: 3e-4)."""
    clip_ratio_c: Annotated[float, Field(gt=1)] | None = 3.0
    """Dual-clip bound c > 1 (Ye et al. 2020, arXiv 1912.09729): a token with negative advantage loses at most
    c·|A|, however far its ratio r has run above c (its gradient is then cut); None = no dual clip. verl's
    ``actor.clip_ratio_c``, default 3.0. Applies to the PPO-clip losses (GSPO: on its sequence ratio), not CISPO."""
    exploration: ExplorationConfig = ExplorationConfig()
    """Exploration controls."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimation."""
    rollout_allocation: RolloutAllocationConfig = RolloutAllocationConfig()
    """Rollouts per prompt."""
    task_selection: TaskSelectionConfig = TaskSelectionConfig()
    """Which tasks a step draws: all in turn, or skipping those that no longer teach."""
    kl_control: KLControlConfig = KLControlConfig()
    """KL control."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer."""
