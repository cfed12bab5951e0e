import math

import pytest

from tether.pipeline.buffer import ReplayBuffer, diversity, freshness
from tether.pipeline.queue import QueuedGroup
from tether.types import Group, Trajectory


def rec(name: str, versions_per_traj, rewards, seq: int = 0, start_version: int = 0) -> QueuedGroup:
    trajs = [Trajectory(name, [1], list(range(len(vs))), [1] * len(vs), [0.0] * len(vs), list(vs), reward=r)
             for vs, r in zip(versions_per_traj, rewards)]
    return QueuedGroup(Group(name, trajs), seq, start_version)


def test_freshness_and_diversity_by_hand():
    assert [freshness(lag) for lag in (0, 1, 2, 3, -1)] == [1.0, 0.5, 1 / 3, 0.25, 1.0]
    g = lambda rewards: rec("g", [[0]] * len(rewards), rewards).group  # noqa: E731
    assert diversity(g([1, 1, 1, 1])) == 0.0  # degenerate
    assert diversity(g([1, 0, 1, 0])) == pytest.approx(1.0)  # even split
    assert diversity(g([1, 0, 0, 0])) == pytest.approx(math.sqrt(3) / 2)  # pstdev √3/4 over half-range 1/2
    assert diversity(g([0, 0.5, 1])) == pytest.approx(math.sqrt(1 / 6) / 0.5)  # 0.816497
    assert diversity(g([0, 0.01])) == pytest.approx(1.0)  # scale-free
    assert diversity(g([7])) == 0.0


def test_priorities_of_three_groups_and_eviction_order():
    buf = ReplayBuffer(capacity=2, type="priority", freshness_weight=0.7, diversity_weight=0.3, version=5)
    a = rec("a", [[5, 5]] * 4, [1, 0, 1, 0])  # lag 0, diversity 1 → 0.7·1 + 0.3·1 = 1.0
    b = rec("b", [[4]] * 4, [1, 1, 1, 1])  # lag 1, diversity 0 → 0.7·0.5 = 0.35
    c = rec("c", [[3, 4, 5]] * 4, [1, 0, 0, 0])  # lag 2 (oldest token), div √3/2 → 0.7/3 + 0.3·0.866025 = 0.493141
    assert [buf.priority(x) for x in (a, b, c)] == pytest.approx([1.0, 0.35, 0.493141], abs=1e-6)
    assert buf.add(a) == [] and buf.add(b) == []
    assert buf.add(c) == [b]  # lowest priority goes
    buf.on_version(7)
    # a: lag 2 → 0.7/3 + 0.3 = 0.533333; c: lag 4 → 0.7/5 + 0.259808 = 0.399808
    assert buf.priorities() == pytest.approx([0.533333, 0.399808], abs=1e-6)
    d = rec("d", [[7]] * 3, [0, 0.5, 1])  # lag 0, div 0.816497 → 0.7 + 0.244949 = 0.944949
    assert buf.add(d) == [c]
    m = buf.metrics()
    assert m["buffer/size"] == 2 and m["buffer/evicted"] == 2
    assert m["buffer/priority_mean"] == pytest.approx((0.533333 + 0.944949) / 2, abs=1e-6)
    stale = rec("s", [[0]] * 2, [1, 1])  # 0.7/8 = 0.0875: lower than all, evicted on arrival
    assert buf.add(stale) == [stale] and len(buf) == 2


def test_eviction_ties_go_oldest_first_and_tokenless_groups_use_start_version():
    buf = ReplayBuffer(capacity=2, freshness_weight=1.0, diversity_weight=0.0, version=3)
    e, f = rec("e", [[3]], [0]), rec("f", [[3]], [0])  # both 1.0
    tokenless = rec("n", [[]], [0], start_version=1)  # lag 3 - 1 = 2 → 1/3
    assert buf.priority(tokenless) == pytest.approx(1 / 3)
    buf.add(e), buf.add(f)
    assert buf.add(rec("g", [[3]], [0])) == [e]


def test_fifo_type_takes_and_evicts_oldest_inserted():
    buf = ReplayBuffer(capacity=2, type="fifo")
    a, b, c = (rec(x, [[0]], [0]) for x in "abc")
    buf.add(a), buf.add(b)
    assert buf.add(c) == [a]
    assert buf.take(5) == [b, c] and len(buf) == 0 and buf.take(1) == []
    assert buf.evicted == 1 and buf.evicted_samples == 1


def test_priority_takes_highest_first_and_the_rest_wait_and_age():
    buf = ReplayBuffer(capacity=4, freshness_weight=0.7, diversity_weight=0.3, version=2)
    x = rec("x", [[2]] * 2, [1, 0])  # lag 0, div 1: 0.7 + 0.3 = 1.0
    y = rec("y", [[1]] * 2, [1, 0])  # lag 1: 0.35 + 0.3 = 0.65
    z = rec("z", [[2]] * 2, [1, 1])  # lag 0, degenerate: 0.7
    for r in (y, x, z):
        buf.add(r)
    assert buf.take(2) == [x, z] and len(buf) == 1  # y waits
    buf.on_version(4)  # y ages: lag 3 → 0.7/4 + 0.3 = 0.475
    assert buf.priorities() == pytest.approx([0.475])
    assert buf.remove_stale(max_policy_lag=3) == [] and buf.remove_stale(max_policy_lag=2) == [y]
    assert len(buf) == 0 and buf.held_samples == 0


def test_zero_priority_only_when_nothing_else_is_left():
    buf = ReplayBuffer(capacity=4, freshness_weight=0.0, diversity_weight=1.0)
    deg1, div, deg2 = rec("d1", [[0]] * 2, [1, 1]), rec("v", [[0]] * 2, [1, 0]), rec("d2", [[0]] * 2, [0, 0])
    for r in (deg1, div, deg2):
        buf.add(r)
    assert buf.take(3) == [div, deg1, deg2]
    assert buf.evicted_samples == 0
