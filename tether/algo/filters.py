"""Degenerate-group filter: groups whose rewards barely differ carry (almost) no policy-gradient signal.

With group-relative advantages a group whose rewards are all equal has every advantage 0, so it only dilutes the
batch. DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Eq. 11: keep a group only if
0 < |{correct}| < G) drops such groups and keeps sampling until the batch is full. The seed config generalises
"all equal" to "reward std ≤ ``min_reward_std``" and resamples a degenerate task ``resample_attempts`` times
before dropping it.

The std is Bessel-corrected (sample std, ddof = 1), the one ``advantages.group_advantages`` divides by with
normalization "group", so "degenerate" here and ``degenerate_group_ratio`` there agree for the same threshold.
The comparison is ≤, as there: ``min_reward_std = 0`` is exactly DAPO's rule (all rewards equal). A group whose
rewards are all equal is degenerate whatever rounding says, and a singleton group is always degenerate (its
sample std is undefined and it has no baseline to compare against).

The resampling loop belongs to the trainer; ``resample_or_drop`` is its decision rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal


def group_reward_std(rewards: Sequence[float]) -> float:
    """Sample (Bessel-corrected) std of one group's rewards; NaN for a singleton, exactly 0 if all are equal."""
    n = len(rewards)
    if n < 2:
        return math.nan
    if max(rewards) == min(rewards):
        return 0.0
    mean = math.fsum(rewards) / n
    return math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1))


def decided_informative(finished: Sequence[float], size: int, *, min_reward_std: float) -> bool:
    """Whether a group of ``size`` rollouts is informative (sample std > ``min_reward_std``) whatever its unfinished
    rollouts score, from the rewards of those ``finished``: the lowest std the whole group can have is that of the
    stragglers all scoring the finished ones' mean, which adds nothing to the squared deviations, so it is
    sqrt(SS_finished / (size - 1)). (The converse — degenerate whatever the stragglers do — needs the reward's bounds,
    and with a bounded reward's usual range it holds only once every rollout has finished.)"""
    n = len(finished)
    if n < 2 or size < 2 or max(finished) == min(finished):
        return False
    mean = math.fsum(finished) / n
    return math.sqrt(math.fsum((r - mean) ** 2 for r in finished) / (size - 1)) > min_reward_std


def degenerate_groups(
    group_rewards: Sequence[Sequence[float]], *, min_reward_std: float
) -> tuple[list[bool], dict[str, float]]:
    """Which groups are degenerate: sample std ≤ ``min_reward_std``, or fewer than 2 rewards.

    Args:
        group_rewards: one list of rewards per group (the group's trajectories' rewards), any sizes ≥ 1.
        min_reward_std: threshold ≥ 0 (the seed's ``degenerate_group_filter.min_reward_std``, 0.1).

    Returns:
        degenerate: one bool per group.
        metrics: ``degenerate_group_ratio`` (fraction of groups, 0 when there are none),
            ``singleton_group_ratio``, ``num_groups``.
    """
    if not min_reward_std >= 0.0:
        raise ValueError(f"min_reward_std must be >= 0, got {min_reward_std}")
    flags: list[bool] = []
    singletons = 0
    for i, rewards in enumerate(group_rewards):
        if len(rewards) == 0:
            raise ValueError(f"group {i} has no rewards; every group needs at least one trajectory")
        if not all(math.isfinite(r) for r in rewards):
            raise ValueError(f"group {i} has a non-finite reward {list(rewards)}; record reward failures on the "
                             "trajectory instead of returning NaN/inf")
        std = group_reward_std(rewards)
        singletons += len(rewards) == 1
        flags.append(len(rewards) < 2 or std <= min_reward_std)
    n = len(flags)
    metrics = {
        "degenerate_group_ratio": sum(flags) / n if n else 0.0,
        "singleton_group_ratio": singletons / n if n else 0.0,
        "num_groups": float(n),
    }
    return flags, metrics


def resample_or_drop(attempt: int, resample_attempts: int) -> Literal["resample", "drop"]:
    """What to do with a task whose group came out degenerate.

    ``attempt`` counts the resamples already made for this task (0 the first time its group is degenerate);
    a task is resampled while attempt < resample_attempts, so it is generated at most 1 + resample_attempts
    times (seed: 2 → three groups) and then dropped. resample_attempts = 0 drops at once (DAPO with a bounded
    number of generation batches, verl's ``max_num_gen_batches``, is the batch-level analogue).
    """
    if attempt < 0 or resample_attempts < 0:
        raise ValueError(f"attempt ({attempt}) and resample_attempts ({resample_attempts}) must be >= 0")
    return "resample" if attempt < resample_attempts else "drop"
