"""The training loop, top to bottom. What a run is made of is built in build.py; where a step's groups come
from (sync or a background rollouter) in modes.py; how a group is produced (rollouts, diversity bonus,
degenerate-group resampling) in shaping.py.

    next batch → group-relative advantages → learner update → weight sync when due → monitors → log / eval / save

(the learner update starts while the batch is generated, in sync mode, or while the trainer waits for it, in the
async modes: each group is trained as it finishes, ``streaming.py``).

Steps are numbered from 1; held-out evaluation is logged at step 0 (before any update), every
``trainer.eval_every`` steps and at the end. The tasks of step s are a pure function of (seed, s), so a
resumed run trains exactly the batches the uninterrupted run would have, none twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tether.config import RunConfig
from tether.metrics import record_metric
from tether.pipeline.build import RemoteParts, Run
from tether.pipeline.faults import fault
from tether.pipeline.monitors import MonitorStop
from tether.pipeline.preemption import Preempted, PreemptionGuard
from tether.pipeline.shaping import no_signal_warning
from tether.pipeline.streaming import StepUpdate, mark_load
from tether.warmstart.tiny_sft import ENVIRONMENT as TINY_SFT_ENVIRONMENT


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    eval_before: dict[str, float]
    eval_after: dict[str, float]


def train(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, model_dir: str | None = None,
          show_progress: bool = True, allow_config_change: tuple[str, ...] = (), parts: RemoteParts | None = None
          ) -> RunResult:
    """``parts``: the pieces in other actors under ``backend: ray`` (``tether.distributed``); None = this process."""
    run = Run.build(cfg, run_dir, resume=resume, model_dir=model_dir, show_progress=show_progress,
                    allow_config_change=allow_config_change, parts=parts)
    tr, monitors = cfg.trainer, run.monitors
    tiny_sft_applies = cfg.environment.name == TINY_SFT_ENVIRONMENT  # the preset warm-starts that one only
    with run, PreemptionGuard() as stop:
        mark_load()  # the first step's thread count from the load since now, not a 0.2 s sample at its start
        eval_before = run.eval(0) if run.start == 0 else {}
        if run.start == 0:
            run.recorder.flush(0)
        eval_after = eval_before
        for step in range(run.start + 1, tr.total_steps + 1):
            t0, busy = time.perf_counter(), run.rt.engine.stats["busy_s"]
            # each group trained as it finishes (sync mode) or as it is taken (async modes): learner.overlap_rollout
            with StepUpdate(run.learner, cfg.policy_optimization.advantage, mode=run.plan.mode,
                            overlap_rollout=cfg.learner.overlap_rollout, ordered=run.plan.deterministic,
                            engine_threads=run.engine_threads) as update:
                batch = run.source.next_batch(step, on_group=update.offer if update.overlap else None)
                fault("batch", step)
                if (warning := no_signal_warning(batch.produced, step, preset_hint=tiny_sft_applies)) is not None:
                    run.progress.warn(warning)
                trajs, adv = update.advantages(batch.produced)  # each group's once (a streamed one's as it trained)
                if not update.train(batch.produced, trajs, adv):  # records the optim/* metrics
                    run.learner.skip_step()  # every group was dropped by the degenerate-group filter
            run.allocator.observe(batch.groups, step)
            run.sampler.observe(batch.produced, step)
            fault("update", step)
            run.weights.after_step(step)
            fault("sync", step)
            step_metrics(run, time.perf_counter() - t0, busy, batch.wait_s, len(trajs))
            last = step == tr.total_steps
            if last or _due(tr.eval_every, step):
                eval_after = run.eval(step)
                fault("eval", step)
            run.log_samples(step, batch.produced)
            findings = monitors.observe(step, run.recorder.peek(), [p.group for p in batch.produced])
            for finding in findings:
                run.progress.warn(str(finding))
            halt = bool(findings) and monitors.stop
            run.progress.update(step, run.recorder.flush(step))  # the row first: a checkpoint never lacks its row
            fault("metrics", step)
            if last or _due(tr.save_every, step) or stop.requested or halt:
                run.save(step)
                fault("save", step)
            if stop.requested and not last:
                raise Preempted(stop.requested.name, stop.requested.value, step, str(run.checkpoint(step)))
            if halt and not last:
                raise MonitorStop(findings, step, str(run.checkpoint(step)))
    return RunResult(run.run_dir, tr.total_steps, eval_before, eval_after)


def _due(every: int, step: int) -> bool:
    return bool(every) and step % every == 0


def step_metrics(run: Run, elapsed: float, engine_busy_before: float, wait_s: float, trained: int) -> None:
    """The perf/ and rollout/ bookkeeping of one step."""
    record_metric("rollout/current_param_version", run.weights.version, "last")
    record_metric("perf/engine_busy_s", run.rt.engine.stats["busy_s"] - engine_busy_before, "last")
    record_metric("perf/step_time", elapsed, "last")
    record_metric("perf/samples_per_s", trained / elapsed, "last")
    record_metric("rollout/trained_trajectories", trained, "last")
    record_metric("perf/trainer_idle_ratio", wait_s / elapsed, "last")
    if run.plan.mode == "sync":  # the rollouter idles while the trainer trains
        record_metric("perf/rollouter_idle_ratio", 1.0 - wait_s / elapsed, "last")
