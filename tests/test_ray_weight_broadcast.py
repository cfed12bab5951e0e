"""ray.weight_transfer: nccl — the weights broadcast from the trainer to the rollouter actor in a process group of
their own (tether/distributed/weight_transfer.py). On this CPU machine the group is gloo, through the same code as
NCCL. The first tests need no cluster; the rest share one local Ray cluster (2 CPUs) for the module."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from conftest import SMALL_RUN, read_rows, start_killing_the_rollouter
from tether.config import load_config
from tether.distributed.weight_transfer import ALIGN, WeightGroup, cut_buckets, flatten, host_store, unflatten


def _state_dict() -> dict[str, torch.Tensor]:
    """Mixed dtypes and odd sizes (offsets that need the padding), a scalar, a bool mask: 2,270 bytes of data."""
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(13, 7, generator=g), "norm": torch.randn(5, generator=g).to(torch.bfloat16),
            "step": torch.tensor(3, dtype=torch.int64), "mask": torch.rand(9, generator=g) > 0.5,
            "head": torch.randn(3, 11, 3, generator=g).to(torch.float64), "bias": torch.randn(101, generator=g)}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ----------------------------------------------------------------------------- no cluster needed

def test_a_bucket_flattens_into_one_aligned_buffer_and_back_bit_for_bit():
    sd = _state_dict()
    layout, buffer = flatten(sd, torch.device("cpu"))
    # embed 364 B → next at 368; norm 10 B → 384; step 8 B → 400; mask 9 B → 416; head 792 B → 1216; bias 404 B
    assert [s.offset for s in layout.slots] == [0, 368, 384, 400, 416, 1216]
    assert layout.nbytes == buffer.numel() == 1632 and all(s.offset % ALIGN == 0 for s in layout.slots)
    assert _max_diff(unflatten(layout, buffer), sd) == 0.0


def test_buckets_are_cut_by_bytes_as_the_object_store_cuts_them():
    sd = _state_dict()
    # 364 + 10 > 370: norm opens a bucket; head (792) and bias (404) are larger than one: each alone
    assert cut_buckets(sd, 370) == [["embed"], ["norm", "step", "mask"], ["head"], ["bias"]]
    assert cut_buckets(sd, 400) == [["embed", "norm", "step", "mask"], ["head"], ["bias"]]  # 364 + 10 + 8 + 9 = 391
    assert cut_buckets(sd, 1 << 20) == [list(sd)]


def _receive(port: int, names: list[list[str]], out: str) -> None:
    """Rank 1 in a process of its own: join the group, receive the buckets, save what arrived."""
    sd = _state_dict()
    layouts = [flatten({n: sd[n] for n in bucket}, torch.device("cpu"))[0] for bucket in names]
    group = WeightGroup.join("127.0.0.1", port, "test-1", "gloo", 60)
    torch.save({k: v.clone() for k, v in group.receive(layouts).items()}, out)  # views of one buffer: copied
    group.close()


def test_the_group_broadcasts_several_buckets_to_another_process_exactly(tmp_path):
    """Two processes, no default process group in either: what rank 1 receives equals what rank 0 sent."""
    sd = _state_dict()
    names = cut_buckets(sd, 370)
    store = host_store("127.0.0.1", 60)
    child = multiprocessing.get_context("spawn").Process(target=_receive, args=(store.port, names, tmp_path / "got"))
    child.start()
    try:
        group = WeightGroup(store, "test-1", 0, "gloo", 60)  # returns once the child has joined
        group.send([flatten({n: sd[n] for n in bucket}, group.device)[1] for bucket in names])
        child.join(timeout=60)
        assert child.exitcode == 0
        group.close()
    finally:
        child.kill()
    assert not torch.distributed.is_initialized()  # the default group was never made
    got = torch.load(tmp_path / "got", weights_only=True)
    assert len(names) == 4 and _max_diff(got, sd) == 0.0


# ------------------------------------------------------------------------ one cluster per module (conftest.cluster)

def _cfg(tmp_path: Path, model: str, *overrides: str):
    base = tmp_path / "small_run.yaml"
    base.write_text(SMALL_RUN)
    return load_config([base], [f"model.path={model}", "backend=ray", "trainer.save_every=1",
                                "ray.weight_bucket_mb=0.1", *overrides])  # 0.54 MiB of weights: 3 buckets


def _recording_worker(out: Path) -> type:
    """A RolloutWorker that saves its engine's weights after each load, as ``{path}_v{version}_t{token}.pt``
    (defined here, in a function, so that Ray ships the class itself to the actor)."""
    from tether.distributed.actors import RolloutWorker

    class RecordingWorker(RolloutWorker):
        async def _load(self, state_dict: dict, token: int, version: int, path: str) -> None:
            await super()._load(state_dict, token, version, path)
            weights = {k: v.detach().clone() for k, v in self.rt.engine.model.state_dict().items()}
            torch.save(weights, out / f"{path}_v{version}_t{token}.pt")

    return RecordingWorker


def _checkpoint(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")


def _train(cfg, run_dir: Path, monkeypatch, on_start=None) -> dict[str, dict[str, torch.Tensor]]:
    """Train ``cfg`` on Ray with the recording worker; returns the engine's weights after each load, by file stem."""
    from tether.distributed import ray_backend

    out = run_dir.parent / f"{run_dir.name}_loads"
    out.mkdir()
    monkeypatch.setattr(ray_backend, "RolloutWorker", _recording_worker(out))
    ray_backend.train_on_ray(cfg, run_dir, show_progress=False, on_start=on_start)
    return {p.stem: torch.load(p, weights_only=True) for p in sorted(out.glob("*.pt"))}


def _same_as_trainer(engine: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> float:
    """Max |engine - trainer| over the trainer's saved weights (save_pretrained leaves out the tied lm_head)."""
    assert trained and set(trained) <= set(engine)
    return max((engine[k] - trained[k]).abs().max().item() for k in trained)


@pytest.mark.slow
def test_after_every_broadcast_the_rollout_engine_holds_the_trainers_weights(cluster, tiny_model, tmp_path,
                                                                             monkeypatch):
    """Sync mode, a sync after every step: the engine's weights after load v equal the trainer's checkpoint of
    step v (max abs difference 0). Flipping ray.weight_transfer to object_store changes the path the weights take
    (the loads, the groups made) and nothing else: the same bytes per sync, the same losses."""
    nccl_dir, store_dir = tmp_path / "nccl", tmp_path / "object_store"
    loads = _train(_cfg(tmp_path, tiny_model, "ray.weight_transfer=nccl"), nccl_dir, monkeypatch)
    assert sorted(loads) == ["broadcast_v1_t1", "broadcast_v2_t2", "broadcast_v3_t3"]
    for v in (1, 2, 3):
        assert _same_as_trainer(loads[f"broadcast_v{v}_t{v}"], _checkpoint(nccl_dir, v)) == 0.0
    initial = _checkpoint(nccl_dir, 1)  # the weights changed at each step: the comparison is not of equal weights
    assert _same_as_trainer(loads["broadcast_v2_t2"], initial) > 0

    store_loads = _train(_cfg(tmp_path, tiny_model, "ray.weight_transfer=object_store"), store_dir, monkeypatch)
    assert sorted(store_loads) == ["object_store_v1_t1", "object_store_v2_t2", "object_store_v3_t3"]
    for v in (1, 2, 3):  # each run's engine equals its own trainer exactly; two runs agree to rounding
        assert _same_as_trainer(store_loads[f"object_store_v{v}_t{v}"], _checkpoint(store_dir, v)) == 0.0
        assert _same_as_trainer(loads[f"broadcast_v{v}_t{v}"], store_loads[f"object_store_v{v}_t{v}"]) < 1e-5
    nccl, store = read_rows(nccl_dir), read_rows(store_dir)
    for name, rows in (("nccl (gloo on CPU)", nccl), ("object_store", store)):
        print(f"weight sync per step, {name}: " + ", ".join(
            f"{r['perf/weight_sync_mb']:.3f} MiB in {r['perf/weight_sync_s']:.3f} s" for r in rows[1:]))
    assert [r["step"] for r in nccl] == [r["step"] for r in store] == [0, 1, 2, 3]
    assert [r.get("ray/weight_group_joins", 0) for r in nccl] == [0, 1, 0, 0]  # one group, made at the first sync
    assert all("ray/weight_group_joins" not in r for r in store)
    for a, b in zip(nccl[1:], store[1:], strict=True):
        assert a["perf/weight_sync_buckets"] == b["perf/weight_sync_buckets"] == 3
        assert a["perf/weight_sync_mb"] == b["perf/weight_sync_mb"] > 0.5
        assert a["perf/weight_sync_s"] > 0 and b["perf/weight_sync_s"] > 0
        assert a["optim/loss"] == pytest.approx(b["optim/loss"], abs=1e-6)


@pytest.mark.slow
def test_a_restarted_rollout_actor_catches_up_through_the_object_store_and_joins_a_new_group(cluster, tiny_model,
                                                                                             tmp_path, monkeypatch):
    """The rollouter actor is killed while step 2's groups are in flight in it: Ray restarts it (token 0); it
    catches up to push 1 through the object store, and push 2 is broadcast in a second group made with the new
    incarnation. Every load, on either path, equals the trainer's weights of its version exactly."""
    run_dir = tmp_path / "run"
    cfg = _cfg(tmp_path, tiny_model, "ray.weight_transfer=nccl", "engine.max_tokens=48")  # long calls: see below
    actors: dict = {}
    # once step 1 is logged (push 1 loaded), while groups are in flight in it (48 tokens: a group call lasts several
    # times the stats → kill round trip, as in test_ray_failures)
    killer, killed = start_killing_the_rollouter(actors, run_dir, lambda stats: stats["in_flight"] > 0)
    loads = _train(cfg, run_dir, monkeypatch, on_start=actors.update)
    killer.join(timeout=5)
    assert killed["token"] == 1 and killed["in_flight"] > 0
    assert sorted(loads) == ["broadcast_v1_t1", "broadcast_v2_t2", "broadcast_v3_t3", "object_store_v1_t1"]
    for name, weights in loads.items():
        assert _same_as_trainer(weights, _checkpoint(run_dir, int(name.split("_v")[1][0]))) == 0.0, name
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    total = {k: sum(r.get(k, 0) for r in rows) for k in ("ray/actor_restarts", "ray/weight_group_joins",
                                                          "ray/weight_catch_ups")}
    assert total["ray/actor_restarts"] == 1 and total["ray/weight_group_joins"] == 2  # at push 1, and push 2
    assert total["ray/weight_catch_ups"] >= 1
