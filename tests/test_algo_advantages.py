import pytest
import torch

from tether.algo import broadcast_to_tokens, group_advantages


def approx(t, expected, tol=1e-5):
    expected = torch.tensor(expected, dtype=torch.float64)
    return torch.allclose(torch.as_tensor(t, dtype=torch.float64), expected, atol=tol)


def test_grpo_group_normalisation_and_identical_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv, m = group_advantages(rewards, group_sizes=[4, 4], normalization="group")
    # group 1: mean 0.5, Bessel std = sqrt(4 * 0.25 / 3) = 0.577350 → A = ±0.5 / 0.577350 = ±0.866025
    # group 2: all equal → exactly 0
    assert approx(adv, [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0])
    assert (adv[4:] == 0).all()
    # advantage_std: Σ A² = 4 * 0.75 = 3, / (8 - 1) = 0.428571, sqrt = 0.654654
    assert approx(m["advantage_std"], 0.654654)
    assert approx(m["degenerate_group_ratio"], 0.5)  # 1 of 2 groups has std 0
    assert approx(m["singleton_group_ratio"], 0.0)
    assert m["num_groups"].item() == 2


def test_group_ids_any_order_equals_contiguous_sizes():
    rewards = torch.tensor([2.0, 0.0, 4.0, 1.0])
    adv, _ = group_advantages(rewards, torch.tensor([7, 3, 7, 3]), normalization="group")
    # group 7 = [2, 4]: mean 3, std = sqrt((1 + 1) / 1) = 1.414214 → [-0.707107, +0.707107]
    # group 3 = [0, 1]: mean 0.5, std = sqrt(0.5 / 1) = 0.707107 → [-0.707107, +0.707107]
    assert approx(adv, [-0.707107, -0.707107, 0.707107, 0.707107])
    adv2, _ = group_advantages(torch.tensor([2.0, 4.0, 0.0, 1.0]), group_sizes=[2, 2], normalization="group")
    assert approx(adv2, [-0.707107, 0.707107, -0.707107, 0.707107])


def test_singleton_group_gets_zero_and_is_counted():
    rewards = torch.tensor([5.0, 0.0, 1.0, 2.0])
    for norm in ("group", "batch", "none"):
        adv, m = group_advantages(rewards, group_sizes=[1, 3], normalization=norm)
        assert torch.isfinite(adv).all()
        assert adv[0] == 0  # r − mean over a group of one is 0, whatever the normalisation
        assert approx(m["degenerate_group_ratio"], 0.5)
        assert approx(m["singleton_group_ratio"], 0.5)
    adv, _ = group_advantages(rewards, group_sizes=[1, 3], normalization="group")
    # group [0, 1, 2]: mean 1, std = sqrt((1 + 0 + 1) / 2) = 1 → A = [-1, 0, 1] / (1 + 1e-6)
    assert approx(adv, [0.0, -1.0, 0.0, 1.0])


def test_identical_rewards_are_exact_zeros_even_when_mean_rounds():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])  # 0.1 * 3 / 3 is not 0.1 in floating point
    for norm in ("group", "batch", "none"):
        adv, m = group_advantages(rewards, group_sizes=[3, 3], normalization=norm)
        assert (adv == 0).all(), norm
        assert approx(m["degenerate_group_ratio"], 1.0)
        assert m["advantage_std"].item() == 0


def test_batch_normalisation_uses_std_of_group_centred_rewards():
    rewards = torch.tensor([1.0, 0.0, 4.0, 2.0])
    adv, m = group_advantages(rewards, group_sizes=[2, 2], normalization="batch")
    # centred: [0.5, -0.5, 1, -1]; Bessel std over 4: sqrt((0.25 + 0.25 + 1 + 1) / 3) = sqrt(0.833333) = 0.912871
    # A = [0.547723, -0.547723, 1.095445, -1.095445]   (std of raw rewards, as TRL, would be 1.707825)
    assert approx(adv, [0.547723, -0.547723, 1.095445, -1.095445])
    assert approx(m["advantage_std"], 1.0)  # dividing by the batch std makes it 1 (up to eps)
    adv_g, _ = group_advantages(rewards, group_sizes=[2, 2], normalization="group")
    # group stds 0.707107 and 1.414214 → every advantage ±0.707107
    assert approx(adv_g, [0.707107, -0.707107, 0.707107, -0.707107])


def test_none_normalisation_is_dr_grpo_centring():
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 4.0, 2.0]), group_sizes=[2, 2], normalization="none")
    assert approx(adv, [0.5, -0.5, 1.0, -1.0], tol=0)


def test_min_std_threshold_counts_but_does_not_zero():
    rewards = torch.tensor([0.0, 0.1, 0.0, 1.0])
    adv, m = group_advantages(rewards, group_sizes=[2, 2], normalization="group", min_std=0.1)
    # group 1 std = sqrt(2 * 0.05² / 1) = 0.070711 ≤ 0.1 → degenerate; group 2 std = 0.707107 → not
    assert approx(m["degenerate_group_ratio"], 0.5)
    # its advantages are still computed: ±0.05 / 0.070711 = ±0.707107
    assert approx(adv, [-0.707107, 0.707107, -0.707107, 0.707107], tol=1e-4)


def test_dtype_and_errors():
    adv, _ = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), group_sizes=[2], normalization="group")
    assert adv.dtype == torch.bfloat16
    r = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="exactly one"):
        group_advantages(r, normalization="group")
    with pytest.raises(ValueError, match="exactly one"):
        group_advantages(r, torch.tensor([0, 0]), group_sizes=[2], normalization="group")
    with pytest.raises(ValueError, match="sum to N"):
        group_advantages(r, group_sizes=[3], normalization="group")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), group_sizes=[2], normalization="group")
    with pytest.raises(ValueError, match="normalization"):
        group_advantages(r, group_sizes=[2], normalization="std")


def test_broadcast_to_tokens():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert torch.equal(broadcast_to_tokens(adv, mask), torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
