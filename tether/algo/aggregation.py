"""Reduce a per-token loss [B, L] to the scalar that is back-propagated.

Three modes, named as in verl's ``loss_agg_mode`` (underscores instead of dashes):

    token_mean               Σ_{i,t} m·ℓ / Σ_{i,t} m              DAPO (Yu et al. 2025, arXiv 2503.14476)
    seq_mean_token_mean      1/B' Σ_i ( Σ_t m·ℓ / Σ_t m )         GRPO (Shao et al. 2024, arXiv 2402.03300)
    seq_mean_token_sum_norm  Σ_{i,t} m·ℓ / (B · norm_len)         Dr. GRPO (Liu et al. 2025, arXiv 2503.20783)

Fully masked sequences (every m_{i,t} = 0, e.g. a trajectory dropped by an overlong filter) never give NaN:
  * token_mean: they add nothing to the numerator or to the token count.
  * seq_mean_token_mean: they are left out of B' (B' = sequences with at least one token), as in verl's
    current ``agg_loss``, so dropping a sample does not shrink the weight of the others.
  * seq_mean_token_sum_norm: they add 0 to the numerator but still count in B — Dr. GRPO's normaliser is a
    constant (TRL's ``dr_grpo`` divides by ``loss.size(0) * max_completion_length``), independent of the data.
    Departure from verl: its ``seq-mean-token-sum-norm`` leaves fully masked sequences out of B, as for
    ``seq-mean-token-mean``; here B counts them, as TRL does.
  A batch in which everything is masked aggregates to 0.

Dr. GRPO's norm_len defaults to this batch's padded length L = mask.shape[-1], as verl's ``agg_loss`` does when
``loss_scale_factor`` is None; that changes with the data, so pass the constant. The learner passes
``engine.max_tokens × agent_loop.max_assistant_turns`` (``learner.objective.max_response_tokens``).
verl's ``token-sum`` and ``seq-mean-token-sum`` modes are not implemented.

Gradient accumulation. Each mode divides a sum over tokens by a denominator; the sum splits over
micro-batches, the denominator does not. ``loss_denominator(mask, mode)`` gives that denominator for a mask and
is additive, so a learner computes ``denom = Σ_micro loss_denominator(mb.mask, mode)`` over the whole step
(all-reduced over data-parallel ranks too; multiply by world size if the gradient is then averaged by DDP)
and passes it to ``aggregate(..., denom=denom)`` for every micro-batch: the sum of the micro-batch losses is then
the full-batch loss, and so is the gradient. For ``seq_mean_token_sum_norm`` also pass ``norm_len`` explicitly
(the configured max response length): micro-batches are padded to different L, so the default would differ.
verl passes the same global counts (``batch_num_tokens``, ``global_batch_size``) and multiplies by dp_size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

Denominator = int | float | torch.Tensor


def _token_count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum()


def _nonempty_sequence_count(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(dim=-1) > 0).sum()


def _sequence_count(mask: torch.Tensor) -> torch.Tensor:
    return torch.tensor(mask.shape[0], device=mask.device)


# What each mode divides by (besides norm_len for Dr. GRPO), in the units it counts.
_DENOMINATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "token_mean": _token_count,  # unmasked tokens
    "seq_mean_token_mean": _nonempty_sequence_count,  # sequences with ≥ 1 unmasked token
    "seq_mean_token_sum_norm": _sequence_count,  # all sequences, masked or not
}


def _check_mode(mode: str) -> None:
    if mode not in _DENOMINATORS:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {sorted(_DENOMINATORS)}")


def loss_denominator(mask: torch.Tensor, mode: AggMode) -> torch.Tensor:
    """The denominator ``aggregate`` uses by default for this mask: tokens, non-empty sequences or sequences.

    Additive over micro-batches: sum it over the micro-batches of a step and pass the total as ``denom``.
    """
    _check_mode(mode)
    return _DENOMINATORS[mode](mask)  # [] integer count


def _as_denominator(denom: Denominator, like: torch.Tensor) -> torch.Tensor:
    # Clamped to 1: a step with no tokens (all masked) has a zero numerator and aggregates to 0, not NaN.
    return torch.as_tensor(denom, dtype=like.dtype, device=like.device).clamp_min(1.0)


def aggregate(
    loss_per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode,
    *,
    norm_len: int | None = None,
    denom: Denominator | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss to a scalar (formulas and masked-sequence rules in the module docstring).

    Args:
        loss_per_token: [B, L] any per-token quantity (policy-gradient loss, entropy, KL).
        mask: [B, L] 1 where the token is trained on (model-sampled), 0 elsewhere. Values at masked positions of
            ``loss_per_token`` are ignored, even inf/NaN in the forward pass.
        mode: "token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum_norm".
        norm_len: Dr. GRPO's constant length (seq_mean_token_sum_norm only); default L = mask.shape[-1], which
            varies with the batch (pass the configured maximum response length instead).
        denom: global denominator for gradient accumulation, in the units of ``loss_denominator(mask, mode)``;
            default: this batch's own.

    Returns:
        [] scalar loss.
    """
    _check_mode(mode)
    if loss_per_token.shape != mask.shape or loss_per_token.dim() != 2:
        raise ValueError(
            f"loss_per_token {tuple(loss_per_token.shape)} and mask {tuple(mask.shape)} must be equal [B, L]"
        )
    if norm_len is not None and mode != "seq_mean_token_sum_norm":
        raise ValueError(f"norm_len only applies to seq_mean_token_sum_norm, not {mode!r}")
    keep = mask.bool()  # [B, L]
    m = keep.to(loss_per_token.dtype)  # [B, L]
    masked = torch.where(keep, loss_per_token, torch.zeros_like(loss_per_token))  # [B, L]
    d = _as_denominator(loss_denominator(mask, mode) if denom is None else denom, masked)  # []
    if mode == "seq_mean_token_mean":
        seq_loss = masked.sum(dim=-1) / m.sum(dim=-1).clamp_min(1.0)  # [B] empty sequences give 0
        return seq_loss.sum() / d
    if mode == "seq_mean_token_sum_norm":
        length = mask.shape[-1] if norm_len is None else norm_len
        if length <= 0:
            raise ValueError(f"norm_len must be positive, got {length}")
        return masked.sum() / (d * length)
    return masked.sum() / d  # token_mean
