"""The training loop, top to bottom (the batch source differs per ``rollout.mode``, see modes.py):

    sample tasks → rollouts per task (agent loop + verifier) → diversity bonus → degenerate-group filter
    → group-relative advantages → learner update → new weights into the engine → metrics → (eval, checkpoint)

(shaping.py: the bonus, the filter and the rollout allocation.)

Steps are numbered from 1; held-out evaluation is logged at step 0 (before any update), every
``trainer.eval_every`` steps and at the end. The tasks of step s are a pure function of (seed, s), so a
resumed run trains exactly the batches the uninterrupted run would have, none twice.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.algo import group_advantages
from tether.config import RunConfig
from tether.learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from tether.learner.learner import Learner
from tether.metrics import JsonlSink, MetricsRecorder, TensorBoardSink, record_metric, set_recorder
from tether.pipeline.evaluate import evaluate
from tether.pipeline.progress import Progress
from tether.pipeline.modes import make_source
from tether.pipeline.rollouter import Rollouter
from tether.pipeline.shaping import DegenerateFilter, RolloutAllocator, add_diversity_bonus
from tether.runtime import Runtime
from tether.types import Group, Task


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


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    eval_before: dict[str, float]
    eval_after: dict[str, float]


def _advantages(cfg: RunConfig, groups: list[Group]) -> tuple[list, torch.Tensor]:
    adv_cfg = cfg.policy_optimization.advantage
    trajs = [t for g in groups for t in g.trajectories]
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    adv, m = group_advantages(rewards, group_sizes=[len(g.trajectories) for g in groups],
                              normalization=adv_cfg.normalization,
                              min_std=adv_cfg.degenerate_group_filter.min_reward_std)
    record_metric("optim/advantage_std", float(m["advantage_std"]))
    record_metric("optim/degenerate_group_ratio", float(m["degenerate_group_ratio"]))
    record_metric("optim/nonzero_advantage_ratio", float((adv.abs() > 1e-6).float().mean()))  # of trajectories
    return trajs, adv


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the rows an interrupted run wrote after its last checkpoint."""
    if path.exists():
        rows = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= last_step]
        path.write_text("".join(r + "\n" for r in rows))


def train(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, model_dir: str | None = None,
          show_progress: bool = True) -> RunResult:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())  # secrets redacted by the dump
    torch.manual_seed(cfg.trainer.seed)
    rt = Runtime.build(cfg, model_dir)
    learner = Learner(rt.model, None, cfg)
    group_size = cfg.policy_optimization.advantage.group_size
    derived = cfg.derived()
    sampler = TaskSampler(rt.tasks("train"), derived["prompts_per_step"], cfg.trainer.seed)
    eval_tasks = rt.tasks("eval")[: cfg.trainer.eval_tasks or None]
    anti = cfg.environment.verifier.anti_hacking
    hacking_patterns = anti.detect_patterns if anti.enabled else []
    worker = cfg.rollout.worker
    rollouter = Rollouter(rt.loop(), rt.make_env, max_concurrent=worker.max_concurrent_tasks,
                          timeout_s=worker.task_timeout_s, retries=worker.retry_on_failure,
                          reuse_policy=cfg.rollout.partial_rollout.reuse_policy, num_workers=worker.num_workers)
    evaluator = Rollouter(rt.loop(greedy=True), rt.make_env, max_concurrent=cfg.rollout.worker.max_concurrent_tasks)

    start = 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    po = cfg.policy_optimization
    allocator = RolloutAllocator(cfg, kinds={t.id: t.kind for t in sampler.tasks})
    bonus = po.exploration.diversity_bonus

    def shape(groups: list[Group]) -> None:
        if bonus.enabled and bonus.coef > 0:
            add_diversity_bonus(groups, bonus.coef)

    degenerate = None
    if po.advantage.degenerate_group_filter.enabled:
        degenerate = DegenerateFilter(cfg, rollouter, {t.id: t for t in sampler.tasks}, shape)
    if ckpt is not None:
        extra = load_checkpoint(ckpt, learner)
        start = int(extra["step"])
        allocator.load_state_dict(extra["allocator"])
        rt.engine.update_weights(learner.state_dict_for_engine(), learner.version)
        for name in ("metrics.jsonl", "samples.jsonl"):
            _truncate_jsonl(run_dir / name, start)

    sinks: list[Any] = [JsonlSink(run_dir / "metrics.jsonl")]
    if cfg.metrics.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    recorder = MetricsRecorder(sinks)
    prev_recorder = set_recorder(recorder)
    progress = Progress(cfg.trainer.total_steps, start, enabled=show_progress)
    progress.note(f"{learner.describe()}; {derived['prompts_per_step']} tasks × {group_size} rollouts per step")
    samples_log = (run_dir / "samples.jsonl").open("a")

    def run_eval(step: int) -> dict[str, float]:
        metrics, trajs = asyncio.run(evaluate(evaluator, eval_tasks, seed=cfg.trainer.seed))
        for k, v in metrics.items():
            record_metric(k, v, "last")
        progress.eval_table(step, metrics, eval_tasks, trajs)
        return metrics

    source = None
    try:
        eval_before = run_eval(0) if start == 0 else {}
        if start == 0:
            recorder.flush(0)
        eval_after = eval_before
        source = make_source(cfg, rollouter, sampler.batch, start_step=start, hacking_patterns=tuple(hacking_patterns),
                             sizes=allocator.sizes)
        sync_every = 1 if cfg.rollout.mode == "sync" else cfg.trainer.trigger_parameter_sync_step
        engine_stats = getattr(rt.engine, "stats", None)
        for step in range(start + 1, cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            busy = engine_stats["busy_s"] if engine_stats is not None else 0.0
            generated = source.next_batch(step)
            record_metric("rollout/generated_trajectories", sum(len(g.trajectories) for g in generated), "last")
            shape(generated)
            groups = degenerate(generated, step) if degenerate is not None else generated
            if groups:
                trajs, adv = _advantages(cfg, groups)
                learner.train_step(trajs, adv)  # records the optim/* metrics itself
            else:  # every group was degenerate, even resampled: nothing to learn from at this step
                trajs = []
                learner.version += 1
                record_metric("optim/empty_steps", 1, "sum")
            allocator.observe(groups, step)
            if step % sync_every == 0:
                rt.engine.update_weights(learner.state_dict_for_engine(), learner.version)
                source.on_weights(learner.version)
            record_metric("rollout/current_param_version", rt.engine.version, "last")
            if engine_stats is not None:  # the engine's compute time during this step (it shares the CPU/GPU)
                record_metric("perf/engine_busy_s", engine_stats["busy_s"] - busy, "last")
            elapsed = time.perf_counter() - t0
            record_metric("perf/step_time", elapsed, "last")
            record_metric("perf/samples_per_s", len(trajs) / elapsed, "last")
            record_metric("rollout/trained_trajectories", len(trajs), "last")
            record_metric("perf/trainer_idle_ratio", source.last_wait_s / elapsed, "last")
            if cfg.rollout.mode == "sync":  # the rollouter idles while the trainer trains
                record_metric("perf/rollouter_idle_ratio", 1.0 - source.last_wait_s / elapsed, "last")
            samples_log.write(json.dumps({"step": step, "task_ids": [g.task_id for g in groups],
                                          "group_sizes": [len(g.trajectories) for g in groups]}) + "\n")
            samples_log.flush()
            last = step == cfg.trainer.total_steps
            if last or (cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0):
                eval_after = run_eval(step)
            if last or (cfg.trainer.save_every and step % cfg.trainer.save_every == 0):
                save_checkpoint(checkpoint_dir(run_dir, step), learner, rt.tokenizer,
                                extra={"step": step, "allocator": allocator.state_dict()})
            progress.update(step, recorder.flush(step))
    finally:
        if source is not None:
            source.close()
        samples_log.close()
        progress.close()
        set_recorder(prev_recorder)
        recorder.close()
        rt.close()
    return RunResult(run_dir, cfg.trainer.total_steps, eval_before, eval_after)
