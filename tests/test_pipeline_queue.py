import random
import threading
import time

import pytest

from tether.config import load_config
from tether.config.plan import Plan
from tether.pipeline.queue import MessageQueue, QueuedGroup
from tether.pipeline.staleness import stale_filter
from tether.types import Group, Trajectory


def group(n_traj: int, version: int = 0, task: str = "t") -> Group:
    return Group(task, [Trajectory(task, [1], [5, 6], [1, 0], [0.0, 0.0], [version, -1]) for _ in range(n_traj)])


def qg(seq: int, n_traj: int = 1, version: int = 0) -> QueuedGroup:
    return QueuedGroup(group(n_traj, version, f"task{seq}"), seq, version)


def oldest_unconsumed(q: MessageQueue) -> int:
    """The start of the queue's window: the oldest start position neither taken, dropped nor abandoned."""
    return q._order.oldest_unconsumed


def test_drop_oldest_at_capacity_by_hand():
    q = MessageQueue(max_size=2)
    q.put(qg(0, 2))
    q.put(qg(1, 3))
    assert (len(q), q.queued_samples, q.dropped_samples) == (2, 5, 0)
    q.put(qg(2, 1))  # full: seq 0 (2 trajectories) goes
    assert (len(q), q.queued_samples, q.dropped_samples, q.dropped_groups) == (2, 4, 2, 1)
    assert q.total_produced == 6
    assert [g.seq for g in q.get_batch(2, timeout=0)] == [1, 2]
    assert q.total_consumed == 4
    q.check_accounting()  # 6 = 4 consumed + 2 dropped + 0 stale + 0 queued
    assert q.metrics() == {"queue/total_produced": 6.0, "queue/total_consumed": 4.0, "queue/dropped_samples": 2.0,
                           "queue/stale_samples": 0.0, "queue/size": 0.0, "queue/queued_samples": 0.0}


def test_a_straggler_older_than_everything_queued_is_the_one_dropped():
    q = MessageQueue(max_size=2, window_size=8)
    q.put(qg(5))
    q.put(qg(6))
    q.put(qg(3, 4))  # oldest start → dropped on arrival; its position is retired
    assert sorted(g.seq for g in q.get_batch(2, timeout=0)) == [5, 6]
    assert q.dropped_samples == 4 and oldest_unconsumed(q) == 0  # 0, 1, 2, 4 never came


def test_bare_groups_are_numbered_in_arrival_order():
    q = MessageQueue(max_size=2)
    for v in (3, 4, 5):
        q.put(group(1, v))
    got = q.get_batch(2, timeout=0)
    assert [(g.seq, g.start_version) for g in got] == [(1, 4), (2, 5)]  # seq 0 dropped
    with pytest.raises(ValueError, match="both"):
        q.put(qg(7))


def test_windowed_get_batch_waits_for_the_straggler():
    q = MessageQueue(max_size=16, window_size=4)
    for s in [0, 1, 2, 4, 5, 6, 7, 8, 9]:  # 3 is still running
        q.put(qg(s))
    assert [g.seq for g in q.get_batch(2, timeout=0)] == [0, 1]
    assert [g.seq for g in q.get_batch(2, timeout=0)] == [2, 4]
    assert [g.seq for g in q.get_batch(2, timeout=0)] == [5, 6]  # window [3, 7)
    assert q.get_batch(2, timeout=0.05) is None  # 7, 8, 9 are outside [3, 7)
    threading.Timer(0.05, q.put, args=(qg(3),)).start()
    t = time.monotonic()
    assert [g.seq for g in q.get_batch(2, timeout=5)] == [3, 7]
    assert time.monotonic() - t < 2
    assert [g.seq for g in q.get_batch(2, timeout=0)] == [8, 9]


class Clock:
    """A hand-moved clock for ``MessageQueue(clock=...)``: hold times by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put_at(q: MessageQueue, clock: Clock, seq: int, now: float) -> None:
    """Put group ``seq`` at time ``now``: the hold counts from the put."""
    clock.now = now
    q.put(qg(seq))


def test_max_hold_s_lets_a_held_group_pass_the_window_by_hand():
    clock = Clock()
    q = MessageQueue(max_size=16, window_size=4, max_hold_s=1.0, clock=clock)
    for s, finished in [(0, 0.0), (1, 0.0), (2, 0.0), (7, 0.2), (8, 0.6), (9, 0.9)]:  # 3 is still running
        put_at(q, clock, s, finished)
    assert [g.seq for g in q.get_batch(3, timeout=0)] == [0, 1, 2]  # window [3, 7) now
    clock.now = 1.1  # 7 has waited 0.9 s: held
    assert q.get_batch(1, timeout=0) is None
    clock.now = 1.2  # 7 has waited 1.0 s: it passes; 8 (0.6 s) and 9 (0.3 s) are still held
    assert [g.seq for g in q.get_available()] == [7]
    assert oldest_unconsumed(q) == 3  # the window did not move: 3 is still the oldest unconsumed
    put_at(q, clock, 3, 1.6)  # the straggler: the oldest, taken at once
    assert [g.seq for g in q.get_batch(1, timeout=0)] == [8]  # 8 finished first (at 0.6) and has waited 1.0 s
    assert [g.seq for g in q.get_batch(1, timeout=0)] == [3]
    assert oldest_unconsumed(q) == 4  # 4, 5, 6 have not finished: window [4, 8), 9 is held again
    assert q.get_available() == []
    clock.now = 2.0  # 9 has waited 1.1 s
    assert [g.seq for g in q.get_batch(1, timeout=0)] == [9]
    q.check_accounting()


def test_max_hold_s_none_holds_until_the_window_reaches_it_and_fifo_ignores_it():
    clock = Clock()
    strict = MessageQueue(max_size=16, window_size=2, max_hold_s=None, clock=clock)
    put_at(strict, clock, 5, 0.0)
    clock.now = 1e6
    assert strict.get_available() == []  # window [0, 2): 5 waits for 0..3 however long
    assert MessageQueue(max_size=4, window_size=None, max_hold_s=1.0).max_hold_s is None  # fifo holds nothing
    with pytest.raises(ValueError, match="max_hold_s"):
        MessageQueue(max_size=4, window_size=2, max_hold_s=-1.0)


@pytest.mark.parametrize("value, expected", [("null", None), ("0.5", [7, 8]), ("0.7", None), (None, [7, 8])])
def test_rollout_scheduler_max_hold_s_decides_whether_held_groups_pass_the_window(value, expected):
    # the flip test of rollout.scheduler.max_hold_s: the config's queue (Plan → AsyncSource's make_queue arguments);
    # None: the key left at its default, 0.25 s
    hold = [] if value is None else [f"rollout.scheduler.max_hold_s={value}"]
    plan = Plan.of(load_config([], ["rollout.mode=fully_async", "rollout.scheduler.window_size=4", *hold]))
    clock = Clock()
    q = MessageQueue(plan.queue_size, plan.window_size, plan.max_hold_s, clock=clock)
    for s in (0, 1, 2, 7, 8):  # 3 is still running: window [3, 7) after 0, 1, 2
        put_at(q, clock, s, 0.0)
    assert [g.seq for g in q.get_batch(3, timeout=0)] == [0, 1, 2]
    clock.now = 0.6
    got = q.get_batch(2, timeout=0)  # 7 and 8 have waited 0.6 s
    assert (got if got is None else [g.seq for g in got]) == expected


def test_a_blocked_get_batch_wakes_when_a_held_group_comes_due():
    q = MessageQueue(max_size=8, window_size=2, max_hold_s=0.1)
    q.put(qg(0))
    q.put(qg(5))  # outside the window [0, 2); finished now, due in 0.1 s; nothing else will arrive
    t = time.monotonic()
    assert [g.seq for g in q.get_batch(2, timeout=5)] == [0, 5]
    assert 0.09 <= time.monotonic() - t < 2


def test_abandon_moves_the_window():
    q = MessageQueue(max_size=8, window_size=2)
    q.put(qg(1))
    q.put(qg(2))
    assert q.get_batch(2, timeout=0) is None  # window [0, 2) holds only 1
    q.abandon(0)  # episode 0 failed: window [1, 3)
    assert [g.seq for g in q.get_batch(2, timeout=0)] == [1, 2]
    with pytest.raises(ValueError, match="twice"):
        q.put(qg(1))


def test_close_wakes_a_waiter_and_bad_batch_size():
    q = MessageQueue(max_size=4)
    q.put(qg(0))
    threading.Timer(0.05, q.close).start()
    t = time.monotonic()
    assert q.get_batch(2, timeout=5) is None
    assert time.monotonic() - t < 2
    assert [g.seq for g in q.get_batch(1, timeout=0)] == [0]  # what is ready is still served after close
    assert q.put(qg(1)) is False and q.total_produced == 1
    with pytest.raises(ValueError, match="max_queue_size"):
        q.get_batch(5)


def test_a_waiting_consumer_is_woken_by_a_producer_thread():
    q = MessageQueue(max_size=4)
    threading.Timer(0.05, lambda: [q.put(qg(0)), q.put(qg(1))]).start()
    t = time.monotonic()
    got = q.get_batch(2, timeout=5)
    assert [g.seq for g in got] == [0, 1] and time.monotonic() - t < 2
    assert q.get_batch(1, timeout=0.05) is None


def test_report_stale_and_broken_accounting():
    q = MessageQueue(max_size=4)
    q.put(qg(0, 2, version=0))
    q.put(qg(1, 3, version=2))
    batch = q.get_batch(2, timeout=0)
    kept, dropped = stale_filter(batch, current_version=3, max_policy_lag=1)  # lags 3 and 1
    assert [g.seq for g in kept] == [1] and [g.seq for g in dropped] == [0]
    q.report_stale(dropped)
    assert (q.total_consumed, q.stale_samples) == (3, 2)
    q.check_accounting()
    with pytest.raises(ValueError, match="report_stale"):
        q.report_stale(kept + kept)
    q._dropped += 1  # simulate a bug
    with pytest.raises(AssertionError, match=r"produced 5 != consumed 3 \+ dropped 1 \+ stale 2 \+ queued 0"):
        q.check_accounting()


@pytest.mark.parametrize("window", [None, 3])
def test_accounting_invariant_under_4_producers_and_1_consumer(window):
    q = MessageQueue(max_size=6, window_size=window)
    seq_lock, next_seq = threading.Lock(), [0]
    per_producer = 150

    def produce(pid):
        rng = random.Random(pid)
        for _ in range(per_producer):
            with seq_lock:  # start: take a start position
                seq = next_seq[0]
                next_seq[0] += 1
            if rng.random() < 0.3:
                time.sleep(0)  # let others overtake
            if rng.random() < 0.05:
                q.abandon(seq)  # failed episode
            else:
                q.put(qg(seq, rng.randint(1, 4), version=seq % 3))

    producers = [threading.Thread(target=produce, args=(i,)) for i in range(4)]
    seen, violations = [], []

    def consume():
        while True:
            batch = q.get_batch(2, timeout=0.01)
            if batch is None:
                if q.closed:
                    break
                continue
            kept, dropped = stale_filter(batch, current_version=2, max_policy_lag=1)  # version 0 is stale
            q.report_stale(dropped)
            seen.extend(g.seq for g in batch)
            time.sleep(0.0005)  # a trainer slower than 4 producers: the queue overflows
            try:
                q.check_accounting()
            except AssertionError as e:
                violations.append(str(e))
        rest = q.get_batch(1, timeout=0)
        while rest:
            seen.extend(g.seq for g in rest)
            rest = q.get_batch(1, timeout=0)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    q.close()
    consumer.join(timeout=10)
    assert not consumer.is_alive() and not violations
    q.check_accounting()
    assert len(q) == 0 and q.queued_samples == 0
    assert len(seen) == len(set(seen))  # nothing served twice
    assert q.total_produced == q.total_consumed + q.dropped_samples + q.stale_samples
    assert q.dropped_groups > 0 and q.stale_samples > 0  # both paths exercised
    assert oldest_unconsumed(q) == 4 * per_producer  # every start position retired exactly once


@pytest.mark.parametrize("hold", [None, 0.05])
def test_fully_async_trainer_takes_past_a_straggler_that_holds_the_window_after_max_hold_s(hold):
    # the async source end to end: 2 groups a step, window 2, admission 3 steps ahead (6 groups, seq 0..5 at once);
    # group (step 1, index 0) = seq 0 runs 1.5 s, the others 0.01 s. Window [0, 2): only seq 1 is in it.
    import asyncio

    from conftest import batch_source
    from tether.config import RunConfig
    from tether.pipeline.shaping import Produced
    from tether.pipeline.weights import WeightSync
    from tether.types import Task

    class Straggler:
        async def produce(self, task, size, step, index):
            await asyncio.sleep(1.5 if (step, index) == (1, 0) else 0.01)
            return Produced(group(size, 0, task.id), step, index)

    cfg = RunConfig.model_validate({
        "learner": {"batch_size": 8, "mini_batch_size": 8, "gradient_accumulation_steps": 1},
        "policy_optimization": {"advantage": {"group_size": 4}}, "buffer": {"type": "fifo"},
        "trainer": {"trigger_parameter_sync_step": 1},
        "rollout": {"mode": "fully_async", "worker": {"max_concurrent_tasks": 64},
                    "scheduler": {"max_staleness": 2, "window_size": 2, "max_hold_s": hold}}})
    source = batch_source(cfg, Straggler(), lambda step: [Task(f"s{step}k{k}", "train", "k") for k in range(2)],
                          WeightSync(None, None, 1), start_step=0, sizes=lambda ts: [4] * len(ts))
    try:
        t = time.monotonic()
        first = [(p.step, p.index) for p in source.next_batch(1).produced]
        waited = time.monotonic() - t
        if hold is None:  # strictly bounded reordering: seq 2.. wait for the straggler, and so does the trainer
            assert first == [(1, 0), (1, 1)] and waited >= 1.0
        else:  # seq 2 (finished first outside the window) passes after 0.05 s
            assert first == [(1, 1), (2, 0)] and waited < 1.0
            assert source.state_dict()["ledger"] == {"frontier": 0, "beyond": {"1": [1], "2": [0]}}
        # the versions never move, so admission allows these 6 groups only: the next two batches take the rest,
        # the straggler included, and each group is settled exactly once
        rest = [(p.step, p.index) for s in (2, 3) for p in source.next_batch(s).produced]
        assert sorted(first + rest) == [(s, k) for s in (1, 2, 3) for k in (0, 1)]
        assert source.state_dict()["ledger"] == {"frontier": 3, "beyond": {}}
        source.check_accounting()
    finally:
        source.close()


@pytest.mark.parametrize("streamed", [False, True])
def test_fully_async_hands_each_group_over_as_soon_as_it_may_be_taken(streamed):
    # learner.overlap_rollout in the async modes: next_batch's on_group hears of each group as it is taken, one by one,
    # instead of the take waiting for the whole mini-batch. 2 groups a step, one take of 2; staleness 0 and a version
    # that never moves: only seq 0 (step 1, index 0: 0.05 s) and seq 1 (index 1: 0.6 s) ever start.
    import asyncio

    from conftest import batch_source
    from tether.config import RunConfig
    from tether.pipeline.shaping import Produced
    from tether.pipeline.weights import WeightSync
    from tether.types import Task

    class Slow:
        async def produce(self, task, size, step, index):
            await asyncio.sleep(0.05 if index == 0 else 0.6)
            return Produced(group(size, 0, task.id), step, index)

    cfg = RunConfig.model_validate({
        "learner": {"batch_size": 8, "mini_batch_size": 8, "gradient_accumulation_steps": 1},
        "policy_optimization": {"advantage": {"group_size": 4}}, "buffer": {"type": "fifo"},
        "trainer": {"trigger_parameter_sync_step": 1},
        "rollout": {"mode": "fully_async", "scheduler": {"max_staleness": 0}}})
    source = batch_source(cfg, Slow(), lambda step: [Task(f"s{step}k{k}", "train", "k") for k in range(2)],
                          WeightSync(None, None, 1), start_step=0, sizes=lambda ts: [4] * len(ts))
    heard: list[tuple[int, float]] = []
    try:
        t = time.monotonic()
        batch = source.next_batch(1, on_group=(lambda p: heard.append((p.index, time.monotonic() - t)))
                                  if streamed else None)
        waited = time.monotonic() - t
        assert [(p.step, p.index) for p in batch.produced] == [(1, 0), (1, 1)]  # the same batch, in start order
        assert waited >= 0.55
        if streamed:  # index 0 handed over ~0.55 s before index 1 finished
            assert [k for k, _ in heard] == [0, 1] and heard[0][1] < 0.4 <= heard[1][1]
        else:
            assert heard == []
        source.check_accounting()
    finally:
        source.close()


def test_a_group_dropped_as_stale_gives_its_admission_place_back():
    # staleness 0, 2 groups a step: 2 places. The run resumes at step 10 (version 10); group (11, 0) comes back with
    # tokens of version 0 (lag 10 > max_policy_lag 1) and is dropped at consumption. Its place comes back (as a failed
    # group's does), so (12, 0) may start and completes the batch; kept, both places would stay taken for good and the
    # batch could never fill.
    import asyncio

    from conftest import batch_source
    from tether.config import RunConfig
    from tether.pipeline.shaping import Produced
    from tether.pipeline.weights import WeightSync
    from tether.types import Task

    class OneStale:
        async def produce(self, task, size, step, index):
            await asyncio.sleep(0.01)
            return Produced(group(size, 0 if (step, index) == (11, 0) else 10, task.id), step, index)

    cfg = RunConfig.model_validate({
        "learner": {"batch_size": 8, "mini_batch_size": 8, "gradient_accumulation_steps": 1},
        "policy_optimization": {"advantage": {"group_size": 4}}, "buffer": {"type": "fifo",
                                                                            "stale_filter": {"max_policy_lag": 1}},
        "trainer": {"trigger_parameter_sync_step": 1},
        "rollout": {"mode": "fully_async", "scheduler": {"max_staleness": 0}}})
    source = batch_source(cfg, OneStale(), lambda step: [Task(f"s{step}k{k}", "train", "k") for k in range(2)],
                          WeightSync(None, None, 1, start_step=10), start_step=10, sizes=lambda ts: [4] * len(ts))
    try:
        batch = source.next_batch(11)
        assert sorted((p.step, p.index) for p in batch.produced) == [(11, 1), (12, 0)]
        a = source.accounting()
        assert a["queue/stale_samples"] == 4 and a["queue/total_consumed"] == 8  # one group of 4 dropped, 2 trained
        source.check_accounting()
    finally:
        source.close()
