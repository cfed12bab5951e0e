import math
import threading

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
    assert buf.sample(5) == [b, c] and len(buf) == 0 and buf.sample(1) == []


def test_sampling_is_proportional_to_priority_and_seeded():
    x, y = rec("x", [[2]], [0]), rec("y", [[0]], [0])  # at version 2: priorities 1 and 1/3 → P(x first) = 0.75
    buf = ReplayBuffer(capacity=4, freshness_weight=1.0, diversity_weight=0.0, seed=123, version=2)
    firsts = []
    for _ in range(4000):
        buf.add(x), buf.add(y)
        firsts.append(buf.sample(1)[0] is x)
        buf.sample(1)
    assert abs(sum(firsts) - 3000) < 120  # σ = √(4000·0.75·0.25) = 27.4

    def draws(seed):
        b = ReplayBuffer(capacity=8, seed=seed, version=2)
        for i in range(6):
            b.add(rec(f"r{i}", [[i % 3]] * 2, [i % 2, 0]))
        return [r.group.task_id for r in b.sample(4)]

    assert draws(7) == draws(7)


def test_zero_priority_only_when_nothing_else_is_left():
    buf = ReplayBuffer(capacity=4, freshness_weight=0.0, diversity_weight=1.0)
    deg1, div, deg2 = rec("d1", [[0]] * 2, [1, 1]), rec("v", [[0]] * 2, [1, 0]), rec("d2", [[0]] * 2, [0, 0])
    for r in (deg1, div, deg2):
        buf.add(r)
    assert buf.sample(3) == [div, deg1, deg2]


def test_wait_sample_blocks_until_enough_and_close():
    buf = ReplayBuffer(capacity=4)
    buf.add(rec("a", [[0]], [0]))
    assert buf.wait_sample(2, timeout=0.02) is None and len(buf) == 1  # nothing taken on timeout
    threading.Timer(0.05, buf.add, args=(rec("b", [[0]], [0]),)).start()
    got = buf.wait_sample(2, timeout=5)
    assert sorted(r.group.task_id for r in got) == ["a", "b"]
    threading.Timer(0.05, buf.close).start()
    assert buf.wait_sample(1, timeout=5) is None
    with pytest.raises(ValueError, match="capacity"):
        buf.wait_sample(5)
