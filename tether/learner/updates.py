"""A step of several optimizer updates, fed as its data arrives: ``StreamedUpdates``.

``Learner.train_step`` cuts a step's trajectories into mini-batches of ``mini_batch_size`` in order (the last one
the remainder: ``TrainBatch.chunks``) and makes one update per mini-batch. The same cut can be made as the groups
arrive: trajectories fill the open update (an ``Accumulation``); when it holds ``mini_batch_size`` the update is
applied at once and the next one opens on the new weights. So in sync mode with ``learner.overlap_rollout`` the
first updates of a step run while the rollout still generates its last groups (``tether.pipeline.streaming``), and
only the last, partial one waits for the rollout's end. Fed in the batch's order, the updates are those of
``train_step`` (to float rounding).

π_prox, the policy at the step's start, for an objective with an off-policy correction: the first update's is each
micro-batch's own forward (the weights have not moved). A trajectory that arrives after the first update is scored
under the step's starting weights, which are kept (one copy of the trained parameters, this rank's shards: the
adapter only under ``model.lora``) from just before the first update is applied until the step ends;
``train_step`` scores the same rows under the same weights before its first update. Without a correction
(π_prox = π_behav), or with ``off_policy_correction.proximal: update_start`` (π_prox = each update's own first
forward), nothing is kept and nothing is scored.

The max-KL guard acts as in ``train_step``: once an update measures a KL to the reference above
``kl_control.max_kl``, the step's later trajectories are received but not trained.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from tether.learner.accumulate import Accumulation, Pairs, Part
from tether.learner.detach import trained_params
from tether.types import Trajectory

if TYPE_CHECKING:
    from tether.learner.learner import Learner


class StreamedUpdates:
    """A step's updates of ``mini_batch_size`` trajectories each, applied as each fills; ``close`` applies the
    last (partial) one. Calls must not overlap (one thread at a time; ``add_parts`` adds from several)."""

    def __init__(self, learner: Learner):
        self.learner = learner
        self.size = learner.mini_batch_size
        self.needs_prox = learner.objective.needs_prox
        # off_policy_correction.proximal update_start: every update's π_prox is its own first forward (nothing kept)
        self.per_update = learner.prox_each_update
        self.acc: Pairs = defaultdict(list)  # the step's metrics, every update's
        self.updates = 0  # updates applied
        self.stopped = False  # the max-KL guard stopped the step
        self.trajectories = 0  # received (trained, or not because the guard stopped the step)
        self.forwarded_tokens = 0
        self.busy_s = 0.0
        self._start: dict[str, torch.Tensor] | None = None  # the step's starting weights, once an update moved them
        self._held: dict[str, torch.Tensor] | None = None  # the current weights while the starting ones are in
        self._open: Accumulation | None = self._new()

    def _new(self) -> Accumulation:
        first = self.updates == 0
        own = (first and self.needs_prox) or self.per_update
        return Accumulation(self.learner, prox_from_forward=own, at_start=first)

    def add_trajectories(self, trajectories: Sequence[Trajectory], advantages: Sequence[float] | torch.Tensor) -> None:
        """Forward and back-propagate ``trajectories`` (one advantage each) now, applying every update they fill."""
        t0 = time.perf_counter()
        adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)  # [n]
        if adv.shape[0] != len(trajectories):
            raise ValueError(f"{len(trajectories)} trajectories but {adv.shape[0]} advantages")
        i = 0
        while i < len(trajectories) and self._open is not None:
            j = min(len(trajectories), i + self.size - self._open.trajectories)  # what fits in the open update
            self._add(trajectories[i:j], adv[i:j])
            i = j
            if self._open.trajectories >= self.size:
                self._apply(more=True)
        self.trajectories += len(trajectories)
        self.busy_s += time.perf_counter() - t0

    def add_parts(self, parts: Sequence[Part], workers: int, threads: int) -> None:
        """``add_trajectories`` of each part in order; the parts that fit the open update together and are forwarded
        on the weights the model holds (no π_prox scored under the kept starting weights) go to ``Accumulation.
        add_parts`` (``workers`` threads at once), then the update is applied if they filled it."""
        i = 0
        while i < len(parts):
            run: list[Part] = []
            room = self.size - self._open.trajectories if self._open is not None else 0
            while i + len(run) < len(parts) and len(parts[i + len(run)][0]) <= room:
                room -= len(parts[i + len(run)][0])
                run.append(parts[i + len(run)])
            if len(run) < 2 or not self._direct or self._open is None:
                self.add_trajectories(*parts[i])
                i += 1
                continue
            t0 = time.perf_counter()
            self._open.add_parts(run, workers, threads)
            self.trajectories += sum(len(trajectories) for trajectories, _ in run)
            if self._open.trajectories >= self.size:
                self._apply(more=True)
            self.busy_s += time.perf_counter() - t0
            i += len(run)

    @property
    def _direct(self) -> bool:
        """Whether the open update's π_prox is its own forward, or not needed: nothing to score under the kept
        starting weights."""
        return self.updates == 0 or not self.needs_prox or self.per_update

    def _add(self, trajectories: Sequence[Trajectory], advantages: torch.Tensor) -> None:
        assert self._open is not None
        if self._direct:
            self._open.add_trajectories(trajectories, advantages)
            return
        batch = self.learner.batch_of(trajectories, advantages)
        with self._starting_weights():
            batch.prox_logp = self.learner.score(batch, self._open.device)
        self._open.add(batch)

    def _apply(self, *, more: bool) -> None:
        """Apply the open update; ``more``: more trajectories may follow (keep the starting weights first)."""
        update, self._open = self._open, None
        assert update is not None
        if more and self.updates == 0 and self.needs_prox and not self.per_update:
            with torch.no_grad():
                self._start = {name: p.clone() for name, p in trained_params(self.learner.model)}
        kl = update.apply(self.acc)
        self.forwarded_tokens += update.forwarded_tokens
        self.updates += 1
        self.stopped = self.learner.kl_stops(kl)
        if more and not self.stopped:
            self._open = self._new()

    def close(self) -> tuple[Pairs, bool]:
        """Apply the last update (if it holds anything); the step's metrics and whether the guard stopped it."""
        if self._open is not None and self._open.trajectories:
            self._apply(more=False)
        self._open, self._start, self._held = None, None, None
        return self.acc, self.stopped

    @contextlib.contextmanager
    def _starting_weights(self) -> Iterator[None]:
        """Inside: the model holds the step's starting weights (copied in, and the current ones copied back after:
        in place, so the optimizer and FSDP keep their tensors; the current ones wait in one buffer kept for the
        step)."""
        assert self._start is not None
        with torch.no_grad():
            params = dict(trained_params(self.learner.model))
            if self._held is None:
                self._held = {name: torch.empty_like(start) for name, start in self._start.items()}
            for name, start in self._start.items():
                self._held[name].copy_(params[name])
                params[name].copy_(start)
        try:
            yield
        finally:
            with torch.no_grad():
                params = dict(trained_params(self.learner.model))
                for name, current in self._held.items():
                    params[name].copy_(current)
