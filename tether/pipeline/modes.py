"""Where the trainer's batches come from, per ``rollout.mode``. One producer, one MessageQueue, one trainer.

- ``sync``: the groups of step s are produced when the trainer asks for them, with the current weights.
- ``one_step_off_policy``: a background rollouter may run one parameter version ahead (batch s+1 is
  generated while step s trains); the bound is ``min(1, rollout.scheduler.max_staleness)`` (``Plan.max_staleness``).
- ``fully_async``: the background rollouter runs up to ``max_staleness`` versions ahead (admission
  control); finished groups wait in the MessageQueue (``message_queue.max_queue_size``, oldest dropped when
  full), are moved in ``windowed_fifo`` order into the replay buffer (``rollout.partial_rollout.
  replay_buffer_size``), which hands the trainer the highest-priority (``buffer.type: priority``) or oldest
  (``fifo``) groups; the rest wait there across steps. Groups older than ``buffer.stale_filter.
  max_policy_lag`` are dropped at consumption.

Every group is made by ``GroupProducer.produce`` (rollouts → diversity bonus → degenerate-group
resampling) from the same task, step and seeds in every mode, so with staleness 0 the async modes reproduce
``sync`` exactly (tests/test_modes.py). A group the filter gives up on is delivered marked ``dropped``: it
fills its place in the step (as in sync) and is not trained.

Accounting (in samples = trajectories), checked by ``AsyncSource.check_accounting``:

    queue/total_produced = queue/total_consumed + queue/dropped_samples + queue/stale_samples + queue/queued_samples

with consumed = delivered to the trainer, dropped = queue overflow + replay-buffer evictions, stale = removed
by the stale filter, queued = in the queue + held in the replay buffer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tether.algo.advantages import Normalization
from tether.config import BufferConfig
from tether.config.plan import Plan
from tether.errors import StopRun
from tether.metrics import BusyClock, record_metric
from tether.pipeline.buffer import ReplayBuffer
from tether.pipeline.faults import fault
from tether.pipeline.ledger import Ledger
from tether.pipeline.queue import MessageQueue, QueuedGroup
from tether.pipeline.rollouter import RolloutError, record_rollout_metrics
from tether.pipeline.shaping import GroupProducer, Produced, record_production_metrics
from tether.pipeline.staleness import AdmissionController, stale_filter, version_lag_stats
from tether.pipeline.weights import WeightSync
from tether.types import Group, Task

log = logging.getLogger(__name__)

Sizes = Callable[[list[Task]], list[int]]  # rollouts per task of a step (rollout_allocation)


@dataclass
class StepBatch:
    """What the trainer gets for one step."""

    produced: list[Produced]  # every group delivered for the step, in start order
    wait_s: float  # how long the trainer waited for it

    @property
    def groups(self) -> list[Group]:
        """The groups to train on: the delivered ones the degenerate-group filter did not give up on."""
        return [p.group for p in self.produced if not p.dropped]


OnGroup = Callable[[Produced], None]  # told of each group of the step as it finishes (sync mode)


class BatchSource(Protocol):
    def next_batch(self, step: int, on_group: OnGroup | None = None) -> StepBatch:
        """The ``prompts_per_step`` groups of ``step``; ``on_group`` hears of each as it finishes (sync mode: the
        groups are made for the step) or as it is taken (the async modes made them before: given ``on_group``, they
        hand over each group as soon as it may be taken instead of ``groups_per_take`` at a time)."""

    def state_dict(self) -> dict:
        """What a checkpoint needs so that a resumed run neither repeats nor loses a group (ledger.py)."""

    def close(self) -> None: ...


def _record_batch(produced: list[Produced], version: int, hacking_patterns: tuple[str, ...],
                  elapsed_s: float | None, normalization: Normalization) -> None:
    trajs = [t for p in produced for t in p.group.trajectories]
    if trajs:
        record_rollout_metrics(trajs, elapsed_s, hacking_patterns)
    record_production_metrics(produced, normalization)
    for k, v in version_lag_stats(trajs, version).items():
        record_metric(k, v, "last")


class SyncSource:
    def __init__(self, producer: GroupProducer, batch_tasks: Callable[[int], list[Task]], sizes: Sizes,
                 weights: WeightSync, ledger: Ledger, *, max_groups_in_flight: int,
                 hacking_patterns: tuple[str, ...] = (), normalization: Normalization = "group"):
        self.producer, self.batch_tasks, self.sizes, self.weights = producer, batch_tasks, sizes, weights
        self.ledger, self.max_groups_in_flight, self.hacking_patterns = ledger, max_groups_in_flight, hacking_patterns
        self.normalization = normalization  # advantage.normalization, for optim/advantage_std_before_filter

    async def _produce(self, step: int, on_group: OnGroup | None) -> list[Produced]:
        tasks = self.batch_tasks(step)
        sem = asyncio.Semaphore(self.max_groups_in_flight)

        async def one(k: int, task: Task, size: int) -> Produced:
            async with sem:
                try:
                    produced = await self.producer.produce(task, size, step, k)
                except RolloutError as e:  # every episode failed (counted by cause): the step goes on without it
                    log.warning("dropping group %d of step %d: %s", k, step, e)
                    produced = Produced(Group(task.id, []), step, k, dropped=True, failed=True)
            if k == 0:
                fault("produce", step)
            if on_group is not None:
                on_group(produced)
            return produced

        return list(await asyncio.gather(*(one(k, t, n) for k, (t, n) in enumerate(zip(tasks, self.sizes(tasks))))))

    def next_batch(self, step: int, on_group: OnGroup | None = None) -> StepBatch:
        t = time.perf_counter()
        produced = asyncio.run(self._produce(step, on_group))
        elapsed = time.perf_counter() - t
        for p in produced:
            self.ledger.settle(p.step, p.index)
        _record_batch(produced, self.weights.version, self.hacking_patterns, elapsed, self.normalization)
        return StepBatch(produced, elapsed)

    def state_dict(self) -> dict:
        return {"ledger": self.ledger.state_dict()}

    def close(self) -> None:
        pass


class AsyncSource:
    """A rollouter running in a background thread (its own event loop), feeding the MessageQueue."""

    def __init__(self, producer: GroupProducer, batch_tasks: Callable[[int], list[Task]], sizes: Sizes,
                 weights: WeightSync, ledger: Ledger, buffer: ReplayBuffer, *, plan: Plan, start_step: int,
                 hacking_patterns: tuple[str, ...] = (), normalization: Normalization = "group",
                 counters: dict[str, float] | None = None, make_queue: Callable[..., MessageQueue] = MessageQueue):
        """``plan``: the sizes, the staleness bound of the mode and the queue's shape; ``buffer``: the replay buffer
        between the queue and the trainer."""
        self.producer, self.batch_tasks, self.sizes, self.weights = producer, batch_tasks, sizes, weights
        self.ledger, self.buffer = ledger, buffer
        self.max_groups_in_flight, self.groups_per_step = plan.max_groups_in_flight, plan.prompts_per_step
        # the trainer takes the step's groups from the queue trainer.ppo_mini_batch_size samples at a time
        self.groups_per_take = plan.groups_per_take
        self.hacking_patterns = hacking_patterns
        self.normalization = normalization
        self.max_policy_lag = plan.max_policy_lag
        self.queue = make_queue(plan.queue_size, plan.window_size, plan.max_hold_s)
        # Admission counts groups per parameter version: one version is pushed every sync_every steps.
        self.admission = AdmissionController(plan.max_staleness, plan.groups_per_version,
                                             initial_version=weights.version)
        weights.subscribe(self.admission.on_version)
        weights.subscribe(self.buffer.on_version)
        self.start_step = start_step
        # Counters continue across a resume; what was queued or held at the interruption is lost (dropped) and
        # made again (ledger.py).
        c = counters or {}
        self._offset = {"produced": c.get("queue/total_produced", 0.0), "stale": c.get("queue/stale_samples", 0.0),
                        "dropped": c.get("queue/dropped_samples", 0.0) + c.get("queue/queued_samples", 0.0)}
        self._consumed = c.get("queue/total_consumed", 0.0)  # samples delivered to the trainer
        if start_step:
            record_metric("rollout/regenerated_after_resume", ledger.open_before(start_step), "sum")
        self._stop = threading.Event()
        self._busy = BusyClock()  # wall time with a group in flight: perf/rollouter_idle_ratio
        self._t0 = time.perf_counter()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tether-rollouter", daemon=True)
        self._thread.start()

    # -- rollouter side (background thread) --------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._produce())
        except BaseException as e:  # noqa: BLE001 — surfaced to the trainer on its next call, never swallowed
            self._error = e
            self.queue.close()

    async def _produce(self) -> None:
        """Start the groups of the ledger's plan in order, as admission control allows."""
        sem = asyncio.Semaphore(self.max_groups_in_flight)
        pending: set[asyncio.Task] = set()
        plans: dict[int, tuple[list[Task], list[int]]] = {}  # task step -> (tasks, sizes), sized when first reached
        for step, k in self.ledger.plan():
            if step not in plans:
                tasks = self.batch_tasks(step)
                plans = {step: (tasks, self.sizes(tasks))}
            seq = None
            while seq is None and not self._stop.is_set():
                seq = await self.admission.wait_to_start_async(timeout=0.2)
            if seq is None:
                break
            await sem.acquire()
            tasks, sizes = plans[step]
            job = asyncio.create_task(self._one(tasks[k], sizes[k], step, k, seq, sem))
            pending.add(job)
            job.add_done_callback(pending.discard)
        for job in pending:
            job.cancel()

    async def _one(self, task: Task, size: int, step: int, index: int, seq: int, sem: asyncio.Semaphore) -> None:
        self._busy.enter()
        start_version = self.weights.version
        try:
            produced = await self.producer.produce(task, size, step, index)
            if index == 0:
                fault("produce", step)
            self.queue.put(QueuedGroup(produced.group, seq, start_version, produced=produced))
        except RolloutError as e:  # counted and logged; the window and the admission count move on
            self.queue.abandon(seq)
            self.admission.release()
            record_metric("rollout/failed_groups", 1, "sum")
            log.warning("dropping group %d: %s", seq, e)
        finally:
            self._busy.leave()
            sem.release()

    # -- trainer side --------------------------------------------------------------------------------
    def _drop_stale(self, records: list[QueuedGroup]) -> None:
        self._settle(records)
        if records:
            self.queue.report_stale(records)
            # it never reaches the trainer: its admission place comes back, as a failed group's does, so that the
            # version still gets its groups (kept, each drop would shrink the groups in flight for the rest of the run,
            # and after (max_staleness + 1) · B − B + 1 of them fewer than a batch could ever be in flight)
            self.admission.release(len(records))
            record_metric("rollout/stale_trajectory_processed", sum(q.num_samples for q in records), "sum")

    def _take(self, n: int, wait_for: int) -> list[QueuedGroup]:
        """Up to n groups: every finished group moves from the queue into the replay buffer (waiting until the
        buffer holds ``wait_for`` ≤ n), which hands out its first n."""
        if self.max_policy_lag is not None:
            self._drop_stale(self.buffer.remove_stale(self.max_policy_lag))
        missing = wait_for - len(self.buffer)
        if missing > 0:
            got = self.queue.get_batch(missing, timeout=600.0)
            if isinstance(self._error, StopRun):  # the environment's own one line, as in sync mode
                raise self._error
            if self._error is not None:
                raise RuntimeError("the rollouter failed") from self._error
            if got is None:
                raise RuntimeError("no rollouts arrived for 600 s: is the engine or a tool stuck?")
        else:
            got = []
        for record in got + self.queue.get_available():
            self._settle(self.buffer.add(record))  # evicted: dropped for good
        return self.buffer.take(n)

    def _settle(self, records: list[QueuedGroup]) -> None:
        for q in records:
            self.ledger.settle(q.produced.step, q.produced.index)

    def next_batch(self, step: int, on_group: OnGroup | None = None) -> StepBatch:
        """The step's groups, ``groups_per_take`` at a time; given ``on_group`` (the learner trains each group as it
        comes: ``learner.overlap_rollout``), each as soon as one may be taken, and ``on_group`` hears of it. Then the
        replay buffer chooses among the groups it holds at each take, not among those a whole take would wait for.
        The version cannot move before the step ends, so a group handed over is never dropped as stale later."""
        t = time.perf_counter()
        kept: list[QueuedGroup] = []
        while len(kept) < self.groups_per_step:
            n = min(self.groups_per_take, self.groups_per_step - len(kept))
            got = self._take(n, wait_for=1 if on_group is not None else n)
            if self.max_policy_lag is not None:
                got, stale = stale_filter(got, self.weights.version, self.max_policy_lag)
                self._drop_stale(stale)
            kept += got
            if on_group is not None:
                for q in got:
                    on_group(q.produced)
        wait = time.perf_counter() - t
        kept.sort(key=lambda q: q.seq)  # start order: the batch sync would have built
        self._settle(kept)
        self._consumed += sum(q.num_samples for q in kept)
        produced = [q.produced for q in kept]
        _record_batch(produced, self.weights.version, self.hacking_patterns, None, self.normalization)
        record_metric("rollout/stale_trajectory_processed", 0.0, "sum")
        for k, v in {**self.accounting(), **self.buffer.metrics()}.items():
            record_metric(k, v, "last")
        busy = self._busy.busy_s
        record_metric("perf/rollouter_idle_ratio", 1.0 - busy / max(time.perf_counter() - self._t0, 1e-9), "last")
        return StepBatch(produced, wait)

    def accounting(self) -> dict[str, float]:
        """The pipeline's sample counters (queue and replay buffer together; see the module docstring)."""
        q, o = self.queue.metrics(), self._offset
        return {"queue/total_produced": o["produced"] + q["queue/total_produced"],
                "queue/total_consumed": float(self._consumed),
                "queue/dropped_samples": o["dropped"] + q["queue/dropped_samples"] + self.buffer.evicted_samples,
                "queue/stale_samples": o["stale"] + q["queue/stale_samples"],
                "queue/queued_samples": q["queue/queued_samples"] + self.buffer.held_samples,
                "queue/size": q["queue/size"]}

    def check_accounting(self) -> None:
        """Raise ``AssertionError`` with the numbers unless produced = consumed + dropped + stale + queued."""
        self.queue.check_accounting()
        a = self.accounting()
        rest = sum(a[f"queue/{k}"] for k in ("total_consumed", "dropped_samples", "stale_samples", "queued_samples"))
        if a["queue/total_produced"] != rest:
            raise AssertionError(f"pipeline accounting broken: {a}")

    def state_dict(self) -> dict:
        return {"ledger": self.ledger.state_dict(), "counters": self.accounting()}

    def close(self) -> None:
        self._stop.set()
        self.admission.close()
        self.queue.close()
        self._thread.join(timeout=30)


def make_source(plan: Plan, producer: GroupProducer, batch_tasks: Callable[[int], list[Task]],
                weights: WeightSync, *, start_step: int, sizes: Sizes, buffer: BufferConfig, replay_buffer_size: int,
                normalization: Normalization = "group", hacking_patterns: tuple[str, ...] = (),
                state: dict | None = None, make_queue: Callable[..., MessageQueue] | None = None) -> BatchSource:
    """The batch source of ``plan.mode``; ``state`` is a checkpoint's ``BatchSource.state_dict()``;
    ``make_queue(max_size, window_size, max_hold_s)`` makes the MessageQueue (another actor's under ``backend: ray``);
    ``buffer`` and ``replay_buffer_size`` (``rollout.partial_rollout.replay_buffer_size``) shape the replay buffer
    of the async modes."""
    state = state or {}
    ledger = Ledger(plan.prompts_per_step, state.get("ledger") or ({"frontier": start_step, "beyond": {}}))
    if plan.mode == "sync":
        return SyncSource(producer, batch_tasks, sizes, weights, ledger, max_groups_in_flight=plan.max_groups_in_flight,
                          hacking_patterns=hacking_patterns, normalization=normalization)
    replay = ReplayBuffer(replay_buffer_size, buffer.type, buffer.freshness_weight, buffer.diversity_weight,
                          version=weights.version)
    return AsyncSource(producer, batch_tasks, sizes, weights, ledger, replay, plan=plan, start_step=start_step,
                       hacking_patterns=hacking_patterns, normalization=normalization,
                       counters=state.get("counters"), make_queue=make_queue or MessageQueue)
