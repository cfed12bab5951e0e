"""Group-relative advantages: each sample's reward against the other samples of its prompt.

    Ã_i = r_i − mean_{j ∈ g(i)} r_j                                       group baseline
    A_i = Ã_i / (σ + eps)

with σ chosen by ``normalization``:
    "group"  σ = std_{j ∈ g(i)}(r_j), Bessel-corrected          GRPO, Shao et al. 2024 (arXiv 2402.03300)
    "batch"  σ = std_{all j}(Ã_j), Bessel-corrected            REINFORCE++-baseline, Hu et al. 2025 (arXiv 2501.03262)
    "none"   no division (A_i = Ã_i)                            Dr. GRPO, Liu et al. 2025 (arXiv 2503.20783)

On "batch": we follow REINFORCE++-baseline and take the std of the group-centred rewards Ã over the whole batch
(their batch mean is exactly 0, so REINFORCE++'s subtraction of the batch mean is a no-op here). TRL's
``scale_rewards="batch"`` (after "Tricks or Traps", arXiv 2508.08221) instead divides by the std of the raw
rewards, which also counts the spread *between* prompts; the two differ when prompts differ in mean reward.

Departures from the reference code, on purpose:
  * a group whose rewards are all equal gets advantages exactly 0 (we centre to exact zeros, so the
    eps in the denominator is never dividing rounding noise), and is counted in ``degenerate_group_ratio``;
  * a singleton group (std undefined with Bessel's correction) gets advantage 0 and is counted both in
    ``degenerate_group_ratio`` and ``singleton_group_ratio``; verl uses mean = 0, std = 1 there, i.e. A = r,
    which turns a lone sample's raw reward into a learning signal with no baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

Normalization = Literal["group", "batch", "none"]


def _group_index(n: int, group_ids: torch.Tensor | None, group_sizes: Sequence[int] | None, device) -> torch.Tensor:
    """[N] dense group index 0..G-1 from either per-sample ids or contiguous group sizes."""
    if (group_ids is None) == (group_sizes is None):
        raise ValueError("pass exactly one of group_ids ([N] tensor) or group_sizes (list of contiguous group sizes)")
    if group_sizes is not None:
        sizes = torch.as_tensor(list(group_sizes), dtype=torch.long, device=device)  # [G]
        if (sizes <= 0).any() or int(sizes.sum()) != n:
            raise ValueError(f"group_sizes {list(group_sizes)} must be positive and sum to N = {n}")
        return torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes)
    assert group_ids is not None  # exactly one of the two was given
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must be [N] = ({n},)")
    return torch.unique(group_ids.to(device), return_inverse=True)[1]


def _group_scale(centered: torch.Tensor, group_std: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return group_std[index]  # [N]; NaN for singletons, whose centred reward is 0 (handled by the caller)


def _batch_scale(centered: torch.Tensor, group_std: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    std = centered.std() if centered.numel() > 1 else centered.new_zeros(())  # [] Bessel, over all samples
    return std.expand_as(centered)


def _no_scale(centered: torch.Tensor, group_std: torch.Tensor, index: torch.Tensor) -> torch.Tensor | None:
    return None  # Dr. GRPO: the centred reward is the advantage


_SCALES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]] = {
    "group": _group_scale,
    "batch": _batch_scale,
    "none": _no_scale,
}


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    group_sizes: Sequence[int] | None = None,
    normalization: Normalization,
    eps: float = 1e-6,
    min_std: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantages (formulas and edge cases in the module docstring).

    Args:
        rewards: [N] one scalar reward per sample. Must be finite.
        group_ids: [N] any integer label per sample; samples with the same label form a group (any order).
        group_sizes: alternatively, sizes of contiguous groups, e.g. [8, 8, 8] for 3 prompts × 8 samples.
        normalization: "group" (GRPO) | "batch" (REINFORCE++-baseline) | "none" (Dr. GRPO).
        eps: added to σ; verl uses 1e-6, TRL 1e-4.
        min_std: a group with reward std ≤ min_std is counted as degenerate (metric only: its advantages are
            computed as usual; dropping such groups, as DAPO's dynamic sampling does, happens upstream).

    Returns:
        advantages: [N] in the dtype of ``rewards``; constant.
        metrics: ``advantage_std`` (Bessel std of the advantages), ``degenerate_group_ratio`` (fraction of groups
            with std ≤ min_std, singletons included), ``singleton_group_ratio``, ``num_groups``.
    """
    if normalization not in _SCALES:
        raise ValueError(f"unknown normalization {normalization!r}; expected one of {sorted(_SCALES)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite; a failed reward should be recorded on the trajectory, not NaN")
    r = rewards.detach().to(torch.float64)  # [N] float64: exact sums for small groups
    n = r.numel()
    index = _group_index(n, group_ids, group_sizes, r.device)  # [N] in 0..G-1
    num_groups = int(index.max()) + 1 if n else 0

    count = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, index, torch.ones_like(r))  # [G]
    mean = torch.zeros_like(count).index_add_(0, index, r) / count  # [G]
    gmax = torch.full_like(count, -torch.inf).scatter_reduce_(0, index, r, "amax")  # [G]
    gmin = torch.full_like(count, torch.inf).scatter_reduce_(0, index, r, "amin")  # [G]
    constant = gmax == gmin  # [G] all rewards equal, singletons included
    centered = torch.where(constant[index], torch.zeros_like(r), r - mean[index])  # [N]
    sq = torch.zeros_like(count).index_add_(0, index, centered.square())  # [G]
    group_std = torch.where(count > 1, (sq / (count - 1).clamp_min(1)).sqrt(), torch.nan)  # [G] NaN: singleton

    scale = _SCALES[normalization](centered, group_std, index)  # [N] or None
    if scale is None:
        adv = centered
    else:
        adv = torch.where(centered == 0, torch.zeros_like(r), centered / (scale + eps))  # [N] 0/NaN → 0

    singleton = count < 2  # [G]
    degenerate = singleton | (group_std <= min_std)  # [G]
    metrics = {
        "advantage_std": adv.std() if n > 1 else adv.new_zeros(()),
        "degenerate_group_ratio": degenerate.double().mean() if num_groups else r.new_zeros(()),
        "singleton_group_ratio": singleton.double().mean() if num_groups else r.new_zeros(()),
        "num_groups": torch.tensor(float(num_groups)),
    }
    return adv.to(rewards.dtype), {k: v.float() for k, v in metrics.items()}


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every token of sequence i its sequence advantage: A_{i,t} = A_i · m_{i,t}.

    Args:
        advantages: [B] one advantage per sequence.
        mask: [B, L] 1 for trained tokens.

    Returns:
        [B, L] advantages, 0 at masked positions.
    """
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] for mask {tuple(mask.shape)} [B, L]")
    return advantages.unsqueeze(-1) * mask.to(advantages.dtype)  # [B, L]
