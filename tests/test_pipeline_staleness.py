import asyncio
import threading
import time

import pytest

from tether.pipeline.queue import MessageQueue, QueuedGroup
from tether.pipeline.staleness import (
    AdmissionController,
    mask_older_segments,
    policy_lag,
    stale_filter,
    version_lag_stats,
)
from tether.types import Group, Trajectory


def traj(versions, mask=None, reward=0.0):
    mask = mask if mask is not None else [1] * len(versions)
    return Trajectory("t", [1], list(range(len(versions))), mask, [0.0] * len(versions), versions, reward=reward)


def starts_allowed(adm: AdmissionController) -> int:
    n = 0
    while adm.try_start() is not None:
        n += 1
    return n


@pytest.mark.parametrize("eta, per_version", [
    (0, [2, 2, 2]),  # (v + 1) · 2 in total: 2, 4, 6 — the sync schedule
    (1, [4, 2, 2]),  # (v + 2) · 2: 4, 6, 8
    (4, [10, 2, 2]),  # (v + 5) · 2: 10, 12, 14
])
def test_admission_counts_per_version(eta, per_version):
    adm = AdmissionController(max_staleness=eta, groups_per_step=2)
    got = []
    for v in range(3):
        adm.on_version(v)
        got.append(starts_allowed(adm))
        assert adm.capacity == 0
    assert got == per_version and adm.started == sum(per_version)


def test_seq_numbers_release_and_close():
    adm = AdmissionController(max_staleness=0, groups_per_step=2)
    assert adm.capacity == 2
    assert [adm.try_start(), adm.try_start(), adm.try_start()] == [0, 1, None]
    adm.release()  # seq 1 failed: its slot comes back, under a new position
    assert adm.try_start() == 2 and adm.try_start() is None
    with pytest.raises(ValueError):
        adm.on_version(-1)
    with pytest.raises(ValueError):
        adm.release(5)
    adm.close()
    adm.on_version(3)
    assert adm.try_start() is None and adm.capacity == 0


def test_resumed_controller_counts_from_its_initial_version():
    adm = AdmissionController(max_staleness=1, groups_per_step=3, initial_version=7)
    assert starts_allowed(adm) == 6  # (7 - 7 + 1 + 1) · 3


def wait_to_start(adm: AdmissionController, timeout: float) -> int | None:
    """``wait_to_start_async`` from a plain thread (its own event loop, as a rollout worker's)."""
    return asyncio.run(adm.wait_to_start_async(timeout=timeout))


def test_wait_to_start_blocks_until_the_next_version():
    adm = AdmissionController(max_staleness=0, groups_per_step=1)
    assert wait_to_start(adm, timeout=0) == 0
    assert wait_to_start(adm, timeout=0.05) is None
    threading.Timer(0.05, adm.on_version, args=(1,)).start()
    t = time.monotonic()
    assert wait_to_start(adm, timeout=5) == 1
    assert time.monotonic() - t < 2
    threading.Timer(0.05, adm.close).start()
    assert wait_to_start(adm, timeout=5) is None


def test_wait_to_start_async_does_not_block_the_loop():
    adm = AdmissionController(max_staleness=0, groups_per_step=1)
    adm.try_start()

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick = asyncio.create_task(ticker())
        threading.Timer(0.1, adm.on_version, args=(1,)).start()
        seq = await adm.wait_to_start_async(timeout=5)
        tick.cancel()
        timed_out = await adm.wait_to_start_async(timeout=0.02)
        return seq, ticks, timed_out

    seq, ticks, timed_out = asyncio.run(main())
    assert seq == 1 and ticks >= 5 and timed_out is None  # the loop kept running while it waited


def simulate(eta: int, B: int, steps: int) -> list[tuple[list[int], list[int]]]:
    """Greedy rollouter + trainer without threads: per step, the (seqs, lags) of the batch trained."""
    adm, q = AdmissionController(eta, B), MessageQueue(max_size=64, window_size=1)
    out = []
    for v in range(steps):
        while (seq := adm.try_start()) is not None:
            q.put(QueuedGroup(Group(f"t{seq}", [traj([v, v])]), seq, v))
        batch = q.get_batch(B, timeout=0)
        out.append(([g.seq for g in batch], [policy_lag(g.group, v) for g in batch]))
        adm.on_version(v + 1)
    return out


def test_staleness_bound_by_simulation():
    # eta 0: batch v is exactly the groups started for v, all at lag 0 (the sync schedule)
    assert simulate(0, 2, 3) == [([0, 1], [0, 0]), ([2, 3], [0, 0]), ([4, 5], [0, 0])]
    # eta 1: 4 start at version 0; from step 1 on every batch was started one version earlier
    assert simulate(1, 2, 3) == [([0, 1], [0, 0]), ([2, 3], [1, 1]), ([4, 5], [1, 1])]
    assert max(lag for _, lags in simulate(4, 2, 12) for lag in lags) == 4


def test_staleness_0_with_real_threads_reproduces_sync():
    B, steps = 3, 5
    adm, q = AdmissionController(max_staleness=0, groups_per_step=B), MessageQueue(max_size=8)

    def rollout_worker():
        while (seq := wait_to_start(adm, timeout=5)) is not None:
            v = adm.version
            q.put(QueuedGroup(Group(f"t{seq}", [traj([v, v, -1], [1, 1, 0])]), seq, v))

    workers = [threading.Thread(target=rollout_worker) for _ in range(4)]
    for w in workers:
        w.start()
    batches = []
    for v in range(steps):
        batch = q.get_batch(B, timeout=5)
        batches.append((sorted(g.seq for g in batch), {policy_lag(g.group, v) for g in batch}))
        adm.on_version(v + 1)
    adm.close()
    for w in workers:
        w.join(timeout=5)
    assert batches == [(list(range(v * B, (v + 1) * B)), {0}) for v in range(steps)]
    assert q.dropped_samples == 0


def test_stale_filter_with_mixed_versions():
    a = Group("a", [traj([5, 5, -1], [1, 1, 0]), traj([4, -1], [1, 0])])  # oldest 4 → lag 1
    b = Group("b", [traj([3, 5])])  # resumed partial rollout: oldest 3 → lag 2, not > 2
    c = Group("c", [traj([2, 5]), traj([5])])  # oldest 2 → lag 3
    d = Group("d", [traj([-1, 4, 1], [1, 1, 0])])  # -1 ignored, the mask-0 token too → lag 1
    e = Group("e", [traj([-1], [0])])  # no model token: no lag, kept
    kept, dropped = stale_filter([a, b, c, d, e], current_version=5, max_policy_lag=2)
    assert [g.task_id for g in kept] == ["a", "b", "d", "e"] and [g.task_id for g in dropped] == ["c"]
    assert [policy_lag(g, 5) for g in (a, b, c, d, e)] == [1, 2, 3, 1, None]
    kept, dropped = stale_filter([a, b, c], current_version=5, max_policy_lag=0)
    assert kept == [] and len(dropped) == 3


def test_version_lag_stats_over_model_tokens():
    trajs = [traj([5, 5, -1], [1, 1, 0]), traj([4, -1], [1, 0]), traj([3, 5]), traj([2, 5])]
    # model-token lags at version 5: 0, 0, 1, 2, 0, 3, 0 → mean 6/7, max 3
    stats = version_lag_stats(trajs, 5)
    assert stats["rollout/policy_version_lag_mean"] == pytest.approx(6 / 7)
    assert stats["rollout/policy_version_lag_max"] == 3.0
    assert version_lag_stats([traj([-1], [0])], 5) == {"rollout/policy_version_lag_mean": 0.0,
                                                        "rollout/policy_version_lag_max": 0.0}


def test_on_policy_segment_only_masks_the_older_segments():
    # a partial rollout: versions only grow inside a trajectory; here 2, 2, 2, (tool), 3, 3, (tool), 3
    t = traj([2, 2, 2, -1, 3, 3, -1, 3], mask=[1, 1, 1, 0, 1, 1, 0, 1])
    assert policy_lag(Group("t", [t]), current_version=4) == 2  # before: from the oldest token
    assert mask_older_segments(t) == 3
    assert t.response_mask == [0, 0, 0, 0, 1, 1, 0, 1]
    assert t.versions == [2, 2, 2, -1, 3, 3, -1, 3] and t.num_model_tokens == 3  # kept as context
    assert policy_lag(Group("t", [t]), current_version=4) == 1  # after: from the trained segment
    one_version = traj([5, 5, -1, 5], mask=[1, 1, 0, 1])
    assert mask_older_segments(one_version) == 0 and one_version.response_mask == [1, 1, 0, 1]
    assert mask_older_segments(traj([], mask=[])) == 0
