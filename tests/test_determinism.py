"""Same config and seed ⇒ same run: with ``trainer.deterministic`` two sync-mode runs on the CPU give identical
metrics, samples and weights, bit for bit; another seed gives another run; the async modes at staleness 0 give
the sync run itself (docs/determinism.md).

Without the switch two such runs differed in the last bits of the behaviour logprobs (5e-7; the sampled
tokens happened to agree) and so in the loss and the weights (1e-7 after these 3 steps), because which
requests share an engine step depends on thread and asyncio timing (see ``tether.engine.local``).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_RUN, read_rows

# Wall-clock measurements: they differ between any two runs, whatever the seed. Every other key must match.
WALL_CLOCK = {
    "perf/step_time", "perf/samples_per_s", "perf/tokens_per_s", "perf/rollout_time", "perf/weight_sync_s",
    "perf/engine_busy_s", "perf/trainer_idle_ratio", "perf/rollouter_idle_ratio",  # seconds and their ratios
    "perf/learner_overlap_s", "perf/learner_after_rollout_s", "rollout/group_time_s",
    "agent/generate_sequences", "agent/tool_calls", "agent/compute_score",  # seconds per episode in each stage
}


@pytest.fixture(scope="module")
def deterministic_run(tiny_model, tmp_path_factory):
    """``deterministic_run(name, *overrides)``: SMALL_RUN with ``trainer.deterministic=true``, once per name;
    returns (metrics rows without WALL_CLOCK, samples.jsonl text, final weights)."""
    from tether.config import load_config
    from tether.pipeline.trainer import train

    root = tmp_path_factory.mktemp("determinism")
    (root / "small_run.yaml").write_text(SMALL_RUN)
    done: dict[str, tuple] = {}

    def run(name: str, *overrides: str):
        if name not in done:
            cfg = load_config([root / "small_run.yaml"],
                              [f"model.path={tiny_model}", "trainer.deterministic=true", *overrides])
            train(cfg, root / name, show_progress=False)
            rows = [{k: v for k, v in row.items() if k not in WALL_CLOCK} for row in read_rows(root / name)]
            weights = load_file(root / name / "checkpoints" / "step_3" / "model.safetensors")
            done[name] = rows, (root / name / "samples.jsonl").read_text(), weights
        return done[name]

    return run


def assert_same_weights(wa, wb):
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, {k: (wa[k] - wb[k]).abs().max().item() for k in differ}


def test_two_sync_runs_with_one_seed_are_identical(deterministic_run):
    rows_a, samples_a, wa = deterministic_run("a", "rollout.mode=sync")
    rows_b, samples_b, wb = deterministic_run("b", "rollout.mode=sync")
    assert [r["step"] for r in rows_a] == [0, 1, 2, 3]
    for a, b in zip(rows_a, rows_b, strict=True):
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        assert not differ, (f"step {a['step']}: {differ} differ (a wall-clock timing belongs in WALL_CLOCK)",
                            {k: (a.get(k), b.get(k)) for k in differ})
    assert samples_a == samples_b
    assert_same_weights(wa, wb)


def test_another_seed_is_another_run(deterministic_run):
    rows_a, samples_a, wa = deterministic_run("a", "rollout.mode=sync")
    rows_c, samples_c, wc = deterministic_run("c", "rollout.mode=sync", "trainer.seed=4")
    assert samples_c != samples_a and rows_c != rows_a
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_fully_async_at_staleness_zero_is_the_sync_run_bit_for_bit(deterministic_run):
    """What the async modes guarantee instead: their run follows rollouter/trainer timing, except at staleness
    0, where it is the sync run (the same samples and weights; the queue and buffer metrics are its own)."""
    rows_a, samples_a, wa = deterministic_run("a", "rollout.mode=sync")
    rows_f, samples_f, wf = deterministic_run("f", "rollout.mode=fully_async", "rollout.scheduler.max_staleness=0")
    assert samples_f == samples_a
    assert_same_weights(wa, wf)
    for a, f in zip(rows_a[1:], rows_f[1:], strict=True):
        assert {k: a[k] for k in a if k.startswith(("optim/", "reward/"))} == \
               {k: f[k] for k in f if k.startswith(("optim/", "reward/"))}, a["step"]


# The overlap's timing: sync mode with the learner training each group beside the rollout (learner.overlap_rollout)
# and the episodes staggered (4 in flight), so that groups finish while others still generate.
OVERLAP = ("rollout.mode=sync", "learner.overlap_rollout=true", "policy_optimization.advantage.group_size=2",
           "learner.batch_size=16", "learner.mini_batch_size=16", "rollout.worker.max_concurrent_tasks=4")


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory) -> str:
    """The tiny model, 128 wide: at 32 its products are too small for MKL to split across threads, so its results do
    not depend on the thread count; at 128 a decode step's logprobs do (a few tokens in ten, by ~5e-7)."""
    from tether.env.customer_service import example_texts
    from tether.learner.model import build_tiny

    return build_tiny(tmp_path_factory.mktemp("wide") / "model", corpus=example_texts(100), num_hidden_layers=1,
                      hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow
def test_deterministic_runs_repeat_whatever_the_overlap_timing(wider_model, tmp_path, monkeypatch):
    """With the learner beside the rollout, which engine steps and which groups run while the other computes follows
    timing; each run here gets other random delays before the learner's groups and the engine's requests. Every run
    is the reference run bit for bit: the behaviour logprobs, the metrics (but wall-clock), the weights. Before the
    thread counts were pinned (tether.pipeline.streaming) the engine's logprobs changed with the delays."""
    from tether.config import load_config
    from tether.engine.local import LocalEngine
    from tether.learner.accumulate import Accumulation
    from tether.pipeline import streaming
    from tether.pipeline.trainer import train

    rng = random.Random(0)  # different delays for every run (the runs' own seed is fixed)
    add, generate, advantages = Accumulation.add_trajectories, LocalEngine.generate, streaming.StepUpdate.advantages

    def slow_add(self, *args):
        time.sleep(rng.random() * 0.05)
        return add(self, *args)

    async def slow_generate(self, *args):
        await asyncio.sleep(rng.random() * 0.02)
        return await generate(self, *args)

    logprobs: list[list[float]] = []

    def recorded(self, produced):
        trajs, adv = advantages(self, produced)
        logprobs.extend(t.logprobs for t in trajs)
        return trajs, adv

    monkeypatch.setattr(Accumulation, "add_trajectories", slow_add)
    monkeypatch.setattr(LocalEngine, "generate", slow_generate)
    monkeypatch.setattr(streaming.StepUpdate, "advantages", recorded)
    (tmp_path / "small_run.yaml").write_text(SMALL_RUN)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # every run alike: the engine and the learner get one each while both compute
    try:
        results = []
        for i in range(6):  # a reference and 5 more
            logprobs.clear()
            cfg = load_config([tmp_path / "small_run.yaml"],
                              [f"model.path={wider_model}", "trainer.deterministic=true", *OVERLAP])
            train(cfg, tmp_path / str(i), show_progress=False)
            rows = [{k: v for k, v in row.items() if k not in WALL_CLOCK and not k.startswith("perf/")}
                    for row in read_rows(tmp_path / str(i))]
            weights = load_file(tmp_path / str(i) / "checkpoints" / "step_3" / "model.safetensors")
            results.append((list(logprobs), rows, weights))
    finally:
        torch.set_num_threads(threads)
    (ref_logprobs, ref_rows, ref_weights), *others = results
    assert len(ref_logprobs) == 3 * 16 and [r["step"] for r in ref_rows] == [0, 1, 2, 3]
    assert sum(r["perf/learner_overlap_s"] for r in read_rows(tmp_path / "0")[1:]) > 0  # the learner overlapped
    for i, (lp, rows, weights) in enumerate(others, 1):
        differ = [k for k, (a, b) in enumerate(zip(ref_logprobs, lp, strict=True)) if a != b]
        assert not differ, f"run {i}: the behaviour logprobs of trajectories {differ} differ"
        for a, b in zip(ref_rows, rows, strict=True):
            assert a == b, (i, a["step"], {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys()
                                           if a.get(k) != b.get(k)})
        assert_same_weights(ref_weights, weights)
