"""The actors of ``backend: ray``, as plain classes (``ray_backend`` wraps them with ``ray.remote``).

- ``RolloutWorker``: the rollouter's half that touches the model — a copy of the weights in the configured
  engine (``engine.type``), the environments, and two ``Rollouter``s (sampling, and greedy for held-out
  evaluation). It answers ``group`` / ``groups`` calls; the GroupProducer, admission control and the ledger
  stay with the trainer, so a group's identity and its exactly-once accounting never leave one process.
  What scores a finished episode runs here too, beside the episodes, as it runs beside them in the local
  backend: the LLM judge's reward loop (``verifier.judge: llm``: its workers, cache and the judge client's
  per-endpoint buckets and concurrency cap live in this process, which makes the run's judge calls — all of
  them unless the trainer evaluates its own weights, ``use_trainer_do_validate`` in the async modes) and the
  teacher (``teacher``: a local checkpoint loaded here, or a server). Not actors of their own: both already work
  off the generation path (async workers, the teacher's thread), so an actor would add a round trip per episode
  and a second restart story, and buy no concurrency; a restarted RolloutWorker builds both again from the
  config. (A teacher that needs a device of its own runs behind a server: ``teacher.remote``.) The trainer
  settles each group's judge failures by ``reward.on_judge_failure`` (``GroupProducer``, as locally). The judge's
  and the teacher's keys are read from the variables handed to the constructor (``env``).
- ``TrainerWorker``: runs ``tether.pipeline.trainer.train`` — the same loop as the local backend — with the
  remote parts (``remote.py``; the MessageQueue's actor, ``QueueWorker``, is started from there).

Metrics a RolloutWorker records (``rollout/episode_errors``, the judge's ``reward/judge_*`` and the like) are kept as
events and returned with each call's result, to be recorded again in the trainer, so a step's row is the same in
both backends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tether import heap
from tether.config import RunConfig
from tether.distributed.envvars import apply_env
from tether.distributed.remote import RayParts
from tether.distributed.weight_transfer import BucketLayout, WeightGroup, unpack_buckets
from tether.metrics import MetricsRecorder, set_recorder
from tether.pipeline.rollouter import Rollouter, RolloutError
from tether.pipeline.trainer import train
from tether.runtime import Runtime
from tether.teacher.scorer import make_teacher, score_trajectory
from tether.types import Task

Event = tuple[str, float, str]  # (metric, value, reduction)
T = TypeVar("T")


def env_present(names: list[str]) -> dict[str, bool]:
    """Which of ``names`` are set in this process's environment (names only: values never leave the actor)."""
    return {n: n in os.environ for n in names}


def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread of its own, waited for. An async actor's constructor runs inside the actor's event
    loop (Ray 2.60), where ``asyncio.run`` — a remote teacher's tokenizer probe in ``make_teacher`` — refuses to run."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tether-build") as pool:
        return pool.submit(fn, *args).result()


class EventLog(MetricsRecorder):
    """A recorder that keeps every ``record_metric`` call as an event until drained."""

    def __init__(self) -> None:
        super().__init__([])
        self._events: list[Event] = []
        self._events_lock = threading.Lock()

    def record(self, name: str, value: float, reduce: Any = "mean") -> None:
        with self._events_lock:
            self._events.append((name, float(value), str(reduce)))

    def drain(self) -> list[Event]:
        with self._events_lock:
            out, self._events = self._events, []
        return out


class RolloutWorker:
    def __init__(self, cfg: RunConfig, model_dir: str, env: dict[str, str]):
        apply_env(env)  # before anything reads a key or a TETHER_* variable
        self.events = EventLog()
        set_recorder(self.events)
        self.rt = Runtime.build(cfg, model_dir)
        self.rt.model = None  # the engine holds its own copy
        self.teacher = off_loop(make_teacher, cfg, self.rt.tokenizer)  # None: no teacher; tokenizer checked as locally
        score = None if self.teacher is None else functools.partial(score_trajectory, self.teacher)
        worker = cfg.rollout.worker
        self.rollouters = {  # the rollouters Run.build makes in the local backend (the judge's loop shared by both)
            False: Rollouter(self.rt.loop(), self.rt.make_env, max_concurrent=worker.max_concurrent_tasks,
                             timeout_s=worker.task_timeout_s, retries=worker.retry_on_failure,
                             reuse_policy=cfg.rollout.partial_rollout.reuse_policy, num_workers=worker.num_workers,
                             score=score, rewards=self.rt.rewards),
            True: Rollouter(self.rt.loop(greedy=True), self.rt.make_env, max_concurrent=worker.max_concurrent_tasks,
                            rewards=self.rt.rewards),
        }
        self.token, self.version = 0, 0  # token 0: the weights of the model folder (weight_transfer.py)
        self.in_flight = 0
        self._update_lock = asyncio.Lock()
        self.weights_group: WeightGroup | None = None  # ray.weight_transfer nccl: the broadcast group with the trainer
        self.loads: Counter[str] = Counter()  # weight loads by path: object_store, broadcast
        self._unfreeze = heap.freeze()  # the actor's engine, environments and tokenizer (tether.heap), as in Run.build

    async def group(self, token: int, task: Task, size: int, seed: int) -> tuple[str, Any, list[Event]]:
        """("ok", Group, events), ("failed", (message, cause), events) or ("behind", token held, [])."""
        return await self._call(token, self.rollouters[False].group(task, size, seed))

    async def groups(self, token: int, greedy: bool, tasks: list[Task], sizes: int | list[int], seed: int,
                     keep_failed: bool) -> tuple[str, Any, list[Event]]:
        return await self._call(token, self.rollouters[greedy].groups(tasks, sizes, seed, keep_failed=keep_failed))

    async def _call(self, token: int, work: Any) -> tuple[str, Any, list[Event]]:
        if token != self.token:  # restarted, or a push has not arrived: the trainer sends the latest first
            work.close()
            return "behind", self.token, []
        self.in_flight += 1
        try:
            return "ok", await work, self.events.drain()
        except RolloutError as e:  # returned, not raised: the trainer re-raises it as the pipeline expects
            return "failed", (str(e), e.cause), self.events.drain()
        finally:
            self.in_flight -= 1

    async def update_weights(self, token: int, version: int, refs: list[Any]) -> int:
        """Load push ``token`` (its buckets' object refs) unless a push as new is held; returns the token held."""
        async with self._update_lock:
            if token > self.token:
                buckets = await asyncio.gather(*refs)
                await self._load(unpack_buckets(list(buckets)), token, version, "object_store")
        return self.token

    async def update_adapter(self, token: int, version: int, refs: list[Any], scaling: float) -> int:
        """``model.lora``: load push ``token``, a LoRA adapter (its buckets' object refs: A and B by layer name),
        merged with ``scaling`` into the engine's base weights, unless a push as new is held; returns the token held."""
        engine = self.rt.engine
        if not hasattr(engine, "update_adapter"):
            raise RuntimeError(f"model.lora: the rollouter's engine ({type(engine).__name__}, engine.type = "
                               f"{self.rt.cfg.engine.type}) cannot serve a LoRA adapter; use engine.type: local")
        async with self._update_lock:
            if token > self.token:
                adapter = unpack_buckets(list(await asyncio.gather(*refs)))
                await asyncio.to_thread(engine.update_adapter, adapter, scaling, version)
                self._loaded(token, version, "object_store")
        return self.token

    def weight_group(self) -> tuple[str | None, bool]:
        """The broadcast group this incarnation is in (None: none yet), and whether it has a GPU (NCCL)."""
        return (self.weights_group.name if self.weights_group is not None else None), torch.cuda.is_available()

    async def join_weight_group(self, host: str, port: int, name: str, backend: str, timeout_s: float) -> None:
        """Join the trainer's group ``name`` as rank 1 (off the event loop: it returns once both are in)."""
        group = await asyncio.to_thread(WeightGroup.join, host, port, name, backend, timeout_s)
        if self.weights_group is not None:
            self.weights_group.close()
        self.weights_group = group

    async def receive_weights(self, token: int, version: int, group: str, layouts: list[BucketLayout]) -> int:
        """Receive push ``token``, which the trainer broadcasts in ``group`` as laid out by ``layouts`` — always,
        or the broadcast would hang — and load it unless a push as new is held; returns the token held."""
        if self.weights_group is None or self.weights_group.name != group:
            held = self.weights_group.name if self.weights_group is not None else None
            raise RuntimeError(f"weights broadcast in group {group!r}, but this actor is in group {held!r}")
        async with self._update_lock:
            state_dict = await asyncio.to_thread(self.weights_group.receive, layouts)
            if token > self.token:
                await self._load(state_dict, token, version, "broadcast")
        return self.token

    async def _load(self, state_dict: dict[str, torch.Tensor], token: int, version: int, path: str) -> None:
        await asyncio.to_thread(self.rt.engine.update_weights, state_dict, version)
        self._loaded(token, version, path)

    def _loaded(self, token: int, version: int, path: str) -> None:
        self.token, self.version = token, version
        self.loads[path] += 1

    def stats(self) -> Counter[str]:
        """The engine's counters (``busy_s``, tokens, …) and this actor's: weights token and version, calls in
        flight, pid. A Counter, as the engine's: a count not made yet reads 0."""
        return Counter({**self.rt.engine.stats, "token": self.token, "version": self.version,
                        "in_flight": self.in_flight, "pid": os.getpid(),
                        **{f"weight_loads_{path}": n for path, n in self.loads.items()}})

    def env_present(self, names: list[str]) -> dict[str, bool]:
        return env_present(names)

    def close(self) -> None:
        if self.weights_group is not None:
            self.weights_group.close()
        if self.teacher is not None:
            self.teacher.close()
        self.rt.close()
        self._unfreeze()


class TrainerWorker:
    def __init__(self, cfg: RunConfig, model_dir: str, rollout: Any, queue_options: dict[str, Any],
                 env: dict[str, str]):
        apply_env(env)
        self.cfg, self.model_dir, self.rollout, self.queue_options = cfg, model_dir, rollout, queue_options

    def train(self, run_dir: str, resume: bool, show_progress: bool, allow_config_change: tuple[str, ...]) -> Any:
        parts = RayParts(self.cfg.ray, self.rollout, self.queue_options)
        return train(self.cfg, run_dir, resume=resume, model_dir=self.model_dir, show_progress=show_progress,
                     allow_config_change=allow_config_change, parts=parts)

    def env_present(self, names: list[str]) -> dict[str, bool]:
        return env_present(names)
