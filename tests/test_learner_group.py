"""``LearnerGroup``: 2 trainer ranks (gloo; rank 1 a spawned process running ``follow``) train what 1 trains, through
the calls the pipeline makes — the demo's learner config and batch shape (8 groups × 8 trajectories; one update of
4 micro-batches, and in "minis" two updates of 4), 4 steps, each followed by the weight push
(``state_dict_for_engine``, ``worker.on_sync``), as ``Learner.train_step`` (shares balanced by padded tokens, and
consecutive) and as the streamed update (``begin_step``, a group at a time, ``finish_step``:
``learner.overlap_rollout``, the demo's path), then ``skip_step`` and ``unsharded_model``; a checkpoint saved and
resumed by the group; a rank that raises, and one that hangs.

The reference is the same group calls on one process: a ``LearnerGroup`` of one plain ``Learner``. Tolerances:
float32 summed in another order (each rank sums its share, then the shares are added): per-step loss, grad norm and
trained-token counts within 1e-5 relative; weights after the 4 steps within 1e-5 absolute (measured: see the
prints).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, learner_args, make_learner
from tether.config import RunConfig, load_config
from tether.learner import load_model_and_tokenizer
from tether.learner.group import LearnerGroup, RankError, follow
from tether.learner.ranks import Ranks, balanced_parts
from tether.learner.spawn import spawn_ranks
from tether.types import Trajectory

WORLD, STEPS, GROUPS, GROUP_SIZE = 2, 4, 8, 8
BUCKET_BYTES = 16 * 1024
DEMO = REPO / "examples" / "customer_service" / "config.yaml"
# (case, balanced shares, streamed update); the checkpoints: "streamed" saves after steps 2 and 4, "resumed"
# loads step 2's and trains steps 3 and 4
CASES = [("train_step", True, False), ("consecutive", False, False), ("streamed", True, True),
         ("resumed", True, True), ("minis", True, True)]
MINI = {"minis": 32}  # the case's learner.mini_batch_size (else the demo's 64): 2 updates a step, streamed


def demo_config(tiny: str, mini: int = 64) -> RunConfig:
    return load_config([DEMO], ["model.preset=null", f"model.path={tiny}", f"learner.mini_batch_size={mini}",
                                "learner.gradient_accumulation_steps=4",
                                "learner.off_policy_correction.proximal=step_start"])  # "minis": the kept copy


def batch(step: int, vocab: int) -> list[list[Trajectory]]:
    """Step ``step``'s groups in the demo's shape: a shared prompt per group, multi-turn responses of model tokens
    and tool tokens (mask 0) of varied lengths; behaviour logprobs near the tiny model's (filled in by ``behave``)."""
    rng = random.Random(step)
    groups = []
    for g in range(GROUPS):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(20, 40))]
        trajs = []
        for _ in range(GROUP_SIZE):
            mask: list[int] = []
            for _turn in range(rng.randint(1, 4)):
                mask += [1] * rng.randint(3, 24) + [0] * rng.randint(2, 16)
            mask += [1] * rng.randint(2, 8)
            trajs.append(Trajectory(task_id=f"s{step}g{g}", prompt_ids=prompt,
                                    response_ids=[rng.randrange(vocab) for _ in mask], response_mask=mask,
                                    logprobs=[0.0] * len(mask), versions=[step - 1 if m else -1 for m in mask],
                                    reward=float(rng.random() < 0.5)))
        groups.append(trajs)
    return groups


def behave(model: Any, groups: list[list[Trajectory]], step: int) -> None:
    """Behaviour logprobs: the initial model's, shifted by up to ±0.1 (an engine's numerics and staleness)."""
    rng = random.Random(1000 + step)
    with torch.no_grad():
        for t in (t for g in groups for t in g):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / 0.7, -1)  # T = engine.temperature
            own = logp.gather(1, ids[0, 1:, None])[:, 0][len(t.prompt_ids) - 1:].tolist()
            t.logprobs = [lp + rng.uniform(-0.1, 0.1) if m else 0.0 for lp, m in zip(own, t.response_mask)]


def advantages(group: list[Trajectory]) -> torch.Tensor:
    r = torch.tensor([t.reward for t in group])
    return (r - r.mean()) / (r.std() + 1e-6)


def run_case(group: LearnerGroup, case: str, batches: list[list[list[Trajectory]]], out: Path,
             streamed: bool | None = None) -> dict[str, Any]:
    """The case's steps through ``group`` as the pipeline calls it (``streamed``: None = the case's way); the metrics
    of each step and the final weights."""
    streamed = dict((c, s) for c, _, s in CASES)[case] if streamed is None else streamed
    first = 1
    if case == "resumed":
        extra = group.load_checkpoint(out / "streamed_step_2")
        first = extra["step"] + 1
    metrics = []
    for step in range(first, STEPS + 1):
        groups = batches[step - 1]
        if streamed:
            update = group.begin_step()
            for g in groups:
                update.add_trajectories(g, advantages(g))
            metrics.append(group.finish_step(update))
        else:
            trajs = [t for g in groups for t in g]
            metrics.append(group.train_step(trajs, torch.cat([advantages(g) for g in groups])))
        weights = group.state_dict_for_engine()  # the weight push after each step (sync mode)
        group.worker.on_sync(group.version)
        if case == "streamed" and step in (2, STEPS):
            group.save_checkpoint(out / f"streamed_step_{step}", None, {"step": step})
    buckets = list(group.weight_buckets(BUCKET_BYTES))  # what a weight sync under backend: ray gathers and sends
    if case == "train_step":  # a step whose groups were all dropped: counted on every rank
        group.skip_step()
    whole = {k: v.detach().clone() for k, v in group.unsharded_model().state_dict().items()}
    return {"metrics": metrics, "weights": weights, "whole": whole, "version": group.version,
            "describe": group.describe(), "buckets": buckets}


def _model(tiny: str) -> Any:
    model, _ = load_model_and_tokenizer(tiny)
    return model


def _sharded(tiny: str, ranks: Ranks, mini: int = 64) -> Any:
    from tether.learner.fsdp import sharded_learner

    return sharded_learner(_model(tiny), ranks, **learner_args(demo_config(tiny, mini)))


def _follower(ranks: Ranks, tiny: str, hang: bool) -> None:
    """Rank 1: one learner per case, each following rank 0's group until it closes; the last one fails at step 2."""
    torch.set_num_threads(1)
    if hang:  # stops answering inside its first step's update
        learner = _sharded(tiny, ranks)
        learner.optimizer.update = lambda **kw: time.sleep(120)  # type: ignore[method-assign]
        follow(learner)
        return
    for case, _, _ in CASES:
        follow(_sharded(tiny, ranks, MINI.get(case, 64)))
    learner = _sharded(tiny, ranks)
    update, calls = learner.optimizer.update, []

    def fails_at_step_2(**kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure on rank 1")
        return update(**kw)

    learner.optimizer.update = fails_at_step_2  # type: ignore[method-assign]
    follow(learner)


@pytest.fixture(scope="module")
def batches(tiny_model) -> list[list[list[Trajectory]]]:
    model = _model(tiny_model)
    out = []
    for step in range(1, STEPS + 1):
        groups = batch(step, model.config.vocab_size)
        behave(model, groups, step)
        out.append(groups)
    return out


@pytest.fixture(scope="module")
def two_ranks(tiny_model, batches, tmp_path_factory) -> dict[str, Any]:
    """Every case on 2 ranks (this process rank 0), then the failing step; rank 0's results."""
    out = tmp_path_factory.mktemp("two_ranks")
    t0 = time.perf_counter()
    spawned = spawn_ranks(WORLD, _follower, tiny_model, False, timeout_s=60)
    results: dict[str, Any] = {"start_s": time.perf_counter() - t0}
    try:
        for case, balanced, _ in CASES:
            t0 = time.perf_counter()
            learner = _sharded(tiny_model, spawned.ranks, MINI.get(case, 64))
            with LearnerGroup(learner, balanced=balanced, spawned=spawned) as group:
                results[case] = run_case(group, case, batches, out)
            results[case]["seconds"] = time.perf_counter() - t0
        group = LearnerGroup(_sharded(tiny_model, spawned.ranks), spawned=spawned)
        t0 = time.perf_counter()
        try:
            run_case(group, "train_step", batches, out)
        except RankError as e:
            results["error"] = e
        results["error_s"] = time.perf_counter() - t0
        with pytest.raises(RuntimeError, match="stopped at an earlier error"):
            group.train_step(batches[0][0], advantages(batches[0][0]))
    finally:
        results["exitcodes"] = spawned.close()
    results["out"] = out
    return results


@pytest.fixture(scope="module")
def one_rank(tiny_model, batches, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("one_rank")
    results = {}
    for case in ("train_step", "streamed"):
        group = LearnerGroup(make_learner(_model(tiny_model), demo_config(tiny_model)))
        assert group.ranks.world == 1 and group.streams
        results[case] = run_case(group, case, batches, out)
    # 2 updates a step, by train_step in one process: what "minis" streams on 2 ranks (π_prox of the groups after
    # the first update under the kept starting weights, each rank's shards)
    group = LearnerGroup(make_learner(_model(tiny_model), demo_config(tiny_model, MINI["minis"])))
    results["minis"] = run_case(group, "minis", batches, out, streamed=False)
    return results


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("case", ["train_step", "consecutive", "streamed", "minis"])
def test_two_ranks_train_the_steps_of_one(two_ranks, one_rank, tiny_model, case):
    ref = "train_step" if case == "consecutive" else case
    one, two = one_rank[ref], two_ranks[case]
    assert len(two["metrics"]) == STEPS
    assert (one["version"], two["version"]) == (STEPS + (ref == "train_step"), STEPS + (case == "train_step"))
    assert _worst(two["whole"], two["weights"]) == 0.0  # unsharded_model: the weights the engine got
    assert two["describe"].endswith("on 2 trainer ranks")
    for step, (m1, m2) in enumerate(zip(one["metrics"], two["metrics"]), 1):
        for name in ("optim/loss", "optim/grad_norm", "optim/trained_tokens"):
            assert m2[name] == pytest.approx(m1[name], rel=1e-5), (step, name, m1[name], m2[name])
        assert m1["optim/trained_tokens"] == sum(t.num_model_tokens for t in _step_trajs(step, tiny_model))
        assert m1["perf/rank_imbalance"] == 1.0 and m2["perf/rank_imbalance"] >= 1.0
    start = {k: v for k, v in _model(tiny_model).state_dict().items()}
    moved, worst = _worst(one["weights"], start), _worst(one["weights"], two["weights"])
    imbalance = sum(m["perf/rank_imbalance"] for m in two["metrics"]) / STEPS
    rel = {name: max(abs(m2[name] - m1[name]) / abs(m1[name]) for m1, m2 in zip(one["metrics"], two["metrics"]))
           for name in ("optim/loss", "optim/grad_norm")}
    print(f"{case}: weights moved up to {moved:.2e} in {STEPS} steps; 1 vs 2 ranks differ by {worst:.2e}; "
          f"loss, grad norm within {rel['optim/loss']:.1e}, {rel['optim/grad_norm']:.1e} relative; 2 ranks took "
          f"{two['seconds']:.1f} s (start {two_ranks['start_s']:.1f} s); rank imbalance {imbalance:.3f}")
    assert moved > 1e-4 and worst < 1e-5


def test_weight_buckets_gather_the_pushed_weights_a_bucket_at_a_time(two_ranks):
    """``weight_buckets``: one gather per bucket of at most BUCKET_BYTES (a larger tensor alone), together exactly
    the weights ``state_dict_for_engine`` gathers at once."""
    buckets, weights = two_ranks["streamed"]["buckets"], two_ranks["streamed"]["weights"]
    sizes = [sum(t.numel() * t.element_size() for t in b.values()) for b in buckets]
    assert len(buckets) > 2 and all(size <= BUCKET_BYTES or len(b) == 1 for size, b in zip(sizes, buckets))
    joined = {k: v for b in buckets for k, v in b.items()}
    assert list(joined) == list(weights) and _worst(joined, weights) == 0.0


def _step_trajs(step: int, tiny: str) -> list[Trajectory]:
    return [t for g in batch(step, _model(tiny).config.vocab_size) for t in g]


def test_balanced_shares_pad_less(two_ranks):
    """The same steps shared by padded tokens and in consecutive counts: the slowest share per micro-batch."""
    balanced = [m["perf/rank_imbalance"] for m in two_ranks["train_step"]["metrics"]]
    consecutive = [m["perf/rank_imbalance"] for m in two_ranks["consecutive"]["metrics"]]
    print(f"rank imbalance (slowest share / mean share, padded tokens): balanced {balanced}, "
          f"consecutive {consecutive}")
    assert all(b < c for b, c in zip(balanced, consecutive))


def test_a_checkpoint_of_two_ranks_resumes(two_ranks, one_rank):
    """The group's checkpoint holds whole weights (those it trained) and the optimizer state; a group of 2 ranks
    loaded from step 2 trains steps 3 and 4 to the weights of the run that did not stop."""
    from safetensors.torch import load_file

    saved = load_file(two_ranks["out"] / f"streamed_step_{STEPS}" / "model.safetensors")
    trained = two_ranks["streamed"]["weights"]
    assert _worst({k: trained[k] for k in saved}, saved) == 0.0
    state = torch.load(two_ranks["out"] / f"streamed_step_{STEPS}" / "trainer_state.pt", weights_only=True)
    assert state["version"] == STEPS and state["optimizer"]["optimizer"] is None  # the moments are in the shards
    shards = sorted(p.name for p in (two_ranks["out"] / f"streamed_step_{STEPS}" / "shards").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank: nothing gathered
    resumed = two_ranks["resumed"]
    assert len(resumed["metrics"]) == STEPS - 2 and resumed["version"] == STEPS
    assert _worst(resumed["weights"], trained) < 1e-6
    assert _worst(resumed["weights"], one_rank["streamed"]["weights"]) < 1e-5


def test_a_checkpoint_of_two_ranks_resumes_in_one_plain_process(two_ranks, one_rank, tiny_model, batches):
    """N → M: step 2's shards, saved by 2 ranks, loaded by a plain learner in this process (DCP without a process
    group), which trains steps 3 and 4 to where the run of 1 rank went: the AdamW moments came back too (without
    them, step 3's update would differ)."""
    group = LearnerGroup(make_learner(_model(tiny_model), demo_config(tiny_model)))
    resumed = run_case(group, "resumed", batches, two_ranks["out"])
    assert resumed["version"] == STEPS
    worst = _worst(resumed["weights"], one_rank["streamed"]["weights"])
    print(f"2 ranks' step-2 shards resumed in one process: steps 3-4 end within {worst:.1e} of the 1-rank run")
    assert worst < 1e-5


def test_a_rank_that_raises_is_one_error_naming_it(two_ranks):
    error = two_ranks["error"]
    print(f"rank 0 got, {two_ranks['error_s']:.1f} s into the case: {str(error).splitlines()[0]}")
    assert str(error).startswith("trainer rank 1 failed in train_step: rank 1: RuntimeError: injected failure")
    assert "\n" not in str(error)  # one line; rank 1's traceback goes with the error, as a note
    assert "--- trainer rank 1 ---" in error.__notes__[0] and "fails_at_step_2" in error.__notes__[0]
    assert two_ranks["error_s"] < 20
    assert two_ranks["exitcodes"] == {1: 1}


def test_a_rank_that_hangs_is_an_error_after_the_timeout(tiny_model, batches):
    """Rank 1 stops answering inside an update: rank 0's collective gives up after the process group's timeout."""
    spawned = spawn_ranks(WORLD, _follower, tiny_model, True, timeout_s=3)
    try:
        group = LearnerGroup(_sharded(tiny_model, spawned.ranks), spawned=spawned)
        t0 = time.perf_counter()
        with pytest.raises(RankError, match="trainer rank 1 failed in train_step: rank 1: no report") as info:
            trajs = [t for g in batches[0] for t in g]
            group.train_step(trajs, torch.cat([advantages(g) for g in batches[0]]))
        elapsed = time.perf_counter() - t0
    finally:
        spawned.close(grace_s=0)
    print(f"rank 0 gave up after {elapsed:.1f} s: {str(info.value).splitlines()[0]}")
    assert elapsed < 3 + 5 + 5  # the timeout, the wait for a report, the step itself


def test_balanced_parts_even_out_padded_tokens():
    """Lengths 100, 60, 60, 60, 50, 50, 40, 40 on 2 ranks: consecutive halves pad to 4×100 and 4×50 tokens; the
    balanced runs are [100, 60, 60] (3×100 = 300) and [60, 50, 50, 40, 40] (5×60 = 300)."""
    from tether.learner.batch import TrainBatch

    lengths = [100, 60, 60, 60, 50, 50, 40, 40]
    trajs = [Trajectory(task_id="t", prompt_ids=[1] * (n - 4), response_ids=[2] * 4, response_mask=[1] * 4,
                        logprobs=[-1.0] * 4, versions=[0] * 4) for n in lengths]
    mb = TrainBatch.from_trajectories(trajs, [0.0] * 8, pad_id=0)
    cost = [len(p) * p.input_ids.shape[1] for p, _ in balanced_parts(mb, 2)]
    assert cost == [300, 300]
    assert [len(p) * p.input_ids.shape[1] for p, _ in Ranks(0, 2).parts(mb)] == [400, 200]
    parts = balanced_parts(mb.slice(0, 1), 2)  # fewer trajectories than ranks: a weight-0 stand-in
    assert [w for _, w in parts] == [1.0, 0.0]
