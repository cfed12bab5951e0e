"""AdamW with linear warm-up, an optional decay, gradient-norm clipping, and a guard that never applies a
non-finite update.

Schedule: update k (1-based, counting applied updates only) uses ``lr · min(1, k / warmup_steps)`` during the
warm-up (unlike Hugging Face's ``get_linear_schedule_with_warmup`` the first update is not wasted at lr 0), then
``constant``: ``lr``; ``cosine`` / ``linear``: a decay over updates W + 1 … D (W = warmup_steps, D = decay_steps)
with progress p = (k − W − 1) / (D − W − 1), from ``lr`` at p = 0 to ``lr · min_lr_ratio`` at p = 1 (update D), then
flat: cosine ``m + (1 − m) · ½(1 + cos πp)``, linear ``m + (1 − m)(1 − p)`` (m = min_lr_ratio).

Guard: if the loss or the pre-clip gradient norm is non-finite, the update is skipped — gradients are zeroed,
neither the optimizer (its moments and step count) nor the schedule advance, and ``skipped_steps`` counts it.
The parameters stay bit-identical. A NaN from one bad batch must not poison Adam's moments for the rest
of the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tether.config import OptimizerConfig


@dataclass
class UpdateResult:
    applied: bool  # False when the loss or gradients were non-finite
    grad_norm: float  # pre-clip global L2 norm of the gradients (may be inf/NaN when skipped)
    lr: float  # learning rate of this update (the one it would have used when skipped)


def warmup_factor(update: int, warmup_steps: int) -> float:
    """Multiplier of the base lr for the ``update``-th applied update (1-based), warm-up only."""
    return 1.0 if warmup_steps <= 0 else min(1.0, update / warmup_steps)


def lr_factor(update: int, warmup_steps: int, scheduler: str = "constant", decay_steps: int | None = None,
              min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base lr for the ``update``-th applied update (1-based): the module's schedule."""
    if update <= warmup_steps or scheduler == "constant":
        return warmup_factor(update, warmup_steps)
    if decay_steps is None:
        raise ValueError(f"lr_scheduler {scheduler!r} needs decay_steps")
    p = min(1.0, max(0.0, (update - warmup_steps - 1) / max(1, decay_steps - warmup_steps - 1)))
    shape = 0.5 * (1.0 + math.cos(math.pi * p)) if scheduler == "cosine" else 1.0 - p
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class PolicyOptimizer:
    """``torch.optim.AdamW`` plus the schedule, clipping and the non-finite guard; one ``update()`` per mini-batch."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        max_grad_norm: float = 1.0,
        lr_scheduler: str = "constant",
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.0,
    ):
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self.params = [p for p in params if p.requires_grad]
        self.base_lr = lr
        self.warmup_steps = warmup_steps
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, weight_decay=weight_decay)
        if lr_scheduler not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr_scheduler must be constant, cosine or linear, got {lr_scheduler!r}")
        if lr_scheduler != "constant" and decay_steps is None:
            raise ValueError(f"lr_scheduler {lr_scheduler!r} needs decay_steps (the update where the decay ends)")
        # LambdaLR's counter starts at 0 for the first update, hence + 1.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: lr_factor(k + 1, warmup_steps, lr_scheduler, decay_steps, min_lr_ratio)
        )
        self.num_updates = 0  # applied updates
        self.skipped_steps = 0  # updates skipped because the loss or gradients were non-finite

    @classmethod
    def from_config(cls, params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> PolicyOptimizer:
        return cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                   max_grad_norm=cfg.max_grad_norm, lr_scheduler=cfg.lr_scheduler, decay_steps=cfg.decay_steps,
                   min_lr_ratio=cfg.min_lr_ratio)

    @property
    def lr(self) -> float:
        """The learning rate the next applied update will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def update(self, loss_is_finite: bool = True) -> UpdateResult:
        """Clip and apply the accumulated gradients, or skip them when anything is non-finite; grads are zeroed."""
        lr = self.lr
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)  # pre-clip norm
        grad_norm = float(norm)
        applied = loss_is_finite and math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
            self.scheduler.step()
            self.num_updates += 1
        else:
            self.skipped_steps += 1
        self.zero_grad()
        return UpdateResult(applied=applied, grad_norm=grad_norm, lr=lr)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "num_updates": self.num_updates,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.num_updates = int(state["num_updates"])
        self.skipped_steps = int(state["skipped_steps"])
