"""The ``policy_optimization`` section: the objective and its controls (exploration, advantages, rollout
allocation, KL control, optimizer). The other sections are in sections.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tether.config.base import *  # noqa: F401,F403 — the shared types
from tether.config.base import _check  # noqa: F401


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
    clip_higher: PosFloat = 0.28
    """Upper clip epsilon ε_high of the policy ratio (DAPO clip-higher); the algorithm's default when unset
    (GSPO 4e-4, CISPO 4.0)."""
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
    """Rollouts per prompt before reallocation; the same number as advantage.group_size (set either)."""
    max_rollouts_per_prompt: PosInt = 32
    """Upper bound of rollouts per prompt; >= base_rollouts_per_prompt."""
    allocation_metric: Literal["gradient_variance_proxy"] = "gradient_variance_proxy"
    """Signal used to reallocate."""
    reallocation_interval: PosInt = 100
    """Trainer steps between reallocations."""


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
    kl_control: KLControlConfig = KLControlConfig()
    """KL control."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer."""
