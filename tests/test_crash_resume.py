"""Crash safety: kill -9 at seven points of a step (``tether.pipeline.faults``, ``TETHER_FAULT=POINT@STEP``) in each
rollout mode, resume, and check that nothing was lost or repeated.

Each run is a forked child of the test process (the real ``train`` entry point, SIGKILLed by the fault hook; the
fork saves the interpreter start-up). Checked after the resume:

- metrics.jsonl and samples.jsonl hold steps [0..N] / [1..N], each once; TensorBoard shows each step once;
- every group (task step, index) is trained at most once; in sync mode every step trains exactly the groups of
  the uninterrupted run; in the async modes the run trains as many groups as the uninterrupted one, and what
  was queued or in flight at the kill is made again and counted (``rollout/regenerated_after_resume``);
- the queue counters continue across the resume and produced = consumed + dropped + stale + queued on every row.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from conftest import SMALL_RUN, read_rows

STEPS = 4
CRASH_RUN = SMALL_RUN + f"""
trainer: {{total_steps: {STEPS}, eval_every: 2, save_every: 2, seed: 3, trigger_parameter_sync_step: 1, eval_tasks: 2}}
engine: {{max_tokens: 8, temperature: 1.0}}
"""
MODES = {"sync": ["rollout.mode=sync"],
         "one_step_off_policy": ["rollout.mode=one_step_off_policy", "rollout.scheduler.max_staleness=1"],
         "fully_async": ["rollout.mode=fully_async", "rollout.scheduler.max_staleness=2",
                         "buffer.stale_filter.max_policy_lag=2"]}
POINTS = ["batch@3", "update@3", "sync@3", "eval@2", "metrics@2", "save@2", "produce@3"]


def _child(cfg_path: str, overrides: list[str], run_dir: str, resume: bool, fault: str | None) -> None:
    if fault:
        os.environ["TETHER_FAULT"] = fault
    else:
        os.environ.pop("TETHER_FAULT", None)
    from tether.config import load_config
    from tether.pipeline.trainer import train

    train(load_config([cfg_path], overrides), run_dir, resume=resume, show_progress=False)


def run(cfg_path: Path, overrides: list[str], run_dir: Path, *, resume: bool = False, fault: str | None = None) -> int:
    p = multiprocessing.get_context("fork").Process(target=_child, args=(str(cfg_path), overrides, str(run_dir),
                                                                          resume, fault))
    p.start()
    p.join(300)
    assert p.exitcode is not None, "run did not finish in 300 s"
    return p.exitcode


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    (root / "cfg.yaml").write_text(CRASH_RUN)
    return root, [f"model.path={tiny_model}"]


@pytest.fixture(scope="module")
def baselines(setup):
    root, base = setup
    out = {}
    for mode, over in MODES.items():
        assert run(root / "cfg.yaml", base + over, root / f"clean-{mode}") == 0
        out[mode] = read_rows(root / f"clean-{mode}", "samples.jsonl")
    return out


def tensorboard_steps(run_dir: Path, tag: str = "reward/mean") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("point", POINTS)
def test_kill_and_resume_loses_and_repeats_nothing(setup, baselines, mode, point):
    root, base = setup
    overrides = base + MODES[mode] + ["metrics.tensorboard=true"]
    run_dir = root / f"{mode}-{point.replace('@', '-')}"
    assert run(root / "cfg.yaml", overrides, run_dir, fault=point) == -9  # SIGKILL
    assert run(root / "cfg.yaml", overrides, run_dir, resume=True) == 0

    rows, samples = read_rows(run_dir), read_rows(run_dir, "samples.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert [s["step"] for s in samples] == list(range(1, STEPS + 1))
    assert tensorboard_steps(run_dir) == list(range(1, STEPS + 1))

    trained = [tuple(g) for s in samples for g in s["groups"] + s["dropped"]]
    assert len(trained) == len(set(trained)), f"a group trained twice: {trained}"
    clean = baselines[mode]
    if mode == "sync":  # the plan is a pure function of the step: identical batches
        assert [s["groups"] for s in samples] == [s["groups"] for s in clean]
        assert [s["task_ids"] for s in samples] == [s["task_ids"] for s in clean]
    else:  # timing decides which groups a step takes; never more, never fewer, never twice
        assert len(trained) == sum(len(s["groups"]) + len(s["dropped"]) for s in clean)
        for r in rows[1:]:
            assert r["queue/total_produced"] == (r["queue/total_consumed"] + r["queue/dropped_samples"]
                                                 + r["queue/stale_samples"] + r["queue/queued_samples"]), r
        produced = [r["queue/total_produced"] for r in rows[1:]]
        assert produced == sorted(produced)  # the counters continue across the resume
        assert rows[-1]["queue/total_consumed"] == sum(len(s["groups"]) + len(s["dropped"]) for s in samples) * 4
