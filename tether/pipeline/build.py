"""Everything a training run is made of, built from a RunConfig — so that trainer.py is the loop only.

``Run.build`` assembles: model + engine + environments (``Runtime``), the learner, the task sampler, the
rollout allocator, the group producer and the batch source of ``rollout.mode``, the weight sync (the one
owner of the parameter version), the evaluator, the metric sinks and the progress display; and, with
``resume``, restores the last checkpoint. ``Run.close`` releases them in reverse.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from tether import heap
from tether.config import RunConfig
from tether.config.cluster import trainer_ranks
from tether.config.plan import Plan
from tether.engine.local import LocalEngine
from tether.learner.checkpoint import checkpoint_dir
from tether.learner.group import LearnerGroup
from tether.learner.learner import Learner
from tether.learner.model import torch_dtype
from tether.learner.pool import LearnerSpec, Trainer, start_trainer
from tether.metrics import MetricsRecorder, make_sinks, record_metric, set_recorder
from tether.pipeline.evaluate import evaluate
from tether.pipeline.modes import BatchSource, make_source
from tether.pipeline.monitors import Monitors, checks
from tether.pipeline.progress import Progress, log_to_file
from tether.pipeline.resume import NO_CHECKPOINT_YET, check_run_dir, resume_jsonl
from tether.pipeline.rollouter import Rollouter
from tether.pipeline.run_lock import RunLock
from tether.pipeline.shaping import GroupProducer, RolloutAllocator
from tether.pipeline.streaming import overlaps
from tether.pipeline.tasks import TaskSampler
from tether.pipeline.validation import drop_validation_after, write_validation
from tether.pipeline.weights import WeightSync
from tether.runtime import Runtime, agent_loop, local_engine, model_path
from tether.teacher.scorer import make_teacher, score_trajectory
from tether.types import Task


class RemoteParts(Protocol):
    """The pieces that run in other processes under ``backend: ray`` (``tether.distributed.remote.RayParts``):
    a handle on the rollout engine, rollouters (the judge's reward loop and the teacher run with their episodes;
    ``rewards``: the loop that settles the groups here) and the MessageQueue. None (the local backend): built here."""

    def engine(self) -> Any: ...

    def rollouter(self, *, greedy: bool = False, rewards: Any = None, teacher: bool = False) -> Any: ...

    def make_queue(self, max_size: int, window_size: int | None, max_hold_s: float | None) -> Any: ...


class Evaluator:
    """Held-out greedy evaluation, where ``trainer.use_trainer_do_validate`` puts it.

    true — the trainer validates its own weights: at step s the learner's current weights are loaded into
    an evaluation engine of their own (a second copy of the model), so the figure belongs to step s.
    false — the rollouter validates: the rollout engine's weights, i.e. those of the last weight sync
    (step ⌊s / trigger_parameter_sync_step⌋ · trigger_parameter_sync_step), with no extra copy.
    In ``sync`` mode weights are synced every step, so both evaluate the same weights. ``eval/weights_step``
    records which step's weights were evaluated.
    """

    def __init__(self, tasks: list[Task], rollouter: Any, learner: Learner | LearnerGroup, weights: WeightSync, *,
                 seed: int,
                 engine: LocalEngine | None = None):
        """``rollouter``: runs the greedy episodes; ``engine``: the evaluator's own engine (true above: loaded with
        the learner's weights at each evaluation, and closed with the evaluator), None: the rollout engine's."""
        self.tasks, self.rollouter, self.learner, self.weights, self.seed = tasks, rollouter, learner, weights, seed
        self.engine = engine

    def __call__(self, step: int) -> tuple[dict[str, float], list]:
        if self.engine is not None:
            self.engine.update_weights(self.learner.state_dict_for_engine(self.weights.dtype), self.weights.version)
            weights_step = step
        else:
            weights_step = self.weights.version * self.weights.every if step else 0
        metrics, trajs = asyncio.run(evaluate(self.rollouter, self.tasks, seed=self.seed))
        return {**metrics, "eval/weights_step": float(weights_step)}, trajs

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _evaluator(cfg: RunConfig, plan: Plan, rt: Runtime, trainer: Trainer, weights: WeightSync,
               remote: Any = None) -> Evaluator:
    """The evaluator ``trainer.use_trainer_do_validate`` asks for; ``remote``: the rollout engine's actor evaluates
    (``backend: ray``) when the trainer does not validate its own weights."""
    tasks = rt.tasks("eval")[: plan.eval_tasks]
    if cfg.trainer.use_trainer_do_validate and plan.mode != "sync":
        engine = local_engine(trainer.whole_model(), plan, cfg.engine, cfg.rollout.partial_rollout)
        loop = agent_loop(cfg, engine, rt.tokenizer, greedy=True, window=rt.window)
        rollouter = Rollouter(loop, rt.make_env, max_concurrent=cfg.rollout.worker.max_concurrent_tasks,
                              rewards=rt.rewards)
        return Evaluator(tasks, rollouter, trainer.learner, weights, seed=plan.seed, engine=engine)
    rollouter = remote if remote is not None else Rollouter(
        rt.loop(greedy=True), rt.make_env, max_concurrent=cfg.rollout.worker.max_concurrent_tasks, rewards=rt.rewards)
    return Evaluator(tasks, rollouter, trainer.learner, weights, seed=plan.seed)


@dataclass
class Run:
    cfg: RunConfig
    plan: Plan
    run_dir: Path
    rt: Runtime
    trainer: Trainer  # its ``learner``: a Learner, or a LearnerGroup over resource_pool.trainer_pool.num_ranks ranks
    sampler: TaskSampler
    allocator: RolloutAllocator
    weights: WeightSync
    source: BatchSource
    evaluate: Evaluator
    recorder: MetricsRecorder
    progress: Progress
    monitors: Monitors
    start: int = 0
    _closers: list[Callable[[], object]] = field(default_factory=list)
    engine_threads: Callable[[int], object] | None = None  # the local engine's torch threads (StepUpdate shares them)

    @classmethod
    def build(cls, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, model_dir: str | None = None,
              show_progress: bool = True, allow_config_change: tuple[str, ...] = (),
              parts: RemoteParts | None = None) -> Run:
        run_dir = Path(run_dir)
        lock = RunLock(run_dir).acquire()  # one run per directory, until close: first, before any check or write
        notes, resumed_from_start = [lock.warning] if lock.warning else [], False
        try:
            ckpt = check_run_dir(cfg.redacted_dict(), run_dir, resume, allow_config_change)
            if ckpt is not None:  # before the config is written: a damaged log must not cost the run's config
                numbered = re.fullmatch(r"step_(\d+)", ckpt.name)
                assert numbered is not None  # check_run_dir returns a step_N folder
                step = int(numbered.group(1))
                logs = {} if ckpt is NO_CHECKPOINT_YET else {  # both checked before either is rewritten
                    run_dir / name: resume_jsonl(run_dir / name, first, step, allow_config_change)
                    for name, first in (("metrics.jsonl", 0), ("samples.jsonl", 1))}
                drop_validation_after(run_dir, step)  # the evaluations the resumed run makes again, or may not
                for path, (warnings, text) in logs.items():
                    notes += warnings
                    if text is not None:
                        path.write_text(text, encoding="utf-8")
                if ckpt is NO_CHECKPOINT_YET:  # nothing to keep, not even step 0's evaluation: it runs again
                    notes.append(f"{run_dir} has no checkpoint yet: the run starts again from step 0")
                    for name in ("metrics.jsonl", "samples.jsonl"):
                        (run_dir / name).unlink(missing_ok=True)
                    ckpt, resumed_from_start = None, True
            (run_dir / "config.yaml").write_text(cfg.to_yaml())  # secrets redacted by the dump
            for leftover in (run_dir / "checkpoints").glob(".tmp-step_*") if resume else ():
                shutil.rmtree(leftover, ignore_errors=True)  # a save cut short by the interruption
        except BaseException:
            lock.release(remove_created=True)  # refused: a directory made for the lock goes again
            raise
        plan, po = Plan.of(cfg), cfg.policy_optimization
        torch.manual_seed(plan.seed)
        closers: list[Callable[[], object]] = [lock.release, log_to_file(run_dir / "train.log")]
        try:
            model_dir = model_dir or model_path(cfg)  # a preset is built once, here: the trainer's ranks load it too
            rt = Runtime.build(cfg, model_dir, engine=parts.engine() if parts is not None else None)
            closers.append(rt.close)
            spec = LearnerSpec(cfg.learner, po, cfg.actor_worker, temperature=cfg.engine.temperature,
                               max_response_tokens=plan.max_response_tokens, teacher=cfg.teacher, dtype=plan.dtype,
                               lora=cfg.model.lora)
            trainer = start_trainer(rt.model, model_dir, spec, num_ranks=trainer_ranks(cfg))  # plain, FSDP2, N ranks
            closers.append(trainer.close)
            learner = trainer.learner
            # engine and learner compute at once: each on half the threads for the step (tether.pipeline.streaming)
            overlap = overlaps(learner, po.advantage.normalization, overlap_rollout=cfg.learner.overlap_rollout,
                               mode=plan.mode, ordered=plan.deterministic)
            engine_threads = rt.engine.set_num_threads if isinstance(rt.engine, LocalEngine) and overlap else None
            sampler = TaskSampler(rt.tasks("train"), plan.prompts_per_step, plan.seed, po.task_selection)
            allocator = RolloutAllocator(po.rollout_allocation, plan.group_size,
                                         kinds={t.id: t.kind for t in sampler.tasks})
            start, extra = 0, {}
            if ckpt is not None:
                extra = trainer.load(ckpt)
                start = int(extra["step"])
                allocator.load_state_dict(extra["allocator"])
                sampler.load_state_dict(extra.get("sampler"))
            weights = WeightSync(rt.engine, learner, plan.sync_every, start_step=start, dtype=torch_dtype(plan.dtype))
            # DetachActorWorker keeps the pushed weights: π_prox for the steps until the next sync
            weights.subscribe(learner.on_push)  # and the learner knows which version its weights are
            if ckpt is not None:
                weights.push()
            evaluator = _evaluator(cfg, plan, rt, trainer, weights,
                                   remote=parts.rollouter(greedy=True) if parts is not None else None)
            closers.append(evaluator.close)
            # the teacher loop, its tokenizer checked (None: no teacher; under ray it runs in the rollouter actor)
            teacher = make_teacher(cfg, rt.tokenizer) if parts is None else None
            if teacher is not None:
                closers.append(teacher.close)
            worker, anti = cfg.rollout.worker, cfg.environment.verifier.anti_hacking
            rollouter = Rollouter(rt.loop(), rt.make_env, max_concurrent=worker.max_concurrent_tasks,
                                  timeout_s=worker.task_timeout_s, retries=worker.retry_on_failure,
                                  reuse_policy=cfg.rollout.partial_rollout.reuse_policy,
                                  num_workers=worker.num_workers,
                                  score=None if teacher is None else functools.partial(score_trajectory, teacher),
                                  rewards=rt.rewards)
            if parts is not None:  # backend: ray — the episodes, their judge and teacher run in the rollouter actor
                rollouter = parts.rollouter(rewards=rt.rewards, teacher=cfg.teacher.enabled)  # rewards: settles here
            resume_step = start if ckpt is not None else (-1 if resumed_from_start else None)
            m = cfg.metrics
            recorder = MetricsRecorder(make_sinks(run_dir, tensorboard=m.tensorboard, wandb=m.wandb,
                                                  wandb_project=m.wandb_project, config=cfg.redacted_dict(),
                                                  resume_step=resume_step))
            monitors = Monitors(cfg.monitors, checks(cfg.monitors, po, parser=cfg.tool_parser.name,
                                                     max_staleness=plan.max_staleness))
            closers.append(recorder.close)
            prev = set_recorder(recorder)
            closers.append(lambda: set_recorder(prev))
            new_task = po.advantage.degenerate_group_filter.resample == "new_task"
            producer = GroupProducer(rollouter, po, seed=plan.seed, sync=plan.mode == "sync",
                                     replacement=sampler.replacement if new_task else None)
            source = make_source(plan, producer, sampler.batch, weights, start_step=start, sizes=allocator.sizes,
                                 buffer=cfg.buffer, replay_buffer_size=cfg.rollout.partial_rollout.replay_buffer_size,
                                 normalization=po.advantage.normalization,
                                 hacking_patterns=tuple(anti.detect_patterns if anti.enabled else ()),
                                 state=extra.get("source"), make_queue=parts.make_queue if parts is not None else None)
            closers.append(source.close)
            progress = Progress(cfg.trainer.total_steps, start, enabled=show_progress)
            closers.append(progress.close)
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        closers.append(heap.freeze())  # what the run built stays out of the collector's full passes until it closes
        run = cls(cfg, plan, run_dir, rt, trainer, sampler, allocator, weights, source, evaluator, recorder, progress,
                  monitors, start, closers, engine_threads)
        progress.note(f"{learner.describe()}; {plan.prompts_per_step} tasks × "
                      f"{plan.group_size} rollouts per step; rollout.mode {plan.mode}")
        if trainer.num_ranks > 1:  # where to look when a rank stops answering
            progress.note("trainer ranks: " + ", ".join(f"rank {r} pid {pid}" for r, pid in trainer.pids().items()))
        for warning in cfg.warnings():
            progress.warn(warning)
        for note in notes:
            progress.warn(note)
        return run

    def eval(self, step: int) -> dict[str, float]:
        metrics, trajs = self.evaluate(step)
        write_validation(self.run_dir, step, self.evaluate.tasks, trajs)  # RUN/validation/step_N.jsonl
        for k, v in metrics.items():
            record_metric(k, v, "last")
        self.progress.eval_table(f"step {step}", metrics, self.evaluate.tasks, trajs)
        return metrics

    def checkpoint(self, step: int) -> Path:
        return checkpoint_dir(self.run_dir, step)

    @property
    def learner(self) -> Learner | LearnerGroup:
        return self.trainer.learner

    def save(self, step: int) -> None:
        self.trainer.save(self.checkpoint(step), self.rt.tokenizer,
                          extra={"step": step, "allocator": self.allocator.state_dict(),
                                 "sampler": self.sampler.state_dict(), "source": self.source.state_dict()})

    def log_samples(self, step: int, produced: list) -> None:
        """One row per step: the trained groups' tasks, sizes and names (task step, index) — and the dropped."""
        trained = [p for p in produced if not p.dropped]
        row = {"step": step, "task_ids": [p.group.task_id for p in trained],
               "group_sizes": [len(p.group.trajectories) for p in trained],
               "groups": [[p.step, p.index] for p in trained],
               "dropped": [[p.step, p.index] for p in produced if p.dropped]}
        with (self.run_dir / "samples.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        for close in reversed(self._closers):
            close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

