"""FSDP2 (``actor_worker.strategy: fsdp2``): the tiny model sharded over 2 CPU ranks (gloo) computes what one
unsharded process computes — the loss and the gradients of an update, and the parameters after whole trainer
steps (the tether loss with π_prox, KL to a sharded reference and entropy, AdamW, clipping).

The ranks are forked from the test process (the model and the trajectories are inherited, nothing is imported
again) and write rank 0's results to a file; the reference runs here, in one process, unsharded.

Tolerances: float32 with the sums taken in another order (each rank sums its share, then the shares are added).
The first update: loss within 1e-5 relative, gradients within 1e-5 of the largest gradient entry (measured:
~6e-9 of 0.03). After two steps (four AdamW updates of lr 1e-3; the weights move by up to 4e-3) the parameters
within 1e-5 absolute (measured: ~1.6e-6): Adam divides each gradient entry by its own running RMS, so an entry
near zero whose last bits differ moves its weight by a visibly different fraction of lr. The step metrics that
average later updates (small values once the policy has moved: the grad norm, the KL of ~1e-5) within 1e-3
relative.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import random
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from conftest import learner_args, make_learner
from tether.config import RunConfig
from tether.learner import load_model_and_tokenizer
from tether.learner.learner import Learner
from tether.learner.ranks import Ranks, full_tensor
from tether.types import Trajectory

WORLD = 2

BASE: dict[str, Any] = {
    "learner": {"batch_size": 8, "mini_batch_size": 4, "gradient_accumulation_steps": 2, "update_frequency": 1,
                "off_policy_correction": {"method": "double_sided_importance_sampling", "clip_ratio": 0.2,
                                          "tis_enabled": True}},
    "policy_optimization": {
        "algorithm": "grpo_variant", "advantage": {"group_size": 4},
        "exploration": {"entropy_coef": 0.01, "clip_higher": 0.28},
        "kl_control": {"type": "relative_entropy", "init_coef": 0.05, "adaptive": False},
        "optimizer": {"lr": 1e-3, "warmup_steps": 0, "max_grad_norm": 1.0}},
}
# (name, overrides): the first is the one whose update's loss and gradients are compared
CASES: list[tuple[str, dict[str, Any]]] = [
    ("clip_kl_entropy", {}),
    # micro-batches of one trajectory: rank 1 has nothing of its own and takes part with a weight-0 stand-in
    ("one_trajectory_micro_batches", {"learner": {"gradient_accumulation_steps": 4}}),
    # π_prox from weights kept in CPU memory (DetachActorWorker restores this rank's shards)
    ("detach_worker", {"actor_worker": {"class": "DetachActorWorker"}}),
    # a per-sequence aggregation (the denominator counts sequences) and two passes over the batch
    ("seq_mean_two_epochs", {"learner": {"update_frequency": 2},
                             "policy_optimization": {"loss_agg_mode": "seq_mean_token_mean"}}),
]
STEPS = 2


def merged(overrides: dict[str, Any]) -> RunConfig:
    def merge(a: dict, b: dict) -> dict:
        out = copy.deepcopy(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    return RunConfig.model_validate(merge(BASE, overrides))


def run_args(cfg: RunConfig) -> dict[str, Any]:
    """``run_learner``'s arguments after the model, from ``cfg``, as ``Run.build`` hands them."""
    args = learner_args(cfg)
    del args["worker"]
    return {**args, "actor_worker": cfg.actor_worker}


def trajectories(vocab: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(8):
        mask = [1] * rng.randint(2, 6) + [0] * rng.randint(0, 3) + [1] * rng.randint(1, 5)
        out.append(Trajectory(
            task_id=f"t{i // 4}", prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(3, 7))],
            response_ids=[rng.randrange(vocab) for _ in mask], response_mask=mask,
            logprobs=[-rng.uniform(2.0, 9.0) if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask]))
    return out


ADVANTAGES = [1.5, -1.0, 0.5, -1.0, 2.0, -0.5, -0.5, -1.0]


def run_case(learner: Learner, trajs: list[Trajectory]) -> dict[str, Any]:
    """STEPS trainer steps; the first update's loss and (whole) gradients, then the parameters."""
    first: dict[str, Any] = {}
    update = learner.optimizer.update

    def capture(**kwargs: Any):
        if not first:  # every rank gathers (a collective), in the same order
            first["grads"] = {n: full_tensor(p.grad).detach().clone() for n, p in learner.model.named_parameters()}
        return update(**kwargs)

    learner.optimizer.update = capture  # type: ignore[method-assign]
    metrics = [learner.train_step(trajs, ADVANTAGES) for _ in range(STEPS)]
    first["metrics"] = metrics
    first["params"] = {n: full_tensor(p).detach().clone() for n, p in learner.model.named_parameters()}
    return first


def _rank(rank: int, port: int, model: torch.nn.Module, trajs: list[Trajectory], out: str) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from tether.learner.fsdp import init_ranks, sharded_learner

        ranks = init_ranks("gloo")
        results = {}
        for name, overrides in CASES:
            torch.manual_seed(0)
            learner = sharded_learner(copy.deepcopy(model), ranks, **learner_args(merged(overrides)))
            assert type(next(learner.model.parameters())).__name__ == "DTensor"
            shard = next(learner.model.parameters()).to_local()
            results[name] = run_case(learner, trajs)
            results[name]["shard_rows"] = shard.shape[0]
        if rank == 0:
            torch.save(results, out)
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(f"{out}.rank{rank}.error").write_text(traceback.format_exc())
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model(tiny_model):
    model, _ = load_model_and_tokenizer(tiny_model)
    return model


@pytest.fixture(scope="module")
def sharded(model, tmp_path_factory) -> dict[str, Any]:
    """Every case on 2 forked gloo ranks; rank 0's results."""
    out = str(tmp_path_factory.mktemp("fsdp2") / "rank0.pt")
    trajs = trajectories(model.config.vocab_size)
    ctx = multiprocessing.get_context("fork")  # inherit the imports: a spawned rank would import torch again
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, model, trajs, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    errors = "\n".join(Path(f"{out}.rank{r}.error").read_text() for r in range(WORLD)
                       if Path(f"{out}.rank{r}.error").exists())
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not errors and all(p.exitcode == 0 for p in procs), errors or [p.exitcode for p in procs]
    return torch.load(out, weights_only=False)


def single(model: torch.nn.Module, overrides: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    learner = make_learner(copy.deepcopy(model), merged(overrides))
    assert learner.ranks == Ranks()
    return run_case(learner, trajectories(model.config.vocab_size))


def test_two_ranks_give_the_loss_and_gradients_of_one(model, sharded):
    one, two = single(model, CASES[0][1]), sharded[CASES[0][0]]
    assert two["shard_rows"] < max(p.shape[0] for p in one["params"].values())  # each rank holds a part
    loss1, loss2 = one["metrics"][0]["optim/loss"], two["metrics"][0]["optim/loss"]
    assert loss2 == pytest.approx(loss1, rel=1e-5)
    assert one["grads"].keys() == two["grads"].keys()
    scale = max(g.abs().max().item() for g in one["grads"].values())
    worst = max((one["grads"][n] - two["grads"][n]).abs().max().item() for n in one["grads"])
    print(f"1 vs 2 ranks: loss {loss1:.8f} vs {loss2:.8f}; largest gradient difference {worst:.2e} "
          f"(largest gradient entry {scale:.3f})")
    assert scale > 1e-3 and worst <= 1e-5 * scale
    for name in ("optim/entropy", "optim/is_ratio_mean"):
        assert two["metrics"][0][name] == pytest.approx(one["metrics"][0][name], rel=1e-5), name
    for name in ("optim/grad_norm", "optim/kl_divergence"):  # small after the first update (KL ~1e-5)
        assert two["metrics"][0][name] == pytest.approx(one["metrics"][0][name], rel=1e-3), name


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_two_ranks_train_the_steps_of_one(model, sharded, case):
    one, two = single(model, dict(CASES)[case]), sharded[case]
    start = {n: p.detach() for n, p in model.named_parameters()}
    moved = max((one["params"][n] - start[n]).abs().max().item() for n in start)
    worst = max((one["params"][n] - two["params"][n]).abs().max().item() for n in start)
    print(f"{case}: after {STEPS} steps the parameters moved up to {moved:.2e}; 1 vs 2 ranks differ by {worst:.2e}")
    assert moved > 1e-3 and worst < 1e-5
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        assert m2["optim/loss"] == pytest.approx(m1["optim/loss"], rel=1e-4, abs=1e-6)


# ----------------------------------------------------------------------------- in a run


def test_a_run_with_fsdp2_trains_what_a_plain_run_does_and_resumes(tiny_model, tmp_path, monkeypatch):
    """``actor_worker.strategy: fsdp2`` in a real run: the trainer's model is sharded (a group of one rank in this
    process), and the run trains the weights a plain run trains (to the tolerance above); its checkpoint holds
    whole weights that ``from_pretrained`` loads, and a run resumed from step 1 ends where the unbroken one did."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import load_file

    from conftest import SMALL_RUN
    from tether.config import load_config
    from tether.learner import fsdp
    from tether.pipeline.trainer import train

    learners: list[Learner] = []  # the learner each run built

    def spy(*args, **kwargs):
        learners.append(build_learner(*args, **kwargs))
        return learners[-1]

    build_learner = fsdp.run_learner
    monkeypatch.setattr(fsdp, "run_learner", spy)  # what tether.learner.pool builds one trainer rank with

    (tmp_path / "run.yaml").write_text(SMALL_RUN)

    def cfg(strategy: str):
        return load_config([tmp_path / "run.yaml"], [f"model.path={tiny_model}", "trainer.total_steps=2",
                                                     "trainer.save_every=1", f"actor_worker.strategy={strategy}"])

    def weights(run_dir: Path) -> dict[str, torch.Tensor]:
        return load_file(run_dir / "checkpoints" / "step_2" / "model.safetensors")

    try:
        train(cfg("none"), tmp_path / "none", show_progress=False)
        train(cfg("fsdp2"), tmp_path / "fsdp2", show_progress=False)
        assert dist.is_initialized() and dist.get_world_size() == 1
        shutil.copytree(tmp_path / "fsdp2", tmp_path / "resumed")
        shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_2")
        train(cfg("fsdp2"), tmp_path / "resumed", resume=True, show_progress=False)
        assert [isinstance(learner.model, FSDPModule) for learner in learners] == [False, True, True]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    plain, sharded, resumed = weights(tmp_path / "none"), weights(tmp_path / "fsdp2"), weights(tmp_path / "resumed")
    start, _ = load_model_and_tokenizer(tiny_model)
    moved = max((plain[k] - start.state_dict()[k]).abs().max().item() for k in plain)
    worst = max((plain[k] - sharded[k]).abs().max().item() for k in plain)
    print(f"run: weights moved up to {moved:.2e}; fsdp2 vs none differ by {worst:.2e}")
    assert moved > 1e-4 and worst < 1e-5
    assert max((sharded[k] - resumed[k]).abs().max().item() for k in sharded) < 1e-6
    reloaded, _ = load_model_and_tokenizer(tmp_path / "fsdp2" / "checkpoints" / "step_2")
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"


def test_detach_worker_restores_the_shards(sharded):
    """The detach_worker case held π_prox at the initial weights (its shards restored on each rank): it trained
    other weights than the same case with π_prox moving every step."""
    held, moving = sharded["detach_worker"]["params"], sharded["clip_kl_entropy"]["params"]
    assert max((held[n] - moving[n]).abs().max().item() for n in held) > 1e-5


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])  # fsdp is the same strategy
def test_a_run_refuses_several_trainer_ranks(model, monkeypatch, strategy):
    """A run starts its trainer ranks itself (``resource_pool.trainer_pool.num_ranks``): launched under torchrun
    with WORLD_SIZE=2 it says so before any group starts (every rank would roll out its own batches)."""
    from tether.learner.fsdp import run_learner

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=f"actor_worker.strategy: {strategy} with WORLD_SIZE=2"):
        run_learner(copy.deepcopy(model), **run_args(merged({"actor_worker": {"strategy": strategy}})))
    assert isinstance(run_learner(copy.deepcopy(model), **run_args(merged({}))).model, type(model))  # none: no group
