"""model.lora under ``backend: ray`` and with ``actor_worker.class: DetachActorWorker``.

Under Ray the trainer actor sends the rollouter actor the adapter alone (``RolloutHandle.update_adapter``, through the
object store), and the rollouter's engine merges it into its base weights: a fully_async run trains the adapter, each
sync moves exactly the adapter's bytes, every trained token carries the version synced last, and the engine's
log-probabilities of them are the learner's (it serves the trained policy, not the base). A restarted actor (or one
that missed a push) catches up to the latest adapter, also under ``ray.weight_transfer: nccl``. DetachActorWorker keeps
the adapter alone in its π_prox slot, and holds π_prox at the synced adapter across a sync window.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_RUN, read_rows, train_on_ray_killing_the_rollouter
from tether.config import load_config
from tether.learner import load_model_and_tokenizer
from tether.learner.pool import LearnerSpec

torch.set_num_threads(1)

STEPS = 3
LORA = ("model.lora.rank=8", "policy_optimization.optimizer.lr=1e-2")


def adapter_mb(ckpt: Path) -> tuple[dict[str, torch.Tensor], float]:
    weights = load_file(ckpt / "adapter_model.safetensors")
    return weights, sum(v.nbytes for v in weights.values()) / 2**20


@pytest.mark.slow
def test_fully_async_on_ray_syncs_the_adapter_alone_and_the_engine_serves_it(cluster, tiny_model, tmp_path):
    from tether.distributed.ray_backend import train_on_ray

    (tmp_path / "small_run.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "small_run.yaml"], [
        f"model.path={tiny_model}", "backend=ray", "rollout.mode=fully_async", "rollout.scheduler.max_staleness=0",
        f"trainer.total_steps={STEPS}", f"trainer.save_every={STEPS}", *LORA])
    train_on_ray(cfg, tmp_path / "run", show_progress=False)
    rows = read_rows(tmp_path / "run")
    trained = [r for r in rows[1:] if "optim/loss" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert all(r["optim/grad_norm"] > 0 for r in trained)
    weights, mb = adapter_mb(tmp_path / "run" / "checkpoints" / f"step_{STEPS}")
    b = [v for k, v in weights.items() if "lora_B" in k]
    assert b and all(v.abs().max() > 0 for v in b)  # B left its zero start: the adapter trained
    # every sync (one after each step) moved the adapter alone, in one bucket, never the merged weights
    synced = [r.get("perf/weight_sync_mb") for r in trained]
    assert synced == [pytest.approx(mb)] * STEPS and all(r["perf/weight_sync_buckets"] == 1 for r in trained)
    # staleness 0: step s trains on tokens all sampled by version s - 1, the one synced last before it
    lags = [(r["rollout/policy_version_lag_mean"], r["rollout/policy_version_lag_max"]) for r in trained]
    assert lags == [(0.0, 0.0)] * STEPS
    # each step follows a sync: the engine's log-probabilities of its tokens are the learner's
    gaps = [r["rollout/logp_abs_diff_mean"] for r in trained]
    # ... which would not hold for the base weights: the adapter moves the policy's logits by far more than that
    from tether.learner import lora

    base, _ = load_model_and_tokenizer(tiny_model)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        moved = (lora.merged_copy(_peft(tiny_model, tmp_path / "run" / "checkpoints" / f"step_{STEPS}"))(
            input_ids=ids).logits - base(input_ids=ids).logits).abs().max().item()
    print(f"ray lora: sync {synced[0] * 1024:.1f} KiB per step (adapter {mb * 1024:.1f} KiB); mean |Δ log π| engine vs "
          f"learner per step {gaps}; the adapter moves the logits by {moved:.2e}")
    assert max(gaps) < 1e-5 and moved > 1e-3


@pytest.mark.slow
def test_a_restarted_rollout_actor_catches_up_to_the_adapter(cluster, tiny_model, tmp_path):
    """The rollouter actor killed after the first adapter sync, with groups in flight: Ray restarts it from the model
    folder (the base weights); it must catch up to the latest adapter before it generates again, so the engine still
    serves the learner's policy at every later step."""
    run_dir = tmp_path / "run"
    (tmp_path / "small_run.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "small_run.yaml"], [
        f"model.path={tiny_model}", "backend=ray", "rollout.mode=fully_async", "rollout.scheduler.max_staleness=0",
        "trainer.total_steps=3", "trainer.save_every=0", "engine.max_tokens=48", *LORA])
    # holding step 1's adapter and generating with it
    killed = train_on_ray_killing_the_rollouter(cfg, run_dir, lambda st: st["in_flight"] > 0 and st["version"] >= 1,
                                                timeout_s=300)
    rows = read_rows(run_dir)
    assert killed, "the rollouter actor was never seen generating after a sync"
    assert sum(r.get("ray/actor_restarts", 0) for r in rows) == 1
    assert sum(r.get("ray/weight_catch_ups", 0) for r in rows) >= 1
    trained = [r for r in rows[1:] if "optim/loss" in r]
    gaps = [r["rollout/logp_abs_diff_mean"] for r in trained]
    print(f"ray lora, actor killed at version {killed['version']}: mean |Δ log π| per step {gaps}")
    assert [r["step"] for r in trained] == [1, 2, 3] and max(gaps) < 1e-5  # served base after the restart: 9e-3


def _peft(tiny_model: str, ckpt: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_model_and_tokenizer(tiny_model)[0], ckpt)


@pytest.mark.parametrize("transfer", ["object_store", "nccl"])
def test_an_adapter_push_and_its_catch_up_go_through_the_object_store(cluster, transfer):
    """``update_adapter`` sends the adapter as one object-store push, and a catch-up (a restarted actor, token 0)
    sends that push again as an adapter — under ``nccl`` too, where weights would be broadcast."""
    from tether.distributed.remote import RolloutHandle

    class Rollouter:  # defined here: Ray pickles it by value (a test module is not importable in a worker)
        """A stand-in for the RolloutWorker's weight calls: it records what it is asked to load."""

        def __init__(self) -> None:
            self.loads: list[tuple[str, int, int, float | None, dict[str, torch.Tensor]]] = []

        async def update_adapter(self, token: int, version: int, refs: list, scaling: float) -> int:
            from tether.distributed.weight_transfer import unpack_buckets

            self.loads.append(("adapter", token, version, scaling, unpack_buckets(list(await asyncio.gather(*refs)))))
            return token

        async def update_weights(self, token: int, version: int, refs: list) -> int:
            self.loads.append(("weights", token, version, None, {}))
            return token

        def stats(self) -> dict:
            return {"token": 0, "pid": 1}

        def calls(self) -> list:
            return self.loads

    actor = cluster.remote(Rollouter).remote()
    handle = RolloutHandle(actor, bucket_bytes=1 << 20, max_restarts=0, transfer=transfer)
    adapter = {"model.layers.0.self_attn.q_proj.lora_A": torch.randn(8, 32),
               "model.layers.0.self_attn.q_proj.lora_B": torch.randn(32, 8)}
    handle.update_adapter(adapter, 2.0, version=3)
    asyncio.run(handle.catch_up())
    loads = cluster.get(actor.calls.remote())
    assert [load[:4] for load in loads] == [("adapter", 1, 3, 2.0)] * 2
    assert all(torch.equal(load[4][k], adapter[k]) for load in loads for k in adapter)
    cluster.kill(actor)


# ------------------------------------------------------------------------------------- DetachActorWorker


def test_a_detach_worker_keeps_the_adapter_alone_and_holds_prox_at_the_synced_one(tiny_model):
    from conftest import learner_args, random_trajectories

    cfg = load_config([], [*LORA, "actor_worker.class=DetachActorWorker", "learner.batch_size=8",
                           "learner.mini_batch_size=4", "policy_optimization.advantage.group_size=4",
                           "policy_optimization.optimizer.warmup_steps=0"])
    args = learner_args(cfg)
    spec = LearnerSpec(cfg.learner, cfg.policy_optimization, cfg.actor_worker, temperature=args["temperature"],
                       max_response_tokens=args["max_response_tokens"], lora=cfg.model.lora)
    learner = spec.build(load_model_and_tokenizer(tiny_model)[0])
    slot = learner.worker.slots["sync"]
    trainable = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert set(slot) == trainable and all(".lora_A." in n or ".lora_B." in n for n in slot)
    assert sum(t.nbytes for t in slot.values()) == sum(t.nbytes for t in learner.adapter_for_engine(None).values())
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        synced = learner.model(input_ids=ids).logits
    trajs = random_trajectories(learner.model.config.vocab_size, 8, 0, prompt_len=5, head=6, gap=3)
    learner.train_step(trajs, [1.0, -1.0, 0.5, -0.5, 0.8, -0.2, -0.3, 0.1])
    with torch.no_grad():
        now = learner.model(input_ids=ids).logits
        with learner.worker.prox_weights(learner.version):  # inside the window: the synced adapter
            prox = learner.model(input_ids=ids).logits
        assert torch.equal(learner.model(input_ids=ids).logits, now)  # and the trained one back after
    assert torch.equal(prox, synced) and (now - synced).abs().max() > 1e-4
