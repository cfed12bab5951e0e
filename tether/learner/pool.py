"""The run's trainer: one learner, or ``resource_pool.trainer_pool.num_ranks`` ranks training one model together.

    trainer = start_trainer(model, model_dir, spec, num_ranks=2)   # rank 0 here, rank 1 spawned
    trainer.learner.train_step(...)                                # what the pipeline calls: a Learner or a group
    trainer.save(path, tokenizer, extra); trainer.load(path); trainer.whole_model()
    trainer.close()

One rank (the default): ``spec.build`` — the plain ``Learner`` or, with ``actor_worker.strategy: fsdp2``, FSDP2 over
a process group of one — and nothing else changes. N ranks: this process is rank 0 (the pipeline, the engine and
the metrics live here) and ``tether.learner.spawn.spawn_ranks`` starts ranks 1..N-1 on this machine, each loading the
model from ``model_dir`` and following rank 0's ``LearnerGroup`` (``tether.learner.group``) until the trainer
closes. Under ``backend: ray`` the same happens inside the trainer actor, so the ranks share its node and GPUs (rank
r on GPU r). A launcher that starts every rank itself (torchrun; one Ray actor per rank across nodes) is not used: a
multi-node trainer is not built.

Threads: on CPUs each rank gets an equal part of the machine's cores (``TETHER_THREADS`` overrides), rank 0 its own
as before (``tether.threads``). A rank that dies ends the step with one ``RankError`` naming it (the run then fails
naming its last checkpoint, and ``--resume`` continues, with any number of ranks: checkpoints hold whole weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.config.actor import ActorWorkerConfig
from tether.config.policy import PolicyOptimConfig
from tether.config.sections import LearnerConfig, LoraConfig
from tether.config.teacher import TeacherConfig
from tether.learner import fsdp
from tether.learner.checkpoint import load_checkpoint, save_checkpoint
from tether.learner.group import LearnerGroup, follow
from tether.learner.learner import Learner
from tether.learner.model import load_model_and_tokenizer, torch_dtype
from tether.learner.ranks import Ranks
from tether.learner.spawn import DEFAULT_TIMEOUT_S, Spawned, spawn_ranks
from tether.threads import available_cores, fixed_threads


@dataclass(frozen=True)
class LearnerSpec:
    """What every rank builds its learner from (pickled to the spawned ranks)."""

    lc: LearnerConfig
    po: PolicyOptimConfig
    actor_worker: ActorWorkerConfig
    temperature: float
    max_response_tokens: int
    teacher: TeacherConfig | None = None
    dtype: str = "float32"  # model.dtype: the forward and backward's; every rank's master weights are float32
    lora: LoraConfig | None = None  # model.lora: the model is wrapped with a trainable adapter, its base frozen

    def build(self, model: Any, ranks: Ranks | None = None) -> Learner:
        """This rank's learner: ``fsdp.run_learner`` for one rank, sharded over ``ranks`` for several; ``model``: its
        float32 master weights (wrapped in place with the adapter of ``lora``: ``tether.learner.lora.wrap``)."""
        if self.lora is not None:
            from tether.learner import lora  # noqa: PLC0415 — peft, with model.lora only

            model = lora.wrap(model, self.lora)
        kwargs: dict[str, Any] = dict(temperature=self.temperature, max_response_tokens=self.max_response_tokens,
                                      teacher=self.teacher)
        dtype = torch_dtype(self.dtype)
        if ranks is None or not ranks.sharded:
            return fsdp.run_learner(model, self.lc, self.po, self.actor_worker, compute_dtype=dtype, **kwargs)
        return fsdp.sharded_learner(model, ranks, self.lc, self.po, worker=self.actor_worker.class_,
                                    param_dtype=dtype, **kwargs)


class Trainer:
    """The run's learner (``learner``: a ``Learner``, or a ``LearnerGroup`` over several ranks) and what needs the
    whole weights of it: checkpoints and a plain copy of the model."""

    def __init__(self, learner: Learner | LearnerGroup, spawned: Spawned | None = None):
        self.learner, self.spawned = learner, spawned

    @property
    def num_ranks(self) -> int:
        return self.learner.ranks.world

    def save(self, path: str | Path, tokenizer: Any, extra: dict[str, Any]) -> None:
        if isinstance(self.learner, LearnerGroup):
            self.learner.save_checkpoint(path, tokenizer, extra)
        else:
            save_checkpoint(path, self.learner, tokenizer, extra)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint (saved with any number of ranks) on every rank; returns its ``extra``."""
        if isinstance(self.learner, LearnerGroup):
            return self.learner.load_checkpoint(path)
        return load_checkpoint(path, self.learner)

    def whole_model(self) -> Any:
        """The trained weights in a plain model (a collective over the ranks when sharded; with ``model.lora`` the
        adapter merged into a copy)."""
        if isinstance(self.learner, LearnerGroup):
            return self.learner.unsharded_model()
        if self.learner.lora_scaling is not None:  # model.lora: a plain copy with the adapter merged in
            from tether.learner import lora  # noqa: PLC0415 — peft, with model.lora only

            return lora.merged_copy(self.learner.model)
        return fsdp.unsharded(self.learner.model)

    def pids(self) -> dict[int, int]:
        """Rank → process id (rank 0: this process)."""
        return {0: os.getpid(), **{r: p.pid for r, p in enumerate(self.spawned.processes, 1)
                                   if p.pid is not None}} if self.spawned else {0: os.getpid()}

    def close(self) -> None:
        if isinstance(self.learner, LearnerGroup):
            self.learner.close()  # ranks 1..N-1 return from follow (after an error they have left already)
        if self.spawned is not None:
            self.spawned.close()


def start_trainer(model: Any, model_dir: str, spec: LearnerSpec, *, num_ranks: int = 1,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> Trainer:
    """The run's trainer of ``num_ranks`` ranks; ``model``: rank 0's (loaded from ``model_dir``, which the other
    ranks load too)."""
    if num_ranks == 1:
        return Trainer(spec.build(model))
    if num_ranks > 1 and spec.actor_worker.strategy not in fsdp.STRATEGIES:
        raise ValueError(f"resource_pool.trainer_pool.num_ranks = {num_ranks} needs actor_worker.strategy: fsdp2")
    if torch.cuda.is_available() and num_ranks > torch.cuda.device_count():
        raise ValueError(f"resource_pool.trainer_pool.num_ranks = {num_ranks} is more than the "
                         f"{torch.cuda.device_count()} GPU(s) this trainer sees (one rank per GPU)")
    threads = rank_threads(num_ranks)
    spawned = spawn_ranks(num_ranks, _follow_rank, model_dir, spec, threads, timeout_s=timeout_s)
    try:
        group = LearnerGroup(spec.build(model, spawned.ranks), timeout_s=timeout_s, spawned=spawned)
    except BaseException:
        spawned.close(grace_s=5.0)
        raise
    return Trainer(group, spawned)


def rank_threads(num_ranks: int) -> int:
    """Torch threads of each spawned rank on CPUs: ``TETHER_THREADS``, else an equal part of the cores."""
    return fixed_threads() or max(1, available_cores() // num_ranks)


def _follow_rank(ranks: Ranks, model_dir: str, spec: LearnerSpec, threads: int) -> None:
    """A spawned rank: load the model, build its learner, run rank 0's commands until the trainer closes."""
    torch.set_num_threads(threads)
    model, _ = load_model_and_tokenizer(model_dir, "float32")  # master weights; spec.dtype is the compute's
    follow(spec.build(model, ranks))
