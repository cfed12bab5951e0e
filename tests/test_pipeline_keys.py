"""The pipeline's keys act: buffer type / weights / size, the degenerate-group filter in fully_async (accounting
and staleness including resampled groups), use_trainer_do_validate, trigger_parameter_sync_step."""

from __future__ import annotations

import pytest

ASYNC = ("rollout.mode=fully_async", "rollout.scheduler.max_staleness=2", "buffer.stale_filter.max_policy_lag=2",
         "trainer.total_steps=5", "trainer.save_every=0")


def accounting_holds(row: dict) -> bool:
    return row["queue/total_produced"] == (row["queue/total_consumed"] + row["queue/dropped_samples"]
                                           + row["queue/stale_samples"] + row["queue/queued_samples"])


def test_fifo_and_priority_buffers_train_different_groups_and_count_evictions(small_run):
    # the two orders part only at a take from a buffer holding groups of different versions, which timing decides:
    # 8 steps, not ASYNC's 5 (5 steps once took the same groups under both, in the suite on 2 busy cores)
    fifo_rows, fifo_samples, _ = small_run("fifo", *ASYNC, "buffer.type=fifo", "trainer.total_steps=8",
                                           "rollout.partial_rollout.replay_buffer_size=3")
    prio_rows, prio_samples, _ = small_run("prio", *ASYNC, "buffer.type=priority", "trainer.total_steps=8",
                                           "rollout.partial_rollout.replay_buffer_size=3")
    assert [s["task_ids"] for s in fifo_samples] != [s["task_ids"] for s in prio_samples]
    for rows in (fifo_rows, prio_rows):
        assert all(accounting_holds(r) for r in rows[1:])
        assert max(r["buffer/size"] for r in rows[1:]) > 0  # groups wait in the buffer across steps
        assert max(r["rollout/policy_version_lag_max"] for r in rows[1:]) <= 2
    assert fifo_rows[-1]["buffer/evicted"] + prio_rows[-1]["buffer/evicted"] > 0
    # an evicted group counts as dropped: the identity above still holds with it


def test_fully_async_degenerate_filter_accounting_and_staleness_include_resampled_groups(small_run):
    rows, samples, _ = small_run("filter", *ASYNC, "policy_optimization.advantage.degenerate_group_filter.enabled=true",
                                 "policy_optimization.advantage.degenerate_group_filter.resample_attempts=2")
    steps = rows[1:]
    assert len(steps) == 5
    assert sum(r["rollout/resampled_groups"] for r in steps) > 0  # the untrained tiny model gives degenerate groups
    for r in steps:
        assert accounting_holds(r), r
        assert r["rollout/policy_version_lag_max"] <= 2  # resampled groups too: they hold an admission slot
    produced = steps[-1]["queue/total_produced"]
    assert produced >= sum(r["rollout/trained_trajectories"] for r in steps)


def test_use_trainer_do_validate_evaluates_the_trainers_or_the_rollouters_weights(small_run):
    common = (*ASYNC, "trainer.trigger_parameter_sync_step=2", "trainer.eval_every=3", "trainer.total_steps=3",
              "rollout.scheduler.max_staleness=1")
    trainer_rows, _, _ = small_run("val_trainer", *common, "trainer.use_trainer_do_validate=true")
    rollouter_rows, _, _ = small_run("val_rollouter", *common, "trainer.use_trainer_do_validate=false")
    # at step 3 the trainer holds step 3's weights; the rollout engine those of the last sync, step 2
    assert trainer_rows[-1]["eval/weights_step"] == 3
    assert rollouter_rows[-1]["eval/weights_step"] == 2


def test_trigger_parameter_sync_step_sets_the_parameter_version(small_run):
    rows, _, _ = small_run("sync_every", *ASYNC, "trainer.trigger_parameter_sync_step=2")
    # one weight sync every 2 steps: version = floor(step / 2)
    assert [r["rollout/current_param_version"] for r in rows[1:]] == [0, 1, 1, 2, 2]
    every_step, _, _ = small_run("sync_every_1", *ASYNC, "trainer.trigger_parameter_sync_step=1")
    assert [r["rollout/current_param_version"] for r in every_step[1:]] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_every_step_row_has_the_async_and_shaping_metrics(small_run, mode):
    rows, _, _ = small_run(mode, *ASYNC, f"rollout.mode={mode}", "trainer.total_steps=2")
    keys = {"rollout/generated_trajectories", "rollout/dropped_groups", "rollout/resampled_groups",
            "optim/degenerate_group_ratio_before_filter", "rollout/current_param_version", "perf/weight_sync_s"}
    if mode == "fully_async":
        keys |= {"queue/total_produced", "queue/total_consumed", "queue/dropped_samples", "buffer/evicted",
                 "rollout/policy_version_lag_max"}
    for r in rows[1:]:
        assert keys <= set(r), keys - set(r)


def test_stale_filter_drops_what_lags_more_than_max_policy_lag(small_run):
    common = ("rollout.mode=fully_async", "rollout.scheduler.max_staleness=3", "buffer.stale_filter.max_policy_lag=0",
              "trainer.total_steps=4", "trainer.save_every=0")
    on, _, _ = small_run("stale_on", *common, "buffer.stale_filter.enabled=true")
    off, _, _ = small_run("stale_off", *common, "buffer.stale_filter.enabled=false")
    assert all(r["rollout/policy_version_lag_max"] == 0 for r in on[1:])  # nothing older than lag 0 is trained
    assert all(r["queue/stale_samples"] == 0 for r in off[1:])  # nothing is filtered
    # the rollouter runs up to 3 versions ahead: with the filter the old groups go, without it they are trained
    assert on[-1]["queue/stale_samples"] > 0 or max(r["rollout/policy_version_lag_max"] for r in off[1:]) > 0
    assert all(accounting_holds(r) for r in on[1:] + off[1:])


def test_the_fully_async_seed_file_alone_selects_fully_async_and_reports_async_metrics(small_run):
    from conftest import SEEDS

    rows, _, run_dir = small_run("seed_fully_async", "trainer.ppo_mini_batch_size=4", "trainer.require_batches=2",
                                 "trainer.total_steps=4", "trainer.save_every=0",
                                 files=(SEEDS / "fully_async_ppo.yaml",))
    assert "mode: fully_async" in (run_dir / "config.yaml").read_text()
    for r in rows[1:]:
        assert accounting_holds(r) and r["queue/total_produced"] > 0
        assert {"rollout/policy_version_lag_max", "perf/rollouter_idle_ratio", "buffer/size"} <= set(r)
    # trigger_parameter_sync_step: 4 in the seed: one weight sync in 4 steps
    assert [r["rollout/current_param_version"] for r in rows[1:]] == [0, 0, 0, 1]
