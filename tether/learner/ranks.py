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
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _comm_device() -> torch.device:
    """Where the default group's collectives take their tensors: NCCL's on this rank's GPU, gloo's on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded (DTensor) one gathered from every rank (a collective), a plain one as is."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 — torch.distributed's tensor module, only when sharded

    return t.full_tensor() if isinstance(t, DTensor) else t
