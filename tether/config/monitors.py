"""``monitors``: the checks that watch a run while it trains (``tether.pipeline.monitors``)."""

from __future__ import annotations

from typing import Literal

from tether.config.base import NonNegFloat, PosFloat, PosInt, Section

__all__ = ["MonitorsConfig"]


class MonitorsConfig(Section):
    """The failure patterns of the first source document's section 5 (exploration collapse, signal loss,
    distribution shift, reward hacking), checked on every step's metrics while the run trains. A check that
    holds for ``patience`` steps in a row warns once, with the diagnosis and the keys that remedy it."""

    enabled: bool = True
    """Run the monitors (``monitor/*`` metrics, one warning per failing check). false: no monitor metrics and no
    warnings."""
    on_fail: Literal["warn", "stop"] = "warn"
    """What a failing check does: warn (print and log the diagnosis once, keep training) or stop (also save a
    checkpoint of the step and stop the run, exit code 3; fix the config and ``--resume``)."""
    patience: PosInt = 3
    """Consecutive steps a check must fail before it counts as failing (the staleness bound fails at once:
    exceeding it is a bug, not noise)."""
    min_entropy_ratio: PosFloat = 0.2
    """Exploration: the policy's mean token entropy (``optim/entropy``) below this fraction of its value at the
    run's first step (after a resume: the first step of the resumed run) means it has collapsed onto a few tokens.
    Relative, because the level depends on the model and on how much of each response is fixed format."""
    min_distinct_strategies: PosFloat = 1.25
    """Exploration: the mean number of distinct strategies per group (``monitor/distinct_strategies``: distinct
    tool-call paths and final facts, ``tether.algo.diversity``, over every group delivered for the step) below
    this means the rollouts of most tasks repeat one path."""
    min_reward_std: NonNegFloat = 0.05
    """Learning signal: the mean within-group reward std before the degenerate-group filter
    (``optim/raw_reward_std_within_group``) below this means most groups give no gradient (the document's
    "advantage_std below 0.05 for long")."""
    max_degenerate_ratio: PosFloat = 0.9
    """Learning signal: the fraction of groups generated degenerate (equal rewards) before the filter
    (``optim/degenerate_group_ratio_before_filter``) above this means the step's signal rests on very few
    groups."""
    max_is_masked_fraction: PosFloat = 0.2
    """Shift: the fraction of tokens whose importance ratio falls outside the correction band
    (``optim/is_masked_fraction``) above this means the behaviour policy and the trained one have drifted apart."""
    max_logp_abs_diff: PosFloat = 0.1
    """Shift: the train–inference mismatch, mean |log π_train − log π_behav| over the tokens the trainer scored under
    the very weights that sampled them (``rollout/logp_abs_diff_mean``), above this means the engine does not run the
    weights the trainer has — a weight sync that did not arrive, a dtype or kernel that differs too much. fp32 on one
    machine: ~1e-6; bf16: ~0.01–0.02 is healthy (TRL #5312), a silently failed sync measured 0.20."""
    max_mismatch_kl: PosFloat = 0.01
    """Shift: the k3 estimate of KL(π_behav ‖ π_train) over the same tokens (``rollout/mismatch_kl``) above this
    (dense models in bf16: 1e-5 to 1e-3 per token)."""
    hacking_rate_rise: PosFloat = 0.1
    """Hacking: a rise of the fraction of delivered trajectories with an anti-hacking flag
    (``monitor/hacking_flag_rate``) of at least this over ``trend_window`` steps (the second half's mean against
    the first half's), while ``reward/mean`` does not fall, means the policy is learning a pattern the verifier flags
    and that pays. A rise, not a level: a warm-started policy may start with flags that RL then removes."""
    trend_window: PosInt = 8
    """Hacking: steps over which the flag rate's rise and "reward up while success flat" are judged (the mean of the
    window's second half against its first half)."""
    reward_rise: PosFloat = 0.1
    """Hacking: a rise of ``reward/mean`` of at least this over ``trend_window`` steps while
    ``rollout/success_rate`` rises by less than a quarter of it (and the flag rate does not fall) counts as reward up
    while success is flat."""
