"""The trainer's data-parallel ranks: which rows of a micro-batch this rank trains, and the sums across ranks.

Every rank holds the whole batch (the trajectories are small next to the weights) and trains its share of
every micro-batch: the micro-batch's trajectories split into ``world`` near-equal consecutive parts
(``TrainBatch.split``), part ``rank`` to this rank. The loss of a share is its rows' sum over the *whole
mini-batch's* denominator, so the shares' losses add up to the single-process loss and, with the gradients
summed (not averaged) across ranks, so do the gradients: 2 ranks compute what 1 rank computes, up to
float summation order (``tests/test_fsdp2.py``).

FSDP requires every rank to run the same forwards and backwards (each one gathers the sharded weights). A rank
whose share of a micro-batch would be empty (fewer trajectories than ranks) runs the micro-batch's first row
with weight 0: it takes part in the collectives and adds nothing.

``Ranks()`` is one process (rank 0 of 1): no sharing, no communication, the Learner's single-process path.

``TalliedRanks`` (what ``tether.learner.group`` installs on every rank) tallies how evenly the shares pad, and may share
a micro-batch by padded tokens instead (``balanced_parts``: any split of the rows trains the same sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from tether.learner.batch import TrainBatch


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    """This process's rank in the trainer's process group."""
    world: int = 1
    """Ranks in the trainer's process group (1 = one process, nothing shared)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world}")

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def share(self, mb: TrainBatch) -> tuple[TrainBatch, float]:
        """This rank's trajectories of the micro-batch ``mb``, and the weight of their loss (0 = a stand-in)."""
        if not self.sharded:
            return mb, 1.0
        parts = mb.split(min(mb.num_trajectories, self.world))
        if self.rank < len(parts):
            return parts[self.rank], 1.0
        return mb.slice(0, 1), 0.0

    def parts(self, mb: TrainBatch) -> list[tuple[TrainBatch, float]]:
        """Every rank's ``share`` of ``mb``, rank by rank (what each rank trains; a rank computes them all alike)."""
        return [Ranks.share(Ranks(r, self.world), mb) for r in range(self.world)]

    def rows(self, start: int, stop: int) -> tuple[int, int]:
        """This rank's consecutive share ``lo, hi`` of the rows ``start:stop`` (near-equal parts, larger first;
        ``lo == hi``: none); ``start, stop`` in one process."""
        if not self.sharded:
            return start, stop
        size, extra = divmod(stop - start, self.world)
        lo = start + self.rank * size + min(self.rank, extra)
        return lo, lo + size + (self.rank < extra)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the ranks (``value`` itself in one process), on ``value``'s device."""
        if not self.sharded:
            return value
        out = value.detach().to(_comm_device(), copy=True)
        dist.all_reduce(out)
        return out.to(value.device)

    def merge(self, values: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
        """Per-token metrics as (value, weight) pairs → one pair per name whose value is the weighted mean over
        every rank's pairs and whose weight is their total; one all-reduce. Unchanged in one process."""
        if not self.sharded:
            return values
        names = sorted(values)  # the same names in the same order on every rank: the same code ran
        sums = torch.tensor([[sum(v * w for v, w in values[n]), sum(w for _, w in values[n]),
                              sum(v for v, _ in values[n]), len(values[n])] for n in names],
                            dtype=torch.float64, device=_comm_device()).reshape(len(names), 4)
        dist.all_reduce(sums)
        # no weight anywhere (e.g. no model tokens): the plain mean, as Learner's _weighted_mean takes it
        return {n: [(s / w if w else plain / count, w)]
                for n, (s, w, plain, count) in zip(names, sums.tolist(), strict=True)}


@dataclass
class ShareTally:
    """What the ranks' shares held since the last ``take``: per micro-batch the padded tokens (rows × longest row:
    what a dense forward computes) of the rank that had the most and the ranks' mean."""

    slowest: float = 0.0  # Σ over micro-batches of the largest share's padded tokens
    mean: float = 0.0  # Σ over micro-batches of the shares' mean padded tokens

    def take(self) -> tuple[float, float]:
        """``(slowest, mean)``, and start again from zero."""
        out = (self.slowest, self.mean)
        self.slowest = self.mean = 0.0
        return out


@dataclass(frozen=True)
class TalliedRanks(Ranks):
    """``Ranks`` whose ``share`` also counts into ``tally`` (``tether.learner.group`` installs it on every rank for
    the step's ``perf/rank_imbalance``). ``balanced``: shares balanced by padded tokens
    (``balanced_parts``) instead of consecutive near-equal counts."""

    balanced: bool = False
    tally: ShareTally = field(default_factory=ShareTally, compare=False, repr=False)

    def parts(self, mb: TrainBatch) -> list[tuple[TrainBatch, float]]:
        return balanced_parts(mb, self.world) if self.balanced and self.sharded else super().parts(mb)

    def share(self, mb: TrainBatch) -> tuple[TrainBatch, float]:
        parts = self.parts(mb)
        cost = [float(len(part) * part.input_ids.shape[1]) for part, _ in parts]  # padded tokens
        self.tally.slowest += max(cost)
        self.tally.mean += sum(cost) / len(cost)
        return parts[self.rank]


def balanced_parts(mb: TrainBatch, world: int) -> list[tuple[TrainBatch, float]]:
    """``world`` shares of ``mb``'s trajectories that even out the padded tokens a share forwards (rows × its longest
    row): the trajectories sorted by their longest row (longest first) and cut into consecutive runs, the largest run
    cost as small as it can be (a binary search over it; a run that starts at a longer trajectory holds fewer rows).
    Similar lengths land together, so a share pads little. With fewer trajectories than ranks, the others get a
    weight-0 stand-in (as ``Ranks.share``)."""
    if mb.traj_index is None:
        owners = list(range(len(mb)))
    else:
        owners = mb.traj_index.tolist()
    lengths = mb.attention_mask.sum(dim=1).tolist()  # [B] real tokens per row
    rows: dict[int, list[int]] = {}
    for row, owner in enumerate(owners):
        rows.setdefault(owner, []).append(row)
    trajs = sorted(rows.values(), key=lambda r: -max(lengths[i] for i in r))  # stable: ties keep their order
    longest = [max(lengths[i] for i in r) for r in trajs]

    def cut(cap: float) -> list[int]:
        """Where each run starts when no run may pad to more than ``cap`` tokens (a run holds at least one)."""
        starts, i = [], 0
        while i < len(trajs):
            starts.append(i)
            n_rows, j = len(trajs[i]), i + 1
            while j < len(trajs) and (n_rows + len(trajs[j])) * longest[i] <= cap:
                n_rows += len(trajs[j])
                j += 1
            i = j
        return starts

    n = min(world, len(trajs))
    lo, hi = 1, len(mb) * longest[0]  # hi: everything in one run
    while lo < hi:  # the smallest cap that needs at most n runs
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(cut(mid)) <= n else (mid + 1, hi)
    starts = cut(lo)
    while len(starts) < n:  # fewer runs than ranks: split the run with the most trajectories
        bounds = [*starts, len(trajs)]
        k = max(range(len(starts)), key=lambda k: bounds[k + 1] - bounds[k])
        starts.insert(k + 1, (bounds[k] + bounds[k + 1] + 1) // 2)
    bounds = [*starts, len(trajs)]
    parts = [(take_rows(mb, [i for t in trajs[a:b] for i in t]), 1.0) for a, b in zip(bounds, bounds[1:])]
    return parts + [(mb.slice(0, 1), 0.0)] * (world - len(parts))


def take_rows(mb: TrainBatch, rows: list[int]) -> TrainBatch:
    """The rows ``rows`` of ``mb`` (in that order), trimmed to their own longest sequence."""
    index = torch.tensor(rows, dtype=torch.long)
    length = int(mb.attention_mask[index].sum(dim=1).max())

    def cut(value: torch.Tensor | None) -> torch.Tensor | None:
        if value is None:
            return None
        return value[index] if value.dim() == 1 else value[index, :length]

    parts: dict[str, Any] = {f.name: cut(getattr(mb, f.name)) for f in fields(mb)}
    return TrainBatch(**parts)


def _comm_device() -> torch.device:
    """Where the default group's collectives take their tensors: NCCL's on this rank's GPU, gloo's on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded (DTensor) one gathered from every rank (a collective), a plain one as is."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 — torch.distributed's tensor module, only when sharded

    return t.full_tensor() if isinstance(t, DTensor) else t
