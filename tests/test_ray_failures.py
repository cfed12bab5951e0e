"""backend: ray under failure: a rollouter actor killed mid-run is restarted and its in-flight groups re-queued
(each trained once, the queue balanced); a trainer actor that dies stops the run with its last checkpoint intact,
and --resume continues it exactly once. One local Ray cluster (2 CPUs) for the module."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import SMALL_RUN, read_rows, train_on_ray_killing_the_rollouter
from tether.config import load_config

ray = pytest.importorskip("ray")


def _cfg(tmp_path: Path, model: str, *overrides: str):
    base = tmp_path / "small_run.yaml"
    base.write_text(SMALL_RUN)
    return load_config([base], [f"model.path={model}", "backend=ray", *overrides])


def _trained_groups(run_dir: Path) -> list[tuple[int, int]]:
    """Every group the trainer took (trained or dropped by the filter), over all steps, as (task step, index)."""
    return [tuple(g) for row in read_rows(run_dir, "samples.jsonl") for g in row["groups"] + row["dropped"]]


def _sum(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows)


@pytest.mark.slow
def test_killing_the_rollout_actor_mid_run_requeues_its_groups_and_trains_each_once(cluster, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    # engine.max_tokens 48: a group call lasts several times the stats → kill round trip, so the calls seen in flight
    # are still in flight when the kill lands (at 12 tokens, on a loaded machine, they could finish first)
    cfg = _cfg(tmp_path, tiny_model, "rollout.mode=fully_async", "trainer.total_steps=4", "trainer.save_every=4",
               "ray.weight_bucket_mb=0.1", "engine.max_tokens=48")  # 0.54 MiB of weights: several buckets
    # once step 1 is logged (weights pushed: the restarted actor must catch up), while groups are in flight in it
    killed = train_on_ray_killing_the_rollouter(cfg, run_dir, lambda stats: stats["in_flight"] > 0)
    rows = read_rows(run_dir)
    assert killed["in_flight"] > 0 and killed["token"] >= 1  # killed with work in flight, after a weight push
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # the run completed
    assert _sum(rows, "ray/actor_restarts") == 1
    assert _sum(rows, "ray/requeued_calls") >= 1  # the in-flight calls were made again…
    assert _sum(rows, "ray/weight_catch_ups") >= 1  # …after the new incarnation caught up to the latest weights
    groups = _trained_groups(run_dir)
    assert len(groups) == len(set(groups)) == 4 * 2  # each group taken once, none twice, 2 per step
    last = rows[-1]
    assert last["queue/total_produced"] == (last["queue/total_consumed"] + last["queue/dropped_samples"]
                                           + last["queue/stale_samples"] + last["queue/queued_samples"])
    assert last["queue/total_consumed"] == 4 * 8 and last["queue/dropped_samples"] == 0
    assert all(r["perf/weight_sync_buckets"] > 1 for r in rows[1:])  # the demo test: 1 bucket at the default


@pytest.mark.slow
def test_a_dead_trainer_actor_stops_the_run_and_resume_continues_exactly_once(cluster, tiny_model, tmp_path,
                                                                              monkeypatch):
    from tether.distributed.ray_backend import TrainerActorFailed, train_on_ray
    from tether.learner.checkpoint import latest_checkpoint
    from tether.pipeline.trainer import train

    overrides = ("trainer.total_steps=2", "trainer.save_every=1")
    cfg = _cfg(tmp_path, tiny_model, *overrides)
    train(cfg.model_copy(update={"backend": "local"}), tmp_path / "uninterrupted", show_progress=False)
    run_dir = tmp_path / "run"
    monkeypatch.setenv("TETHER_FAULT", "update@2")  # SIGKILL in the trainer actor after step 2's update
    with pytest.raises(TrainerActorFailed, match=r"trainer actor died .*last complete checkpoint is .*step_1; "
                                                 r"continue the run with --resume"):
        train_on_ray(cfg, run_dir, show_progress=False)
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_1" and (ckpt / "config.json").is_file()
    monkeypatch.delenv("TETHER_FAULT")
    train_on_ray(cfg, run_dir, resume=True, show_progress=False)
    rows, ref = read_rows(run_dir), read_rows(tmp_path / "uninterrupted")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["step"] for r in read_rows(run_dir, "samples.jsonl")] == [1, 2]
    assert _trained_groups(run_dir) == _trained_groups(tmp_path / "uninterrupted")  # each group once, as uninterrupted
    assert rows[2]["optim/loss"] == pytest.approx(ref[2]["optim/loss"], abs=1e-6)


def test_with_no_restarts_left_a_dead_rollout_actor_ends_the_run_naming_the_key(cluster, tiny_model, tmp_path):
    """ray.max_actor_restarts = 0: the actor is not restarted, and the trainer's handle says so (with 3, the
    test above: it is restarted and the run goes on)."""
    from tether.distributed.placement import reserve_pools
    from tether.distributed.ray_backend import start_rollout_worker
    from tether.distributed.remote import RolloutActorLost, RolloutHandle

    cfg = _cfg(tmp_path, tiny_model, "ray.max_actor_restarts=0")
    pools = reserve_pools(cfg.resource_pool)
    try:
        actor = start_rollout_worker(cfg, tiny_model, pools, {})
        handle = RolloutHandle(actor, 1 << 20, cfg.ray.max_actor_restarts)
        handle.wait_alive()  # up: notes its pid
        ray.kill(actor, no_restart=False)
        for _ in range(300):  # the kill lands asynchronously: until it has, the actor still answers
            try:
                ray.get(actor.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 — dead (RayActorError) or unreachable: the kill has landed
                break
            time.sleep(0.2)
        with pytest.raises(RolloutActorLost, match=r"not restarted \(ray.max_actor_restarts = 0 restarts spent\)"):
            handle.wait_alive()
        assert handle.restarts == 0
    finally:
        pools.remove()
