"""Policy-gradient losses as pure functions of tensors.

Every policy loss has the same shape of signature (``PolicyLossFn``):

    loss_fn(logp [B, L], old_logp [B, L], advantages [B, L] | [B], mask [B, L], *, <its hyperparameters>,
            weights [B, L] | None = None) -> (per-token loss [B, L], metrics)

and returns the loss per token, 0 where mask is 0; the scalar comes from ``aggregation.aggregate`` and is the
same call whatever the loss. Off-policy corrections are meant to be added next to ``clipped_surrogate`` as their
own short functions with this signature (GSPO, CISPO, decoupled PPO), or as functions that produce ``weights``:
a per-token multiplier, treated as a constant, which covers truncated IS (TIS: w = min(ρ, C)) and double-sided
IS masking (IcePop: w = ρ·1[α ≤ ρ ≤ β]). A rejection that should also leave the token-count denominator is
instead multiplied into ``mask``.

The entropy bonus enters the loss as ``loss = pg − entropy_coef · aggregate(entropy)`` with the same
aggregation mode and denominator as the policy-gradient term (``entropy_bonus``).

Metrics are detached 0-dim tensors (call ``.item()`` when logging, once per step, to avoid device syncs);
fractions are over the unmasked tokens of the batch given.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tether.algo.aggregation import AggMode, Denominator, aggregate

Metrics = dict[str, torch.Tensor]

# verl clamps the log-ratio to [-20, 20] before exp (core_algos.compute_policy_loss_vanilla): e^20 ≈ 4.9e8 is
# finite in fp32/bf16, and a token that far off-policy is clipped anyway.
MAX_LOG_RATIO = 20.0


class PolicyLossFn(Protocol):
    """The signature every policy loss in this module follows (hyperparameters are extra keyword arguments)."""

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]: ...


def importance_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, *, max_log_ratio: float = MAX_LOG_RATIO
) -> torch.Tensor:
    """r = exp(clamp(log π_θ − log π_old, −max_log_ratio, max_log_ratio)), per token [B, L]."""
    return torch.exp(torch.clamp(logp - old_logp, -max_log_ratio, max_log_ratio))


def token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages [B] or [B, L] as a detached tensor broadcastable to the tokens ``like`` [B, L]."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1] one advantage per sequence, broadcast over L
    if advantages.shape[0] != like.shape[0] or advantages.shape[-1] not in (1, like.shape[-1]):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, L] for tokens {tuple(like.shape)}")
    return advantages.detach()


def _masked_fraction(flag: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return aggregate(flag.to(torch.float32), mask, "token_mean").detach()


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate, per token, with asymmetric clip range and optional dual clip.

        r   = exp(log π_θ − log π_old)
        ℓ   = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))    PPO, Schulman et al. 2017 (arXiv 1707.06347)
        ℓ   = min(ℓ, c·|A|)   where A < 0                      dual clip, Ye et al. 2020 (arXiv 1912.09729)
        ℓ   = w·ℓ             where weights are given (a constant)

    ε_low ≠ ε_high is DAPO's "clip-higher" (Yu et al. 2025, arXiv 2503.14476: ε_low = 0.2, ε_high = 0.28; the
    seed config's ``clip_higher: 0.28`` is ε_high). Dual clip bounds the loss of a negative-advantage token whose
    ratio has run away (r > c), where plain PPO's max() would let −A·r grow without bound; verl's
    ``compute_policy_loss_vanilla`` does the same with ``clip_ratio_c`` (default 3, always on there; here the
    config's ``policy_optimization.clip_ratio_c``, None = off).

    A token is counted as clipped only when the clip is active, i.e. its gradient is cut: r < 1 − ε_low with
    A < 0 (``clip_ratio_low``), r > 1 + ε_high with A > 0 (``clip_ratio_high``), as TRL counts them. A ratio
    exactly on a bound is *not* clipped: both branches agree there and the gradient −A·∇r flows (torch.clamp
    passes the gradient at its bounds).

    Args:
        logp: [B, L] log π_θ of the sampled tokens (with grad).
        old_logp: [B, L] log π_old, the policy that the advantages were computed for (no grad).
        advantages: [B, L] per token, or [B] per sequence (broadcast over L). Treated as constants.
        mask: [B, L] 1 for tokens trained on. logp at masked positions may hold any number or ±inf (the
            log-ratio is clamped); a NaN there would still reach the gradient through exp's backward.
        clip_low: ε_low ∈ [0, 1).
        clip_high: ε_high ≥ 0.
        dual_clip: c > 1, or None for no dual clip.
        weights: [B, L] per-token multiplier (IS correction), detached; None = 1.
        max_log_ratio: clamp on log r before exp.

    Returns:
        loss: [B, L] per-token loss, 0 where mask is 0.
        metrics: ``clip_ratio_low``, ``clip_ratio_high``, ``dual_clip_ratio`` (r > c with A < 0; 0 without dual
            clip), ``ratio_mean`` (mean r), ``ppo_kl`` (mean of log π_old − log π_θ; verl's ``ppo_kl`` averages
            the log-ratio after its ±20 clamp, this one before).
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}")
    if not (logp.shape == old_logp.shape == mask.shape) or logp.dim() != 2:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, mask {tuple(mask.shape)} must be equal [B, L]"
        )

    adv = token_advantages(advantages, logp)  # [B, L] or [B, 1]
    log_ratio = logp - old_logp.detach()  # [B, L]
    ratio = importance_ratio(logp, old_logp.detach(), max_log_ratio=max_log_ratio)  # [B, L]
    unclipped = -adv * ratio  # [B, L]
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # [B, L]
    loss = torch.maximum(unclipped, clipped)  # [B, L]
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)  # [B, L]
    if weights is not None:
        if weights.shape != logp.shape:
            raise ValueError(f"weights {tuple(weights.shape)} must be [B, L] = {tuple(logp.shape)}")
        loss = loss * weights.detach()
    loss = torch.where(mask.bool(), loss, torch.zeros_like(loss))  # [B, L]

    with torch.no_grad():
        r = ratio.detach()
        dual_active = (adv < 0) & (r > dual_clip) if dual_clip is not None else torch.zeros_like(r, dtype=torch.bool)
        metrics = {
            "clip_ratio_low": _masked_fraction((r < 1.0 - clip_low) & (adv < 0), mask),
            "clip_ratio_high": _masked_fraction((r > 1.0 + clip_high) & (adv > 0), mask),
            "dual_clip_ratio": _masked_fraction(dual_active, mask),
            "ratio_mean": aggregate(r, mask, "token_mean"),
            "ppo_kl": aggregate(-log_ratio.detach(), mask, "token_mean"),
        }
    return loss, metrics


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    mode: AggMode,
    norm_len: int | None = None,
    denom: Denominator | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The entropy term to add to the loss: −coef · aggregate(H), aggregated like the policy-gradient loss.

        loss = pg − coef · agg(H)      verl ``policy_loss -= entropy_coeff * agg_loss(entropy)``

    A positive coef rewards entropy (exploration; the seed config's ``entropy_coef: 0.01``). Pass the same
    ``mode``, ``norm_len`` and ``denom`` as for the policy-gradient term so micro-batching stays exact.

    Args:
        entropy: [B, L] per-token entropy, from ``entropy_from_logits`` (with grad).
        mask: [B, L].
        coef: entropy coefficient.

    Returns:
        term: [] −coef · agg(H), to be added to the loss.
        metrics: ``entropy`` (mean per-token entropy over unmasked tokens, nats), ``entropy_coef``.
    """
    term = -coef * aggregate(entropy, mask, mode, norm_len=norm_len, denom=denom)  # []
    metrics = {
        "entropy": aggregate(entropy.detach(), mask, "token_mean"),
        "entropy_coef": torch.tensor(float(coef)),
    }
    return term, metrics
