"""Everything a training run is made of, built from a RunConfig — so that trainer.py is the loop only.

``Run.build`` assembles: model + engine + environments (``Runtime``), the learner, the task sampler, the
rollout allocator, the group producer and the batch source of ``rollout.mode``, the weight sync (the one
owner of the parameter version), the evaluator, the metric sinks and the progress display; and, with
``resume``, restores the last checkpoint. ``Run.close`` releases them in reverse.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tether.config import RunConfig
from tether.learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from tether.learner.learner import Learner
from tether.metrics import JsonlSink, MetricsRecorder, TensorBoardSink, WandbSink, record_metric, set_recorder
from tether.pipeline.evaluate import evaluate
from tether.pipeline.modes import BatchSource, make_source
from tether.pipeline.progress import Progress
from tether.pipeline.rollouter import Rollouter
from tether.pipeline.shaping import GroupProducer, RolloutAllocator
from tether.pipeline.weights import WeightSync
from tether.runtime import Runtime, local_engine
from tether.types import Task


class TaskSampler:
    """Endless shuffled epochs over the train tasks; ``batch(step)`` depends only on (seed, step)."""

    def __init__(self, tasks: list[Task], per_step: int, seed: int):
        if not tasks:
            raise ValueError("the environment has no train tasks")
        self.tasks, self.per_step, self.seed = tasks, per_step, seed

    def batch(self, step: int) -> list[Task]:
        n = len(self.tasks)
        out = []
        for k in range((step - 1) * self.per_step, step * self.per_step):
            epoch, i = divmod(k, n)
            order = random.Random(self.seed * 1_000_003 + epoch).sample(range(n), n)
            out.append(self.tasks[order[i]])
        return out


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the rows an interrupted run wrote after its last checkpoint."""
    if path.exists():
        rows = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= last_step]
        path.write_text("".join(r + "\n" for r in rows))


def make_sinks(cfg: RunConfig, run_dir: Path) -> list[Any]:
    sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl")]
    if cfg.metrics.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if cfg.metrics.wandb:
        sinks.append(WandbSink(cfg.metrics.wandb_project or "tether", cfg.redacted_dict()))
    return sinks


class Evaluator:
    """Held-out greedy evaluation, where ``trainer.use_trainer_do_validate`` puts it.

    true — the trainer validates its own weights: at step s the learner's current weights are loaded into
    an evaluation engine of their own (a second copy of the model), so the figure belongs to step s.
    false — the rollouter validates: the rollout engine's weights, i.e. those of the last weight sync
    (step ⌊s / trigger_parameter_sync_step⌋ · trigger_parameter_sync_step), with no extra copy.
    In ``sync`` mode weights are synced every step, so both evaluate the same weights. ``eval/weights_step``
    records which step's weights were evaluated.
    """

    def __init__(self, cfg: RunConfig, rt: Runtime, learner: Learner, weights: WeightSync):
        self.cfg, self.learner, self.weights = cfg, learner, weights
        self.tasks = rt.tasks("eval")[: cfg.trainer.eval_tasks or None]
        self.own_engine = cfg.trainer.use_trainer_do_validate and cfg.rollout.mode != "sync"
        self.engine = local_engine(cfg, learner.model) if self.own_engine else rt.engine
        loop = rt.loop(greedy=True) if not self.own_engine else _greedy_loop(rt, self.engine)
        self.rollouter = Rollouter(loop, rt.make_env, max_concurrent=cfg.rollout.worker.max_concurrent_tasks)

    def __call__(self, step: int) -> tuple[dict[str, float], list]:
        if self.own_engine:
            self.engine.update_weights(self.learner.state_dict_for_engine(), self.weights.version)
            weights_step = step
        else:
            weights_step = self.weights.version * self.weights.every if step else 0
        metrics, trajs = asyncio.run(evaluate(self.rollouter, self.tasks, seed=self.cfg.trainer.seed))
        return {**metrics, "eval/weights_step": float(weights_step)}, trajs

    def close(self) -> None:
        if self.own_engine:
            self.engine.close()


def _greedy_loop(rt: Runtime, engine: Any) -> Any:
    from tether.runtime import agent_loop

    return agent_loop(rt.cfg, engine, rt.tokenizer, greedy=True)


@dataclass
class Run:
    cfg: RunConfig
    run_dir: Path
    rt: Runtime
    learner: Learner
    sampler: TaskSampler
    allocator: RolloutAllocator
    weights: WeightSync
    source: BatchSource
    evaluate: Evaluator
    recorder: MetricsRecorder
    progress: Progress
    start: int = 0
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, model_dir: str | None = None,
              show_progress: bool = True) -> Run:
        run_dir = Path(run_dir)
        ckpt = latest_checkpoint(run_dir) if resume else None
        if resume and ckpt is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())  # secrets redacted by the dump
        torch.manual_seed(cfg.trainer.seed)
        rt = Runtime.build(cfg, model_dir)
        closers: list[Callable[[], None]] = [rt.close]
        try:
            learner = Learner(rt.model, None, cfg)
            derived = cfg.derived()
            sampler = TaskSampler(rt.tasks("train"), derived["prompts_per_step"], cfg.trainer.seed)
            allocator = RolloutAllocator(cfg, kinds={t.id: t.kind for t in sampler.tasks})
            start = 0
            if ckpt is not None:
                extra = load_checkpoint(ckpt, learner)
                start = int(extra["step"])
                allocator.load_state_dict(extra["allocator"])
                for name in ("metrics.jsonl", "samples.jsonl"):
                    _truncate_jsonl(run_dir / name, start)
            every = 1 if cfg.rollout.mode == "sync" else cfg.trainer.trigger_parameter_sync_step
            weights = WeightSync(rt.engine, learner, every, start_step=start)
            if ckpt is not None:
                weights.push()
            evaluator = Evaluator(cfg, rt, learner, weights)
            closers.append(evaluator.close)
            worker, anti = cfg.rollout.worker, cfg.environment.verifier.anti_hacking
            rollouter = Rollouter(rt.loop(), rt.make_env, max_concurrent=worker.max_concurrent_tasks,
                                  timeout_s=worker.task_timeout_s, retries=worker.retry_on_failure,
                                  reuse_policy=cfg.rollout.partial_rollout.reuse_policy,
                                  num_workers=worker.num_workers)
            source = make_source(cfg, GroupProducer(cfg, rollouter), sampler.batch, weights, start_step=start,
                                 sizes=allocator.sizes, max_concurrent=worker.max_concurrent_tasks,
                                 hacking_patterns=tuple(anti.detect_patterns if anti.enabled else ()))
            closers.append(source.close)
            recorder = MetricsRecorder(make_sinks(cfg, run_dir))
            closers.append(recorder.close)
            prev = set_recorder(recorder)
            closers.append(lambda: set_recorder(prev))
            progress = Progress(cfg.trainer.total_steps, start, enabled=show_progress)
            closers.append(progress.close)
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        run = cls(cfg, run_dir, rt, learner, sampler, allocator, weights, source, evaluator, recorder, progress,
                  start, closers)
        progress.note(f"{learner.describe()}; {derived['prompts_per_step']} tasks × "
                      f"{derived['group_size']} rollouts per step; rollout.mode {cfg.rollout.mode}")
        for warning in _config_warnings(cfg):
            progress.warn(warning)
        return run

    def eval(self, step: int) -> dict[str, float]:
        metrics, trajs = self.evaluate(step)
        for k, v in metrics.items():
            record_metric(k, v, "last")
        self.progress.eval_table(step, metrics, self.evaluate.tasks, trajs)
        return metrics

    def save(self, step: int) -> None:
        save_checkpoint(checkpoint_dir(self.run_dir, step), self.learner, self.rt.tokenizer,
                        extra={"step": step, "allocator": self.allocator.state_dict()})

    def log_samples(self, step: int, groups: list) -> None:
        with (self.run_dir / "samples.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "task_ids": [g.task_id for g in groups],
                                "group_sizes": [len(g.trajectories) for g in groups]}) + "\n")

    def close(self) -> None:
        for close in reversed(self._closers):
            close()


def _config_warnings(cfg: RunConfig) -> list[str]:
    warnings = getattr(cfg, "warnings", None)
    return list(warnings()) if callable(warnings) else []
