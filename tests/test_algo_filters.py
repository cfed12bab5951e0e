import math

import pytest
import torch

from tether.algo import degenerate_groups, group_advantages, group_reward_std, resample_or_drop

GROUPS = [
    [1.0, 0.0, 1.0, 0.0],  # mean 0.5, Σ(r − m)² = 4 · 0.25 = 1, sample std √(1/3) = 0.577350
    [1.0, 1.0, 1.0, 1.0],  # all equal: std exactly 0
    [0.5, 0.5, 0.5, 0.6],  # mean 0.525, Σ = 3 · 0.000625 + 0.005625 = 0.0075, std √(0.0075/3) = 0.05
    [0.7],  # singleton
]


def test_group_reward_std_is_the_sample_std():
    assert group_reward_std(GROUPS[0]) == pytest.approx(math.sqrt(1 / 3))
    assert group_reward_std(GROUPS[1]) == 0.0
    assert group_reward_std(GROUPS[2]) == pytest.approx(0.05)  # population std would be √(0.0075/4) = 0.0433
    assert math.isnan(group_reward_std(GROUPS[3]))
    assert group_reward_std([1.0, 2.0, 3.0]) == 1.0  # Σ = 1 + 0 + 1 = 2, / (3 − 1) = 1


def test_degenerate_groups_hand_computed():
    flags, m = degenerate_groups(GROUPS, min_reward_std=0.1)
    assert flags == [False, True, True, True]  # 0.577 > 0.1; 0 ≤ 0.1; 0.05 ≤ 0.1; singleton
    assert m == {"degenerate_group_ratio": 0.75, "singleton_group_ratio": 0.25, "num_groups": 4.0}
    flags, m = degenerate_groups(GROUPS, min_reward_std=0.0)  # DAPO's rule: only all-equal (and singletons)
    assert flags == [False, True, False, True] and m["degenerate_group_ratio"] == 0.5


def test_std_exactly_at_the_threshold_is_degenerate():
    assert degenerate_groups([[1.0, 2.0, 3.0]], min_reward_std=1.0)[0] == [True]  # std 1 ≤ 1
    assert degenerate_groups([[1.0, 2.0, 3.0]], min_reward_std=0.999)[0] == [False]


def test_agrees_with_the_advantage_metric():
    rewards = torch.tensor([r for g in GROUPS for r in g], dtype=torch.float64)
    _, m = group_advantages(rewards, group_sizes=[len(g) for g in GROUPS], normalization="group", min_std=0.1)
    flags, _ = degenerate_groups(GROUPS, min_reward_std=0.1)
    assert m["degenerate_group_ratio"].item() == sum(flags) / len(flags) == 0.75


def test_validation_and_empty_batch():
    assert degenerate_groups([], min_reward_std=0.1) == ([], {"degenerate_group_ratio": 0.0,
                                                             "singleton_group_ratio": 0.0, "num_groups": 0.0})
    with pytest.raises(ValueError, match="group 1 has no rewards"):
        degenerate_groups([[1.0, 0.0], []], min_reward_std=0.1)
    with pytest.raises(ValueError, match="non-finite"):
        degenerate_groups([[1.0, float("nan")]], min_reward_std=0.1)
    with pytest.raises(ValueError, match="min_reward_std"):
        degenerate_groups(GROUPS, min_reward_std=-0.1)


def test_resample_or_drop():
    # seed resample_attempts = 2: degenerate at attempts 0 and 1 → resample, at 2 → drop (3 groups generated)
    assert [resample_or_drop(a, 2) for a in range(4)] == ["resample", "resample", "drop", "drop"]
    assert resample_or_drop(0, 0) == "drop"
    with pytest.raises(ValueError, match="must be >= 0"):
        resample_or_drop(-1, 2)
