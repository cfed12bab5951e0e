"""model.lora with FSDP2 (``actor_worker.strategy: fsdp2``) and 2 trainer ranks (gloo on CPU): the base is sharded
with the adapter inside it, AdamW holds the adapter alone, a sync gathers A and B only, and the checkpoint is peft's.

What is checked, with numbers: 2 fsdp2 ranks train the adapter that 1 plain learner trains (float32, the shares summed
in another order; after 4 AdamW updates of lr 1e-2 within 1e-5, measured 1.2e-6: Adam divides each gradient entry by its
own running RMS, so an entry near zero whose last bits differ moves by a visibly different fraction of lr, as in
tests/test_fsdp2.py); the KL to the adapter-off reference is the plain
learner's; rank 0 pushes the adapter alone (``perf/weight_sync_mb`` = its bytes); the checkpoint loads with
``PeftModel.from_pretrained`` and resumes across layouts (2 ranks ← 1 plain, 1 plain ← 2 ranks, bit for bit); the
merged copy (``tether export --merge``, the evaluation engine) is the policy. A 2-rank run trains the adapter of one
plain process (measured 4e-8..5e-7 over 2 steps: the order of the ranks' sums varies), serves the trained policy
(``rollout/logp_abs_diff_mean`` 1.3e-7, 1.6e-7 < 1e-5) and syncs the adapter's bytes (16 KiB a sync); a run on one
fsdp2 rank trains the plain adapter (8.1e-8), its adapter-off reference is the base's logits (measured 0) and its
checkpoint resumes on 2 ranks (2.7e-7 from straight on). Under ``backend: ray`` (slow) the trainer actor's 2 ranks
sync 16 KiB a step and the rollouter's engine serves the policy (1.3e-7, 1.6e-7).
DetachActorWorker on 2 ranks: 3.4e-6.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from conftest import learner_args, random_trajectories
from tether.config import RunConfig, load_config
from tether.learner import load_model_and_tokenizer, lora
from tether.learner.checkpoint import load_checkpoint, save_checkpoint
from tether.learner.learner import Learner
from tether.learner.pool import LearnerSpec, Trainer, start_trainer
from tether.pipeline.weights import WeightSync

torch.set_num_threads(1)

TARGETS = 7  # the default target modules: the tiny model's one layer has 7 adapted projections
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 0.8, -0.2, -0.3, 0.1]
IDS = torch.arange(3, 40).reshape(1, -1)  # [1, 37] token ids, any


def cfg_of(*sets: str) -> RunConfig:
    """Every term on (a correction, entropy, KL k3 to the adapter-off reference), two updates of two micro-batches."""
    return load_config([], [
        "model.lora.rank=4", "learner.batch_size=8", "learner.mini_batch_size=4",
        "learner.gradient_accumulation_steps=2", "policy_optimization.advantage.group_size=4",
        "policy_optimization.exploration.entropy_coef=0.01", "policy_optimization.kl_control.type=relative_entropy",
        "policy_optimization.kl_control.init_coef=0.05", "policy_optimization.kl_control.estimator=k3",
        "policy_optimization.optimizer.lr=1e-2", "policy_optimization.optimizer.warmup_steps=0", *sets])


def spec_of(cfg: RunConfig) -> LearnerSpec:
    args = learner_args(cfg)
    return LearnerSpec(cfg.learner, cfg.policy_optimization, cfg.actor_worker, temperature=args["temperature"],
                       max_response_tokens=args["max_response_tokens"], lora=cfg.model.lora)


def batches(vocab: int) -> list[list]:
    return [random_trajectories(vocab, 8, seed, prompt_len=5, head=6, gap=3, min_logp=5.0) for seed in (0, 1)]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


class AdapterEngine:
    def __init__(self):
        self.calls = []

    def update_adapter(self, adapter, scaling, version):
        self.calls.append((adapter, scaling, version))


@pytest.mark.parametrize("worker", ["ActorWorker", "DetachActorWorker"])  # Detach: π_prox from each rank's kept shards
def test_two_fsdp2_ranks_train_the_adapter_one_plain_learner_trains(tiny_model, tmp_path, metrics, worker):
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_model)
    plain = spec_of(cfg_of(f"actor_worker.class={worker}")).build(model)
    assert isinstance(plain, Learner)
    trajs = batches(model.config.vocab_size)
    plain_metrics = [plain.train_step(t, ADVANTAGES) for t in trajs]
    plain_ckpt = save_checkpoint(tmp_path / "plain", plain, None, {"step": 2})

    torch.manual_seed(0)  # rank 0 draws the plain learner's A; rank 1's own draw is replaced by rank 0's
    model, _ = load_model_and_tokenizer(tiny_model)
    trainer = start_trainer(model, tiny_model, spec_of(cfg_of("actor_worker.strategy=fsdp2",
                                                              f"actor_worker.class={worker}")), num_ranks=2)
    try:
        group = trainer.learner
        assert group.ranks.world == 2 and group.lora_scaling == plain.lora_scaling == 32 / 4
        # AdamW holds the adapter alone (rank 0's shards of it), no reference copy: the reference is the adapter off
        names = {id(p): n for n, p in group.learner.model.named_parameters()}
        held = [names[id(p)] for p in group.learner.optimizer.params]
        assert len(held) == 2 * TARGETS and all(".lora_A." in n or ".lora_B." in n for n in held), held
        assert group.learner.ref_model is None
        sharded_metrics = [group.train_step(t, ADVANTAGES) for t in trajs]
        assert len(group.learner.optimizer.optimizer.state) == 2 * TARGETS
        for m1, m2 in zip(plain_metrics, sharded_metrics, strict=True):
            for name in ("optim/loss", "optim/kl_divergence", "optim/entropy"):
                assert m2[name] == pytest.approx(m1[name], rel=1e-5, abs=1e-9), (name, m1[name], m2[name])
        assert sharded_metrics[1]["optim/kl_divergence"] > 0  # the adapter moved off the reference

        # the sync: rank 0 pushes the adapter alone (gathered from both ranks); its bytes are perf/weight_sync_mb
        engine = AdapterEngine()
        WeightSync(engine, group, 1, start_step=2).push()
        (adapter, scaling, version), = engine.calls
        assert version == 2 and scaling == 8.0 and len(adapter) == 2 * TARGETS
        diff = max_diff(adapter, plain.adapter_for_engine())
        print(f"{worker}: 2 fsdp2 ranks vs 1 plain learner, 2 steps: adapter max |Δ| {diff:.1e}")
        assert diff < 1e-5  # measured: 1.2e-6 (of entries up to ~0.4, moved by up to 4e-2)
        assert all(v.abs().max() > 0 for k, v in adapter.items() if k.endswith("lora_B"))  # B trained
        assert metrics.flush(0)["perf/weight_sync_mb"] == sum(t.nbytes for t in adapter.values()) / 2**20

        # the merged weights (backend: ray's buckets, the evaluation engine) and the merged copy are the policy
        # (compared with the base + s · B @ A of the adapter the ranks pushed: the same numbers, merged by hand)
        base, _ = load_model_and_tokenizer(tiny_model)
        by_hand = base.state_dict()
        with torch.no_grad():
            for name in {k.rsplit(".", 1)[0] for k in adapter}:
                by_hand[f"{name}.weight"] += scaling * adapter[f"{name}.lora_B"] @ adapter[f"{name}.lora_A"]
        assert max_diff(group.state_dict_for_engine(), by_hand) < 1e-6
        base.load_state_dict(by_hand)
        whole = trainer.whole_model()
        assert not hasattr(whole, "peft_config")
        assert (logits(whole, IDS) - logits(base.eval(), IDS)).abs().max() < 1e-5

        # the checkpoint is peft's, and loads with PeftModel.from_pretrained as the trained policy
        trainer.save(tmp_path / "two", None, {"step": 2})
        ckpt = tmp_path / "two"
        assert (ckpt / "adapter_config.json").is_file() and (ckpt / "adapter_model.safetensors").is_file()
        assert not (ckpt / "config.json").exists() and not (ckpt / "shards").exists()
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(ckpt)).eval()
        assert (logits(peft, IDS) - logits(base, IDS)).abs().max() < 1e-5
        # resume across layouts: the plain learner's checkpoint into the 2 ranks gives its adapter bit for bit
        assert trainer.load(plain_ckpt) == {"step": 2}
        assert max_diff(group.adapter_for_engine(), plain.adapter_for_engine()) == 0.0
    finally:
        trainer.close()

    # and the 2 ranks' checkpoint into a fresh plain learner: their adapter and AdamW moments
    fresh_model, _ = load_model_and_tokenizer(tiny_model)
    fresh = spec_of(cfg_of(f"actor_worker.class={worker}")).build(fresh_model)
    assert isinstance(fresh, Learner) and load_checkpoint(ckpt, fresh) == {"step": 2} and fresh.version == 2
    assert max_diff(fresh.adapter_for_engine(), adapter) == 0.0
    s1, s2 = plain.optimizer.optimizer.state_dict(), fresh.optimizer.optimizer.state_dict()
    assert max((s1["state"][i]["exp_avg"] - s2["state"][i]["exp_avg"]).abs().max().item() for i in s1["state"]) < 1e-6


def test_a_run_on_two_fsdp2_ranks_serves_the_trained_adapter(small_run):
    """``tether train`` with model.lora, actor_worker.strategy fsdp2 and 2 trainer ranks: the same adapter as one plain
    learner process trains, the engine serves it, each sync is the adapter's bytes, the checkpoint is peft's."""
    from safetensors.torch import load_file

    sets = ("model.lora.rank=8", "trainer.total_steps=2", "trainer.save_every=2")
    _, _, one = small_run("one", *sets)
    rows, _, run_dir = small_run("two", *sets, "actor_worker.strategy=fsdp2", "resource_pool.trainer_pool.num_ranks=2")
    assert all("perf/rank_imbalance" in r for r in rows[1:])  # trained on 2 ranks
    ckpt = run_dir / "checkpoints" / "step_2"
    weights = load_file(ckpt / "adapter_model.safetensors")
    straight = load_file(one / "checkpoints" / "step_2" / "adapter_model.safetensors")
    diff = max((weights[k] - straight[k]).abs().max().item() for k in straight)
    synced = [r["perf/weight_sync_mb"] for r in rows if "perf/weight_sync_mb" in r]
    print(f"run, 2 fsdp2 ranks vs 1 plain process, 2 steps: adapter max |Δ| {diff:.1e}; "
          f"|Δ log π| engine vs learner {[r.get('rollout/logp_abs_diff_mean') for r in rows[1:]]}; sync MiB {synced}")
    assert weights.keys() == straight.keys() and diff < 1e-5
    assert all(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)  # B left its zero start
    # each sync moves the adapter alone: the checkpoint's bytes (rank 8: 16 KiB here), not the merged weights
    assert synced and all(mb == pytest.approx(sum(v.nbytes for v in weights.values()) / 2**20) for mb in synced)
    # the engine serves the policy the 2 ranks train: the last sync's tokens scored by the learner agree
    assert rows[-1]["rollout/logp_abs_diff_mean"] < 1e-5
    # PeftModel.from_pretrained loads it, on the base it names, as the policy one process trained
    base = lora.base_of(ckpt)
    two = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(ckpt)).eval()
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(one / "checkpoints" / "step_2"))
    assert (logits(two, IDS) - logits(plain.eval(), IDS)).abs().max() < 1e-4


def test_one_fsdp2_rank_trains_the_plain_adapter_and_two_ranks_resume_it(small_run, tiny_model, tmp_path, monkeypatch):
    """``actor_worker.strategy: fsdp2`` on the trainer's one rank (a process group of one): the base sharded, the
    adapter alone in AdamW, the plain process's adapter; its step-1 checkpoint resumed on 2 ranks gives step 2's."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import load_file

    from tether.learner import fsdp
    from tether.pipeline.trainer import train

    built: list[Learner] = []
    real = fsdp.sharded_learner

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(fsdp, "sharded_learner", spy)  # what run_learner shards the one trainer rank with
    sets = ("model.lora.rank=8", "trainer.total_steps=2", "trainer.save_every=1", "trainer.deterministic=true")
    _, _, plain = small_run("plain", *sets)
    try:
        _, _, run_dir = small_run("fsdp2", *sets, "actor_worker.strategy=fsdp2")
        [learner] = built
        whole = Trainer(learner).whole_model()  # the merged copy (an evaluation engine's), gathered from the shards
        with learner.reference() as ref:  # the KL reference: the sharded policy with its adapter off is the base
            assert ref is learner.model
            off = (logits(ref, IDS) - logits(load_model_and_tokenizer(tiny_model)[0], IDS)).abs().max().item()
        on = (logits(learner.model, IDS) - logits(whole, IDS)).abs().max().item()  # and on again: the policy
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    ckpt = run_dir / "checkpoints" / "step_2"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(ckpt)).eval()
    assert not hasattr(whole, "peft_config") and (logits(whole, IDS) - logits(peft, IDS)).abs().max() < 1e-5
    print(f"1 fsdp2 rank: adapter off vs the base {off:.1e}; policy vs its merged copy {on:.1e}")
    assert off < 1e-6 and on < 1e-5
    assert fsdp.is_sharded(learner.model) and learner.ref_model is None and learner.lora_scaling == 32 / 8
    names = {id(p): n for n, p in learner.model.named_parameters()}
    assert all(".lora_" in names[id(p)] for p in learner.optimizer.params) and len(learner.optimizer.params) == 14

    def adapter(run: object, step: int) -> dict[str, torch.Tensor]:
        return load_file(tmp_path / str(run) / "checkpoints" / f"step_{step}" / "adapter_model.safetensors")

    straight, sharded = adapter(plain, 2), adapter(run_dir, 2)
    one_rank = max_diff(straight, sharded)
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_2")
    cfg = load_config([tmp_path / "small_run.yaml"], [f"model.path={tiny_model}", *sets, "actor_worker.strategy=fsdp2",
                                                      "resource_pool.trainer_pool.num_ranks=2"])
    train(cfg, resumed, resume=True, show_progress=False)
    two_ranks = max_diff(sharded, adapter(resumed, 2))
    print(f"1 fsdp2 rank vs 1 plain process: adapter max |Δ| {one_rank:.1e}; resumed on 2 ranks: {two_ranks:.1e}")
    assert one_rank < 1e-6 and two_ranks < 1e-5
    assert max_diff(sharded, adapter(run_dir, 1)) > 1e-6  # step 2 moved the adapter


@pytest.mark.slow
def test_two_fsdp2_ranks_in_the_ray_trainer_actor_sync_the_adapter_alone(cluster, tiny_model, tmp_path):
    """``backend: ray``, fully_async: the trainer actor's 2 ranks gather the adapter and the rollouter's engine merges
    it; each sync is the adapter's bytes in one bucket and the engine serves the trained policy."""
    from safetensors.torch import load_file

    from conftest import SMALL_RUN, read_rows
    from tether.distributed.ray_backend import train_on_ray

    (tmp_path / "small_run.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "small_run.yaml"], [
        f"model.path={tiny_model}", "backend=ray", "rollout.mode=fully_async", "rollout.scheduler.max_staleness=0",
        "trainer.total_steps=2", "trainer.save_every=2", "model.lora.rank=8", "policy_optimization.optimizer.lr=1e-2",
        "actor_worker.strategy=fsdp2", "resource_pool.trainer_pool.num_ranks=2"])
    train_on_ray(cfg, tmp_path / "run", show_progress=False)
    trained = [r for r in read_rows(tmp_path / "run")[1:] if "optim/loss" in r]
    weights = load_file(tmp_path / "run" / "checkpoints" / "step_2" / "adapter_model.safetensors")
    mb = sum(v.nbytes for v in weights.values()) / 2**20
    gaps = [r["rollout/logp_abs_diff_mean"] for r in trained]
    print(f"ray, 2 fsdp2 ranks: sync {[r['perf/weight_sync_mb'] for r in trained]} MiB (adapter {mb} MiB); "
          f"|Δ log π| engine vs learner {gaps}")
    assert len(trained) == 2 and all("perf/rank_imbalance" in r for r in trained)
    assert [r["perf/weight_sync_mb"] for r in trained] == [pytest.approx(mb)] * 2
    assert all(r["perf/weight_sync_buckets"] == 1 for r in trained)
    assert max(gaps) < 1e-5  # measured: 1.3e-7, 1.7e-7
