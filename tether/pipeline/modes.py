"""Where the trainer's batches come from, per ``rollout.mode``. One Rollouter, one MessageQueue, one trainer.

- ``sync``: the batch of step s is generated when the trainer asks for it, with the current weights.
- ``one_step_off_policy``: a background rollouter may run one parameter version ahead (batch s+1 is
  generated while step s trains); the bound is ``min(1, rollout.scheduler.max_staleness)``.
- ``fully_async``: the background rollouter runs up to ``max_staleness`` versions ahead (admission
  control); finished groups wait in the MessageQueue, are consumed in ``windowed_fifo`` order, and groups
  older than ``buffer.stale_filter.max_policy_lag`` are dropped at consumption.

Every group of step s is generated from the same tasks and seeds in every mode, so with staleness 0 the
async modes reproduce ``sync`` exactly (tests/test_modes.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable, Protocol

from tether.config import RunConfig
from tether.metrics import record_metric
from tether.pipeline.buffer import ReplayBuffer
from tether.pipeline.queue import MessageQueue, QueuedGroup
from tether.pipeline.rollouter import RolloutError, Rollouter, record_rollout_metrics
from tether.pipeline.scheduler import window_for
from tether.pipeline.staleness import AdmissionController, stale_filter, version_lag_stats
from tether.types import Group, Task

log = logging.getLogger(__name__)

Sizes = Callable[[list[Task]], list[int]]  # rollouts per task of a step (rollout_allocation)


class BatchSource(Protocol):
    last_wait_s: float  # how long the last next_batch call waited for rollouts

    def next_batch(self, step: int) -> list[Group]:
        """The ``prompts_per_step`` groups the trainer trains on at ``step``."""

    def on_weights(self, version: int) -> None:
        """The engine now generates with parameter ``version`` (called after every weight push)."""

    def close(self) -> None: ...


def step_seed(seed: int, step: int) -> int:
    return seed * 100_003 + step


class SyncSource:
    def __init__(self, rollouter: Rollouter, batch_tasks: Callable[[int], list[Task]], sizes: Sizes, seed: int,
                 hacking_patterns: tuple[str, ...] = (), start_step: int = 0):
        self.rollouter, self.batch_tasks, self.sizes, self.seed = rollouter, batch_tasks, sizes, seed
        self.hacking_patterns = hacking_patterns
        self.version = start_step
        self.last_wait_s = 0.0

    def next_batch(self, step: int) -> list[Group]:
        t = time.perf_counter()
        tasks = self.batch_tasks(step)
        groups = asyncio.run(self.rollouter.groups(tasks, self.sizes(tasks), step_seed(self.seed, step)))
        elapsed = time.perf_counter() - t
        trajs = [tr for g in groups for tr in g.trajectories]
        record_rollout_metrics(trajs, elapsed, self.hacking_patterns)
        for k, v in version_lag_stats(trajs, self.version).items():
            record_metric(k, v, "last")
        self.last_wait_s = elapsed  # the trainer waits for the whole rollout
        return groups

    def on_weights(self, version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass


class AsyncSource:
    """A rollouter running in a background thread (its own event loop), feeding the MessageQueue."""

    def __init__(self, cfg: RunConfig, rollouter: Rollouter, batch_tasks: Callable[[int], list[Task]],
                 sizes: Sizes, group_size: int, groups_per_step: int, *, start_step: int, max_staleness: int,
                 hacking_patterns: tuple[str, ...] = ()):
        self.rollouter, self.batch_tasks, self.sizes, self.group_size = rollouter, batch_tasks, sizes, group_size
        self.groups_per_step, self.seed = groups_per_step, cfg.trainer.seed
        # the trainer takes trainer.require_batches queue batches of trainer.ppo_mini_batch_size samples per step
        self.groups_per_take = max(1, cfg.trainer.ppo_mini_batch_size // group_size)
        self.hacking_patterns = hacking_patterns
        self.max_policy_lag = cfg.buffer.stale_filter.max_policy_lag if cfg.buffer.stale_filter.enabled else None
        self.sync_every = cfg.trainer.trigger_parameter_sync_step
        sched = cfg.rollout.scheduler
        self.queue_capacity = cfg.message_queue.max_queue_size
        self.queue = MessageQueue(self.queue_capacity, window_for(sched.type, sched.window_size))
        buf = cfg.buffer
        self.buffer = None if buf.type == "fifo" else ReplayBuffer(
            cfg.rollout.partial_rollout.replay_buffer_size, buf.type, buf.freshness_weight, buf.diversity_weight,
            seed=cfg.trainer.seed, version=start_step)
        # Admission counts groups per *parameter version*: one version is pushed every sync_every steps.
        self.admission = AdmissionController(max_staleness, groups_per_step * self.sync_every, initial_version=start_step)
        self.version = start_step  # parameter version the engine generates with
        self.start_step = start_step
        self.last_wait_s = 0.0
        self._stop = threading.Event()
        self._busy_since: float | None = None
        self._in_flight = 0
        self._busy_s = 0.0
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tether-rollouter", daemon=True)
        self._thread.start()

    # -- rollouter side (background thread) --------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as e:  # surfaced to the trainer on its next call, never swallowed
            self._error = e
            self.queue.close()

    async def _produce(self) -> None:
        sem = asyncio.Semaphore(max(1, self.rollouter.max_concurrent // self.group_size))  # groups in flight
        pending: set[asyncio.Task] = set()
        step = self.start_step
        while not self._stop.is_set():
            step += 1
            tasks = self.batch_tasks(step)
            for task, size in zip(tasks, self.sizes(tasks)):
                seq = None
                while seq is None and not self._stop.is_set():
                    seq = await self.admission.wait_to_start_async(timeout=0.2)
                if seq is None:
                    break
                await sem.acquire()
                job = asyncio.create_task(self._one(task, size, step, seq, sem))
                pending.add(job)
                job.add_done_callback(pending.discard)
        for job in pending:
            job.cancel()

    async def _one(self, task: Task, size: int, step: int, seq: int, sem: asyncio.Semaphore) -> None:
        self._mark(+1)
        start_version = self.version
        try:
            group = await self.rollouter.group(task, size, step_seed(self.seed, step))
            self.queue.put(QueuedGroup(group, seq, start_version))
        except RolloutError as e:  # counted and logged; the window and the admission count move on
            self.queue.abandon(seq)
            self.admission.release()
            record_metric("rollout/failed_groups", 1, "sum")
            log.warning("dropping group %d: %s", seq, e)
        finally:
            self._mark(-1)
            sem.release()

    def _mark(self, delta: int) -> None:
        with self._lock:
            now = time.perf_counter()
            if self._in_flight == 0 and delta > 0:
                self._busy_since = now
            self._in_flight += delta
            if self._in_flight == 0 and self._busy_since is not None:
                self._busy_s += now - self._busy_since
                self._busy_since = None

    # -- trainer side --------------------------------------------------------------------------------
    def _take(self, n: int) -> list[QueuedGroup]:
        """Up to n finished groups: straight from the queue, or — with ``buffer.type: priority`` — through
        the replay buffer (everything finished moves into it; n are sampled by freshness and diversity)."""
        have = len(self.buffer) if self.buffer is not None else 0
        got = self.queue.get_batch(n - have, timeout=600.0) if have < n else []
        if self._error is not None:
            raise RuntimeError("the rollouter failed") from self._error
        if got is None:
            raise RuntimeError("no rollouts arrived for 600 s: is the engine or a tool stuck?")
        if self.buffer is None:
            return got
        for q in got + (self.queue.get_batch_nowait(self.queue_capacity) or []):
            self.buffer.add(q)
        self.buffer.on_version(self.version)
        return self.buffer.sample(n)

    def next_batch(self, step: int) -> list[Group]:
        t = time.perf_counter()
        kept: list[QueuedGroup] = []
        while len(kept) < self.groups_per_step:
            got = self._take(min(self.groups_per_take, self.groups_per_step - len(kept)))
            if self.max_policy_lag is not None:
                fresh, stale = stale_filter(got, self.version, self.max_policy_lag)
                if stale:
                    self.queue.report_stale(stale)
                    record_metric("rollout/stale_trajectory_processed", sum(q.num_samples for q in stale), "sum")
                got = fresh
            kept += got
        wait = time.perf_counter() - t
        kept.sort(key=lambda q: q.seq)  # start order: the batch sync would have built
        groups = [q.group for q in kept]
        trajs = [tr for g in groups for tr in g.trajectories]
        record_rollout_metrics(trajs, None, self.hacking_patterns)
        record_metric("rollout/stale_trajectory_processed", 0.0, "sum")
        extra = self.buffer.metrics() if self.buffer is not None else {}
        for k, v in {**version_lag_stats(trajs, self.version), **self.queue.metrics(), **extra}.items():
            record_metric(k, v, "last")
        self.last_wait_s = wait
        with self._lock:
            busy = self._busy_s + (time.perf_counter() - self._busy_since if self._busy_since else 0.0)
        record_metric("perf/rollouter_idle_ratio", 1.0 - busy / max(time.perf_counter() - self._t0, 1e-9), "last")
        return groups

    def on_weights(self, version: int) -> None:
        self.version = version
        self.admission.on_version(version)

    def close(self) -> None:
        self._stop.set()
        self.admission.close()
        self.queue.close()
        self._thread.join(timeout=30)


def make_source(cfg: RunConfig, rollouter: Rollouter, batch_tasks: Callable[[int], list[Task]], *,
                start_step: int, hacking_patterns: tuple[str, ...] = (), sizes: Sizes | None = None) -> BatchSource:
    group_size = cfg.policy_optimization.advantage.group_size
    sizes = sizes or (lambda tasks: [group_size] * len(tasks))
    mode = cfg.rollout.mode
    if mode == "sync":
        return SyncSource(rollouter, batch_tasks, sizes, cfg.trainer.seed, hacking_patterns, start_step)
    staleness = cfg.rollout.scheduler.max_staleness
    if mode == "one_step_off_policy":
        staleness = min(1, staleness)
    return AsyncSource(cfg, rollouter, batch_tasks, sizes, group_size, cfg.derived()["prompts_per_step"],
                       start_step=start_step, max_staleness=staleness, hacking_patterns=hacking_patterns)
