import random

import pytest

from tether.algo import TaskRewardWindow, allocate_rollouts, gradient_variance_proxy


def alloc(proxies, base=8, hi=32, budget=None, lo=2):
    return allocate_rollouts(proxies, base_rollouts_per_prompt=base, max_rollouts_per_prompt=hi,
                             total_budget=budget, min_per_task=lo)


def test_gradient_variance_proxy():
    assert gradient_variance_proxy([1, 0, 0, 0]) == pytest.approx(0.1875)  # p = 0.25: p(1 − p)
    assert gradient_variance_proxy([0.5, 1.0]) == pytest.approx(0.0625)  # mean 0.75, (0.0625 + 0.0625) / 2
    assert gradient_variance_proxy([1, 1, 1]) == 0.0 and gradient_variance_proxy([1]) == 0.0


def test_allocation_hand_computed():
    counts, m = alloc([0.25, 0.09, 0.0, None])
    # budget 4 · 8 = 32; the unseen task gets 8 → 24 for the seen three. √v = [0.5, 0.3, 0]: the solved/failed
    # task sits at the minimum 2, the other two share 22: λ = 22 / 0.8 = 27.5 → [13.75, 8.25]
    # floors [13, 8, 2] = 23, one unit left → largest remainder (0.75) → [14, 8, 2]
    assert counts == [14, 8, 2, 8]
    assert m["allocation_min"] == 2 and m["allocation_max"] == 14 and m["allocation_mean"] == 8
    assert m["allocation_unused_budget"] == 0 and m["allocation_zero_proxy_fraction"] == pytest.approx(1 / 3)


def test_upper_and_lower_bounds_bind():
    # √v = [0.5, 0.1, 0.1], budget 24, max 12: λ = 24 / 0.7 = 34.29 → 17.1 > 12, capped;
    # the other two share 12: λ = 12 / 0.2 = 60 → [6, 6]
    assert alloc([0.25, 0.01, 0.01], hi=12, budget=24)[0] == [12, 6, 6]
    # √v = [0.5, 0.01], budget 16: λ = 16 / 0.51 → 0.31 < 2 → raised to 2; the other takes 14
    assert alloc([0.25, 0.0001], budget=16)[0] == [14, 2]


def test_ties_round_by_task_order():
    # three equal tasks, budget 10: 3.333 each → floors 9, the unit goes to the first
    assert alloc([0.04, 0.04, 0.04], base=3, budget=10)[0] == [4, 3, 3]


def test_surplus_goes_to_zero_proxy_tasks_only_when_informative_ones_are_full():
    # one informative task at max 10, the other 14 of the budget 24 spread evenly over the two solved tasks
    assert alloc([0.0, 0.0, 0.25], hi=10, budget=24)[0] == [7, 7, 10]
    assert alloc([0.0, 0.0], budget=16)[0] == [8, 8]  # nothing informative: the base, as the fixed strategy
    counts, m = alloc([0.25, 0.25], hi=10, budget=30)  # more than every task's max: the rest is unused
    assert counts == [10, 10] and m["allocation_unused_budget"] == 10


def test_budget_is_conserved_within_bounds_and_deterministic():
    rng = random.Random(0)
    for _trial in range(50):
        n = rng.randint(1, 12)
        proxies = [None if rng.random() < 0.2 else rng.choice([0.0, rng.random() * 0.25]) for _ in range(n)]
        seen = sum(p is not None for p in proxies)
        budget = 8 * (n - seen) + rng.randint(2 * seen, 32 * seen)
        counts, _ = alloc(proxies, budget=budget)
        assert sum(counts) == budget, (proxies, budget, counts)
        assert all(2 <= c <= 32 for c in counts)
        assert all(c == 8 for c, p in zip(counts, proxies) if p is None)
        assert alloc(proxies, budget=budget)[0] == counts


def test_validation():
    with pytest.raises(ValueError, match="below the minimum"):
        alloc([0.25, 0.25, None], budget=11)  # needs 8 + 2 + 2 = 12
    with pytest.raises(ValueError, match="min_per_task must be >= 2"):
        alloc([0.25], lo=1)
    with pytest.raises(ValueError, match="base_rollouts_per_prompt"):
        alloc([0.25], base=40)
    with pytest.raises(ValueError, match="proxies"):
        alloc([-0.1])


def test_task_reward_window():
    w = TaskRewardWindow(window=4)
    w.update("a", [1.0, 0.0])
    assert w.proxy("a") == pytest.approx(0.25)  # p = 0.5
    w.update("a", [1.0, 1.0, 1.0])  # window keeps the last 4: [0, 1, 1, 1] → p = 0.75 → 0.1875
    assert w.proxy("a") == pytest.approx(0.1875)
    w.update("b", [1.0])  # one reward: no statistic yet
    assert w.proxies(["a", "b", "c"]) == [pytest.approx(0.1875), None, None]
    counts, _ = alloc(w.proxies(["a", "b", "c"]), budget=24)
    assert counts == [8, 8, 8]  # b and c unseen → base; a takes the rest
    with pytest.raises(ValueError, match="finite"):
        w.update("a", [float("inf")])
