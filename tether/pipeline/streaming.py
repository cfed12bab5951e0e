"""A step's learner update, fed group by group — in sync mode while the rollout still generates the rest.

When the step is one pass whose π_prox the learner can have as the groups arrive (``Learner.streams``: the demo's
case), an update is a sum over its groups (``tether.learner.accumulate``), so a finished group can be forwarded and
back-propagated at once; with several updates a step (``mini_batch_size`` < ``batch_size``) each is applied as soon as
it holds ``mini_batch_size`` trajectories, and the next one is fed on the new weights (``tether.learner.updates``).
In sync mode that happens in a worker thread while the engine generates the other groups and runs the
degenerate-group filter's resample attempts (``learner.overlap_rollout``): the learner's work moves under the
rollout's tail instead of following it. When the rollout is done the worker stops after its current group and the
trainer takes over the groups not yet trained (in sync mode two at a time: see Threads), then applies the update. A
dropped group is never trained; nothing else changes what is trained: the step's groups, their advantages and the
updates are those of ``Learner.train_step`` (to float rounding: the gradient is summed in another order; with several
updates a mini-batch holds the trajectories in the order they were fed, so the groups that make each update are the
batch's with ``trainer.deterministic`` and those that finished first otherwise).

Advantages. Each group's advantages are computed once (``advantages``, the one function for a group and for a
whole batch): as it is trained when the step streams, all together when it does not (``StepUpdate.advantages``).

Order. Groups are trained as they finish; with ``trainer.deterministic`` in the order of the step's task list
(a group waits for those before it), so that the gradient is summed in one order.

The async modes. The groups are produced before the trainer asks for the step, and the trainer waits for them: with
the overlap the batch source hands over each group as soon as the schedule lets it be taken (``AsyncSource``), and it
is trained while the trainer waits for the rest, so that the version after the batch is published (and admission
control lets the next groups start) a learner step sooner. Without it, or with ``trainer.deterministic`` (the groups
arrive in no fixed order, so task order would mean waiting for the whole batch), the batch's groups are fed in its
order after it arrives.

Threads. A step's "all threads" (``all_threads``) is decided at its start from the cores other processes leave
(``tether.threads``: at most the trainer thread's count, the caller's; the window is the previous step). When the
learner trains beside the rollout, the counts are split for the whole step: the engine's thread gets half
of them (``split_threads``; one of two cores) from the step's start to the rollout's end, and every group is trained
on the other half; between steps (evaluation) the engine has the caller's count back. An OpenMP team of two threads
on a core that another busy thread holds waits for it at every barrier, and the demo's work items are small: a decode
step of ~30 rows, one group's forward and backward. Until session 24 the engine took every thread while the learner
waited for a group, and the trainer's thread trained the groups left after the rollout on all of them; measured on
the demo (2 cores, 10-step runs, median of steps 3-10, 2 runs each, alternated): 2.57 / 2.69 s a step that way,
2.46 / 2.43 s split (the rollout 1.50-1.67 s -> 1.49-1.51 s). In sync mode the engine idles from the rollout's end to
the next step, so the groups left then are added two at a time (``after_workers``; ``Accumulation.add_parts``: those
that fit the open update together), each thread on a half, where the learner allows it (``Learner.concurrent_adds``:
on a CPU, one process, no adapter switched off for the reference, no teacher); not in deterministic mode (which
groups are left follows timing) nor in the async modes (the engine goes on generating). Two threads that each train
their own group beat one OpenMP team of two on these work items: measured on the demo (session 25, 8-step runs after
2 warm-up steps, median step, 3 pairs alternated with the code before): 2.52 / 2.35 / 2.44 s one at a time on one
thread, 2.31 / 2.15 / 2.07 s two at a time (on one OpenMP team of two instead: 2.55-2.70 s against 2.36-2.38 s).
Before session 25 the trainer also waited in ``advantages`` while the worker trained the rest on one thread (it kept
taking the lock): the advantages have their own lock now. A step that does not overlap (``overlap_rollout: false``, a
learner that does not stream) trains on all threads.

Deterministic threads (``trainer.deterministic``). On a CPU a result can depend, in its last bits, on the number of
torch threads that computed it (how a product's or a reduction's partial sums are split). Measured on the demo's
model (hidden 128): the engine's logprobs on one thread and on two differ, by up to 5e-6, at some tokens of most
requests. Were the threads traded between the engine and the learner as they wait for each other, which engine
steps ran on half the threads would follow the learner's timing, and so would the behaviour logprobs, the
importance ratios, the gradient and the weights (1 pair of 3 demo runs differed that way: 1.5e-8 on the weights at
step 4, then 6 metrics); the split keeps them fixed. The learner's side of the demo measured the same on one thread
and two, but a reduction over more than 32k elements (torch's grain) is split by thread, and which groups train
beside the rollout and which after it follows timing too: so in deterministic mode every group trains on the same
half, and the step's count is the caller's, never the load's (``docs/determinism.md``).

Metrics: ``perf/learner_overlap_s`` — learner seconds spent while the rollout was still running (0 without
overlap), ``perf/learner_after_rollout_s`` — learner seconds after it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tether.algo import group_advantages
from tether.algo.advantages import Normalization
from tether.config.policy import AdvantageConfig
from tether.learner.group import LearnerGroup
from tether.learner.learner import Learner
from tether.metrics import record_metric
from tether.pipeline.shaping import Produced
from tether.threads import CpuMeter, choose, torch_threads
from tether.types import Group, Trajectory


def advantages(groups: Sequence[Group], normalization: Normalization,
               min_std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The group-relative advantages of the trajectories of ``groups``, in order ([N]), and the fraction of those
    groups that are degenerate (reward std ≤ ``min_std``, singletons included; []): ``group_advantages`` with the
    ``policy_optimization.advantage`` section's values. One function for one group trained as it finishes and for a
    step's whole batch: unless normalised over the batch, a group's advantages are its own either way.

    The rewards are taken in float32 (the learner trains on float32 advantages); the advantages come back in
    float64, so that a step's ``optim/advantage_std`` over groups computed one by one is the whole batch's."""
    rewards = torch.tensor([t.reward for g in groups for t in g.trajectories], dtype=torch.float32)  # [N]
    adv, m = group_advantages(rewards.double(), group_sizes=[len(g.trajectories) for g in groups],
                              normalization=normalization, min_std=min_std)
    return adv, m["degenerate_group_ratio"]


def streams(learner: Learner | LearnerGroup, normalization: Normalization) -> bool:
    """Whether a step is fed group by group: the learner can be (``Learner.streams``) and each group's
    advantages its own (``normalization``, ``policy_optimization.advantage``'s: not over the batch)."""
    return learner.streams and normalization != "batch"


def overlaps(learner: Learner | LearnerGroup, normalization: Normalization, *, overlap_rollout: bool,
             mode: str, ordered: bool = False) -> bool:
    """Whether the learner trains beside the rollout in this run: ``learner.overlap_rollout`` where it can act (a step
    that ``streams``; in the async modes (``mode``, ``rollout.mode``) without ``ordered``, ``trainer.deterministic``:
    there the groups reach the trainer in no fixed order, so task order would mean waiting for the whole batch)."""
    return overlap_rollout and streams(learner, normalization) and (mode == "sync" or not ordered)


def _trainable(produced: Produced) -> bool:
    return not produced.dropped and bool(produced.group.trajectories)


_METER = CpuMeter()  # the steps' look at the load: its window is one step start to the next


def mark_load() -> None:
    """A run's start: the first step's look at the load reads the window since now (the run's set-up and first
    evaluation) instead of sampling ``tether.threads.SAMPLE_S`` (0.2 s) at the step's start."""
    _METER.mark()


def split_threads(all_threads: int) -> int:
    """Torch threads for each of the two that compute at once (engine, learner worker): half of the step's."""
    return max(1, all_threads // 2)


def step_threads(ordered: bool) -> int:
    """A step's "all threads": this thread's count (the caller's) with ``ordered`` (``trainer.deterministic``),
    else as many of them as the load leaves (``tether.threads.choose``)."""
    ceiling = torch.get_num_threads()
    return ceiling if ordered else choose(ceiling, _METER).threads


class StepUpdate:
    """One step's learner update, a context manager. ``offer`` (from the rollout's event loop) hands it a finished
    group; ``train`` (after the batch) trains what is left and applies the update.

    A learner whose step is several passes, or needs π_prox scored under weights it does not hold (or advantages
    normalised over the batch), is not fed group by group: ``train`` then calls ``Learner.train_step`` on the whole
    batch."""

    def __init__(self, learner: Learner | LearnerGroup, advantage: AdvantageConfig, *, overlap_rollout: bool, mode: str,
                 ordered: bool, engine_threads: Callable[[int], object] | None = None):
        """``advantage``: the ``policy_optimization.advantage`` section; ``overlap_rollout`` and ``mode``:
        ``learner.overlap_rollout`` and ``rollout.mode`` (``overlaps``); ``ordered``: ``trainer.deterministic``
        (groups trained in task order, the step on the caller's threads: see the module docstring);
        ``engine_threads(n)``: give the rollout engine n torch threads (from its next step on); None = leave it."""
        self.learner, self.engine_threads = learner, engine_threads
        self.normalization, self.min_std = advantage.normalization, advantage.degenerate_group_filter.min_reward_std
        self.streams = streams(learner, self.normalization)
        self.overlap = overlaps(learner, self.normalization, overlap_rollout=overlap_rollout, mode=mode,
                                ordered=ordered)
        self.ceiling = torch.get_num_threads()  # the caller's: read in the trainer's thread, given back after the step
        self.all_threads = step_threads(ordered)
        self.threads = split_threads(self.all_threads)
        # the groups left when a sync rollout ends: two threads add them at once, each on a half (the engine waits for
        # the next step), unless deterministic (which groups are left follows timing) or async (the engine generates)
        concurrent = getattr(learner, "concurrent_adds", False)  # (a LearnerGroup's ranks add one group at a time)
        self.after_workers = 2 if mode == "sync" and not ordered and concurrent else 1
        self.ordered = ordered
        self.update: Any = None  # the step's update (an Accumulation, or a LearnerGroup's StreamedStep)
        self.trained: list[int] = []  # ids of the Produced added, in the order they were
        self._advantages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(Produced) -> ``advantages`` of it
        self._held: dict[int, Produced] = {}  # ordered mode: finished groups waiting for earlier ones
        self._next = 0  # ordered mode: the next index to release
        self._todo: queue.SimpleQueue[Produced] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # one add at a time (worker or trainer)
        self._advantages_lock = threading.Lock()  # the advantages cache: asking for them waits for no add
        self._handoff = threading.Event()  # the rollout is done: the worker stops after its current group
        self.overlap_s = 0.0
        # overlapping: the engine on half the threads until the rollout ends (the caller's count given back then),
        # every group on the rest; set before the step's first request, it applies from the engine's next step
        if self.overlap:
            self._share(self.threads)

    # -- rollout side (the event loop's thread) --------------------------------------------------------------
    def offer(self, produced: Produced) -> None:
        """A finished group of the step (any order; each index once): from the rollout's event loop in sync mode, from
        the trainer's thread as the batch source takes it in the async modes."""
        if not self.overlap:
            return
        if not self.ordered:
            self._submit(produced)
            return
        self._held[produced.index] = produced
        while self._next in self._held:
            self._submit(self._held.pop(self._next))
            self._next += 1

    def _submit(self, produced: Produced) -> None:
        if not _trainable(produced):
            return
        self._todo.put(produced)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="tether-learner", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's OpenMP team (and the default of threads started later)
        try:
            while not self._handoff.is_set():
                try:
                    produced = self._todo.get(timeout=0.05)
                except queue.Empty:
                    continue
                t0 = time.perf_counter()
                self._add(produced)
                self.overlap_s += time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 — surfaced by finish, never swallowed
            self._error = e
        finally:
            torch.set_num_threads(self.ceiling)  # the default that threads started later take

    def _share(self, n: int) -> None:
        if self.engine_threads is not None:
            self.engine_threads(n)

    # -- trainer side ----------------------------------------------------------------------------------------
    def _add(self, produced: Produced) -> None:
        with self._lock:
            if self.update is None:
                self.update = self.learner.begin_step()
            self.update.add_trajectories(produced.group.trajectories, self._group_advantages(produced)[0].float())
            self.trained.append(id(produced))

    def _add_left(self, left: list[Produced]) -> None:
        """The groups left after a sync rollout, ``after_workers`` at a time (``add_parts``), each on ``threads``."""
        with self._lock:
            if self.update is None:
                self.update = self.learner.begin_step()
            parts = [(p.group.trajectories, self._group_advantages(p)[0].float()) for p in left]
            self.update.add_parts(parts, self.after_workers, self.threads)
            self.trained.extend(id(p) for p in left)

    def _group_advantages(self, produced: Produced) -> tuple[torch.Tensor, torch.Tensor]:
        """``advantages`` of one group, computed the first time it is asked for (by the worker or the trainer)."""
        with self._advantages_lock:
            if id(produced) not in self._advantages:
                self._advantages[id(produced)] = advantages([produced.group], self.normalization, self.min_std)
            return self._advantages[id(produced)]

    def advantages(self, produced: Sequence[Produced]) -> tuple[list[Trajectory], torch.Tensor]:
        """The step's trajectories to train (those of the groups not dropped, in order) and their advantages [N],
        each group's computed once: a streamed group's when it is trained (if it was, they are not computed again),
        otherwise all together. Records ``optim/advantage_std``, ``optim/degenerate_group_ratio`` and
        ``optim/nonzero_advantage_ratio``."""
        kept = [p for p in produced if _trainable(p)]
        trajs = [t for p in kept for t in p.group.trajectories]
        if not kept:
            return trajs, torch.zeros(0)
        if self.streams:  # (not behind the worker's add: the groups it has not taken yet are ``train``'s)
            parts = [self._group_advantages(p) for p in kept]
            adv = torch.cat([a for a, _ in parts])  # [N] float64
            degenerate = torch.stack([d for _, d in parts]).double().mean()  # [] the groups' 0/1 values, averaged
        else:
            adv, degenerate = advantages([p.group for p in kept], self.normalization, self.min_std)
        record_metric("optim/advantage_std", float(adv.std().float()) if len(adv) > 1 else 0.0)
        record_metric("optim/degenerate_group_ratio", float(degenerate.float()))
        adv = adv.float()  # [N] the values the learner trains on
        record_metric("optim/nonzero_advantage_ratio", float((adv.abs() > 1e-6).float().mean()))  # of trajectories
        return trajs, adv

    def _stop_worker(self) -> None:
        self._handoff.set()
        if self.overlap:  # (the worker runs only then)
            if self._worker is not None:
                self._worker.join()
                self._worker = None
            self._share(self.ceiling)  # the rollout is over (the worker may have stopped with a group queued)

    def train(self, produced: Sequence[Produced], trajectories: list[Trajectory], advantages: torch.Tensor) -> bool:
        """Train the step: ``produced`` is every group delivered (in task order), ``trajectories`` and ``advantages``
        those of the groups to train (as ``Learner.train_step`` takes them). False when there was nothing to train."""
        self._stop_worker()
        if self._error is not None:
            raise self._error
        with torch_threads(self.all_threads):  # the trainer's thread: the step's count, the caller's back after
            if not self.streams:
                if trajectories:
                    self.learner.train_step(trajectories, advantages)  # records the optim/* metrics itself
                return bool(trajectories)
            t0 = time.perf_counter()
            kept = [p for p in produced if _trainable(p)]
            done = set(self.trained)
            left = [p for p in kept if id(p) not in done]
            if self.overlap and self.after_workers > 1 and len(left) > 1:
                self._add_left(left)
            else:  # the worker's count: a group's gradient is the same on either side
                with torch_threads(self.threads) if self.overlap else contextlib.nullcontext():
                    for p in left:
                        self._add(p)
            if len(self.trained) != len(kept) or sum(len(p.group.trajectories) for p in kept) != len(trajectories):
                raise RuntimeError(f"the streamed update trained {len(self.trained)} groups of {len(kept)}")
            if self.update is None:
                return False
            self.learner.finish_step(self.update)
        record_metric("perf/learner_overlap_s", self.overlap_s, "last")
        record_metric("perf/learner_after_rollout_s", time.perf_counter() - t0, "last")
        return True

    def __enter__(self) -> StepUpdate:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_worker()
