"""Trajectories → padded tensors for the learner, token-aligned and never re-tokenised.

One row per *segment* (``Trajectory.segments``; one per trajectory unless the memory bound cut the episode):
a segment's sequence is ``prompt_ids + response_ids``; rows are right-padded with the pad id. The rows of a
trajectory are consecutive, each carries the trajectory's advantage, and ``traj_index`` says whose they are.
What that means for the loss: a model token is trained exactly once (in the segment that generated it; later
segments hold it, if at all, in their prompt). ``token_mean`` is unchanged by segmenting; the seq-mean modes
count *segments* as their sequences — in ``seq_mean_token_mean`` a trajectory cut into n segments adds n
per-segment means (as a longer trajectory adds more tokens under ``token_mean``), and
``seq_mean_token_sum_norm``'s B counts segments. Mini-batches and micro-batches are cut between
trajectories (``split``), so ``mini_batch_size`` still counts trajectories and a trajectory's segments are
updated together.
 Every per-token
tensor is indexed by the position of the token it describes: ``loss_mask[b, t]`` and ``old_logp[b, t]`` belong
to ``input_ids[b, t]``. Prompt tokens have mask 0 and old logprob 0; response tokens carry the trajectory's own
``response_mask`` (1 = sampled by the policy, 0 = tool/user/template token) and behaviour logprob.

The model's logits at position t predict token t + 1, so the learner scores ``input_ids[:, 1:]`` with
``logits[:, :-1]`` and uses ``loss_mask[:, 1:]`` / ``old_logp[:, 1:]`` (see ``Learner``). Position 0 is always a
prompt token (an empty prompt is rejected): nothing can be trained on a token with no context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from tether.types import Trajectory


@dataclass
class TrainBatch:
    """B trajectories as tensors; T = the longest prompt + response among them."""

    input_ids: torch.Tensor  # [B, T] long, prompt + response, right-padded with the pad id
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens, 0 on padding
    loss_mask: torch.Tensor  # [B, T] float32, 1 on model-sampled response tokens only
    old_logp: torch.Tensor  # [B, T] float32, behaviour logprob of token t (0 where loss_mask is 0)
    advantages: torch.Tensor  # [B] float32, the advantage of the row's trajectory
    traj_index: torch.Tensor | None = None  # [B] long, index of the row's trajectory (None: row i = trajectory i)
    prox_logp: torch.Tensor | None = None  # [B, T] float32, the learner's logprob of token t at the step's start
    teacher_logp: torch.Tensor | None = None  # [B, T] float32, the teacher's logprob of token t (distillation)
    teacher_top_ids: torch.Tensor | None = None  # [B, T, K] long, the teacher's top-k ids at position t
    teacher_top_logp: torch.Tensor | None = None  # [B, T, K] float32, their logprobs (-inf: no entry)
    versions: torch.Tensor | None = None  # [B, T] long, the param version that sampled token t (-1: not sampled)

    @classmethod
    def from_trajectories(
        cls, trajectories: Sequence[Trajectory], advantages: Sequence[float] | torch.Tensor, *, pad_id: int
    ) -> TrainBatch:
        """Stack the segments of ``trajectories`` (ids as recorded, no re-tokenisation), one advantage per
        trajectory, repeated on each of its segments."""
        adv = torch.as_tensor(advantages, dtype=torch.float32).detach().reshape(-1)  # [N]
        if len(trajectories) == 0:
            raise ValueError("cannot build a TrainBatch from no trajectories")
        if adv.shape[0] != len(trajectories):
            raise ValueError(f"{len(trajectories)} trajectories but {adv.shape[0]} advantages")
        rows, owner = [], []
        for j, traj in enumerate(trajectories):
            traj.check()
            for seg in traj.segments:
                if not seg.prompt_ids:
                    raise ValueError(f"trajectory {traj.task_id} has an empty prompt: its first token has no context")
                rows.append(seg)
                owner.append(j)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in rows]
        b, length = len(rows), max(lengths)
        input_ids = torch.full((b, length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((b, length), dtype=torch.long)
        loss_mask = torch.zeros((b, length), dtype=torch.float32)
        old_logp = torch.zeros((b, length), dtype=torch.float32)
        versions = torch.full((b, length), -1, dtype=torch.long)
        for i, seg in enumerate(rows):
            p, n = len(seg.prompt_ids), lengths[i]
            input_ids[i, :n] = torch.tensor(seg.prompt_ids + seg.response_ids, dtype=torch.long)
            attention_mask[i, :n] = 1
            if n > p:
                mask = torch.tensor(seg.response_mask, dtype=torch.float32)  # [R]
                loss_mask[i, p:n] = mask
                # The trajectory stores 0.0 where the mask is 0; enforce it so nothing leaks from a tool token.
                old_logp[i, p:n] = torch.tensor(seg.logprobs, dtype=torch.float32) * mask
                versions[i, p:n] = torch.tensor(seg.versions, dtype=torch.long)
        index = torch.tensor(owner, dtype=torch.long)  # [B]
        return cls(input_ids, attention_mask, loss_mask, old_logp, adv[index], index, versions=versions)

    def __len__(self) -> int:
        """Rows (segments)."""
        return self.input_ids.shape[0]

    @property
    def num_trajectories(self) -> int:
        if self.traj_index is None:
            return len(self)
        return int(torch.unique_consecutive(self.traj_index).numel())

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens, prompt included: what a forward pass processes."""
        return int(self.attention_mask.sum())

    @property
    def num_loss_tokens(self) -> int:
        """Model-sampled tokens: what the loss is computed on."""
        return int(self.loss_mask.sum())

    def slice(self, start: int, stop: int) -> TrainBatch:
        """Rows ``start:stop``, trimmed to their own longest sequence (right padding makes that a column slice)."""
        if not 0 <= start < stop <= len(self):
            raise ValueError(f"rows {start}:{stop} out of range for a batch of {len(self)}")
        length = int(self.attention_mask[start:stop].sum(dim=1).max())
        def cut(name: str) -> torch.Tensor | None:
            value = getattr(self, name)
            if value is None:
                return None
            return value[start:stop] if value.dim() == 1 else value[start:stop, :length]

        parts: dict[str, Any] = {f.name: cut(f.name) for f in fields(self)}
        return TrainBatch(**parts)

    def to(self, device: torch.device) -> TrainBatch:
        moved: dict[str, Any] = {f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                                 for f in fields(self)}
        return TrainBatch(**moved)

    def split(self, n: int) -> list[TrainBatch]:
        """``n`` consecutive parts, in order, as equal as possible in *trajectories* (sizes differ by at most
        one, larger first; a trajectory's segments stay together), each padded only to its own longest sequence."""
        m = self.num_trajectories
        if not 0 < n <= m:
            raise ValueError(f"cannot split a batch of {m} trajectories into {n} non-empty parts")
        size, extra = divmod(m, n)
        return self._parts([i * size + min(i, extra) for i in range(n + 1)])

    def chunks(self, size: int) -> list[TrainBatch]:
        """Consecutive parts of ``size`` trajectories, in order, the last one the remainder (a trajectory's segments
        stay together): the mini-batches of a step, cut where an update fed as the data arrives cuts them."""
        m = self.num_trajectories
        if size < 1:
            raise ValueError(f"cannot cut a batch into parts of {size} trajectories")
        return self._parts([*range(0, m, size), m])

    def _parts(self, traj_bounds: list[int]) -> list[TrainBatch]:
        """The parts between consecutive trajectory bounds (0 first, ``num_trajectories`` last)."""
        if self.traj_index is None:
            bounds = traj_bounds
        else:  # row where each trajectory starts, and the end
            changes = torch.nonzero(self.traj_index[1:] != self.traj_index[:-1]).flatten() + 1
            starts = [0, *changes.tolist(), len(self)]
            bounds = [starts[t] for t in traj_bounds]
        return [self.slice(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
