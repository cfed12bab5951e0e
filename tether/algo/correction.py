"""Off-policy correction between the behaviour policy (the rollout engine) and the learner's proximal policy.

Three policies meet in an asynchronous step (Hilton et al. 2021, arXiv 2110.00641; AReaL, arXiv 2505.24298):

    π_behav   sampled the tokens: the engine's logprobs, recorded on the trajectory (``behav_logp``)
    π_prox    the learner's weights at the start of the step, scored without grad (``prox_logp``)
    π_θ       the weights being optimised (``logp``)

The trust region (PPO clip) is taken around π_prox; the gap π_prox/π_behav — stale weights, or the engine's
kernels and precision differing from the learner's — is corrected by a per-token weight, a constant:

    Δ_t  = log π_prox − log π_behav (clamped to ±20, as ``losses.importance_ratio``)
    ρ_t  = exp(Δ_t)                          token ratio
    ρ_i  = exp(Σ_t m_t·Δ_t)                  sequence ratio (product over the sequence's model tokens)
    ρ̄_i  = exp(Σ_t m_t·Δ_t / Σ_t m_t)        geometric mean (length-normalised sequence ratio)

    method                   level="token"               level="sequence" (broadcast to the sequence's tokens)
    "truncated"              min(ρ_t, C)                 min(ρ_i, C)
    "double_sided"           ρ_t·1[ρ_t ∈ band]           ρ̄_i·1[ρ̄_i ∈ band]
    "double_sided_truncated" min(ρ_t, C)·1[ρ_t ∈ band]   min(ρ_i, C)·1[ρ̄_i ∈ band]
    "double_sided_mask"      1[ρ_t ∈ band]               1[ρ̄_i ∈ band]
    "none"                   1                           1

with band = [1 − ε_low, 1 + ε_high], bounds included. "truncated" is TIS (Yao, Liu et al. 2025, "Your efficient
RL framework secretly brings you off-policy RL training", fengyao.notion.site/off-policy-rl: token level, upper
cap only); "double_sided" is IcePop (Ling team, arXiv 2510.18855: M(ρ) = ρ inside [α, β], 0 outside).

Why the sequence-level band tests the geometric mean and not the product: the band is a per-token tolerance.
log ρ_i is a sum over T tokens, so a fixed band on the product rejects almost every long agentic trajectory
(a systematic mismatch of 1e-3 nats per token over 2,000 tokens gives ρ_i = e² ≈ 7.4, far outside [0.8, 1.2]),
whereas ρ̄ is length-invariant (verl's Geo-RS rejection, and GSPO's sequence ratio, normalise the same way).
The *weight* at sequence level is the product (capped), the ratio that makes sequence-level IS unbiased, as in
TIS/verl ``rollout_is: sequence`` and TRL ``sequence_truncate``.

From the config (``learner.off_policy_correction``): ``double_sided_importance_sampling`` → "double_sided", or
"double_sided_truncated" with ``tis_enabled`` (the weight, capped) and "double_sided_mask" without it (rejection
only: tokens outside the band are masked, those inside keep weight 1, as verl's rejection sampling without its
importance weights); ``truncated_importance_sampling`` → "truncated"; ``decoupled_ppo`` →
``decoupled_surrogate`` (``behav_cap`` = C with ``tis_enabled``); ``clip_ratio`` → ε_low = ε_high;
``token_level_clipping`` → level "token", else "sequence".

``keep`` is ``mask`` with the rejected tokens set to 0. IcePop keeps rejected tokens in the token-count
denominator (weight 0, mask unchanged): pass ``weights`` only. Pass ``keep`` as the mask as well to take them
out of the denominator too (see ``losses.py``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from tether.algo.aggregation import aggregate
from tether.algo.losses import MAX_LOG_RATIO, Metrics, clipped_surrogate

ISMethod = Literal["truncated", "double_sided", "double_sided_truncated", "double_sided_mask", "none"]
ISLevel = Literal["token", "sequence"]
_METHODS = ("truncated", "double_sided", "double_sided_truncated", "double_sided_mask", "none")
_LEVELS = ("token", "sequence")


def _check_shapes(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if mask.dim() != 2 or any(t.shape != mask.shape for t in tensors.values()):
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items())
        raise ValueError(f"{shapes} and mask {tuple(mask.shape)} must be equal [B, L]")


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return aggregate(x.to(torch.float32), mask, "token_mean").detach()


def behaviour_log_ratio(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, *, max_log_ratio: float = MAX_LOG_RATIO
) -> torch.Tensor:
    """Δ = clamp(log π_prox − log π_behav, ±max_log_ratio), detached, 0 where mask is 0. [B, L]"""
    _check_shapes(mask, prox_logp=prox_logp, behav_logp=behav_logp)
    delta = (prox_logp.detach() - behav_logp.detach()).clamp(-max_log_ratio, max_log_ratio)  # [B, L]
    return torch.where(mask.bool(), delta, torch.zeros_like(delta))  # masked garbage (±inf, NaN) never leaks


def mismatch_metrics(train_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """The train–inference mismatch over the ``mask`` tokens, as the field measures it: the trainer's and the engine's
    log-probabilities of the same tokens under the *same* weights (so any gap is arithmetic: kernels, precision,
    batch shapes — or weights that never reached the engine).

    With Δ_t = log π_train − log π_behav (clamped to ±``MAX_LOG_RATIO``) and r_t = e^Δ_t over tokens the engine
    sampled: ``logp_abs_diff_mean`` = mean |Δ_t| (TRL #5312: 0.010–0.018 healthy in bf16 on GPU, 0.20 when a sync
    silently failed), ``mismatch_kl`` = mean (r_t − 1 − Δ_t), the k3 estimator of KL(π_behav ‖ π_train) (≥ 0 per
    token; dense models e-5..e-3 in bf16), ``mismatch_tokens`` = how many tokens they are over.

    Args:
        train_logp: [B, L] the trainer's log π (no grad needed). behav_logp: [B, L] the engine's.
        mask: [B, L] 1 on the tokens to measure.
    """
    delta = behaviour_log_ratio(train_logp, behav_logp, mask).to(torch.float32)  # [B, L] 0 where masked
    k3 = torch.expm1(delta) - delta  # [B, L] 0 where masked (Δ = 0)
    return {"logp_abs_diff_mean": _token_mean(delta.abs(), mask), "mismatch_kl": _token_mean(k3, mask),
            "mismatch_tokens": mask.sum().to(torch.float32)}


def is_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    method: ISMethod,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    tis_cap: float = 2.0,
    level: ISLevel = "token",
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """Per-token behaviour-correction weights and keep-mask (the table in the module docstring).

    Args:
        prox_logp: [B, L] log π_prox of the sampled tokens (no grad).
        behav_logp: [B, L] log π_behav, the engine's logprobs recorded at sampling time.
        mask: [B, L] 1 for tokens trained on.
        method: "truncated" (TIS) | "double_sided" (IcePop) | "double_sided_truncated" | "double_sided_mask"
            (rejection only) | "none".
        clip_ratio_low, clip_ratio_high: ε_low ∈ [0, 1), ε_high ≥ 0 of the band [1 − ε_low, 1 + ε_high]
            (the seed's ``off_policy_correction.clip_ratio`` = 0.2 for both). Unused by "truncated".
        tis_cap: C > 0 (verl's ``rollout_is_threshold`` default 2.0). Unused by "double_sided"; with
            "double_sided_truncated" at token level it only bites when C < 1 + ε_high.
        level: "token" (``token_level_clipping: true``) or "sequence".

    Returns:
        weights: [B, L] detached float32, 0 where mask is 0 or the token is rejected.
        keep: [B, L] ``mask`` (its dtype) with rejected tokens set to 0.
        metrics: over the unmasked tokens: ``is_ratio_mean``, ``is_ratio_max``, ``is_ratio_min`` (the token
            ratio ρ_t whatever the method and level: the raw mismatch), ``is_log_ratio_abs`` (mean |log ρ_t|: the
            mismatch's size, which ``is_ratio_mean`` hides — E_behav[ρ] = 1 whatever π_prox is), ``is_weight_mean``,
            ``is_masked_fraction`` (rejected by the band), ``is_truncated_fraction`` (weight capped at C).
    """
    if method not in _METHODS:
        raise ValueError(f"unknown IS method {method!r}; expected one of {list(_METHODS)}")
    if level not in _LEVELS:
        raise ValueError(f"unknown IS level {level!r}; expected one of {list(_LEVELS)}")
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
    if not tis_cap > 0.0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    delta = behaviour_log_ratio(prox_logp, behav_logp, mask).to(torch.float32)  # [B, L]
    on = mask.bool()  # [B, L]
    rho_tok = torch.exp(delta)  # [B, L]
    if level == "token":
        rho_w = rho_band = rho_tok  # [B, L]
    else:
        total = delta.sum(dim=-1, keepdim=True)  # [B, 1]
        count = on.sum(dim=-1, keepdim=True).clamp_min(1)  # [B, 1] an empty row gives ρ = ρ̄ = 1
        rho_w = torch.exp(total.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).expand_as(delta)  # [B, L] product
        rho_band = torch.exp(total / count).expand_as(delta)  # [B, L] geometric mean

    truncate = method in ("truncated", "double_sided_truncated")
    band = method in ("double_sided", "double_sided_truncated", "double_sided_mask")
    if method in ("none", "double_sided_mask"):
        weights = torch.ones_like(delta)
    elif truncate:
        weights = rho_w.clamp(max=tis_cap)  # [B, L]
    else:
        weights = rho_band  # [B, L] IcePop: the ratio itself inside the band
    inside = (rho_band >= 1.0 - clip_ratio_low) & (rho_band <= 1.0 + clip_ratio_high) if band else on  # [B, L]
    kept = on & inside  # [B, L]
    weights = torch.where(kept, weights, torch.zeros_like(weights))  # [B, L]
    keep = mask * kept.to(mask.dtype)  # [B, L]

    metrics = {
        "is_ratio_mean": _token_mean(rho_tok, mask),
        "is_log_ratio_abs": _token_mean(delta.abs(), mask),
        "is_ratio_max": rho_tok[on].max() if on.any() else torch.tensor(1.0),
        "is_ratio_min": rho_tok[on].min() if on.any() else torch.tensor(1.0),
        "is_weight_mean": _token_mean(weights, mask),
        "is_masked_fraction": _token_mean(on & ~inside, mask),
        "is_truncated_fraction": _token_mean(kept & (rho_w > tis_cap), mask) if truncate else torch.tensor(0.0),
    }
    return weights.detach(), keep, metrics


def decoupled_surrogate(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    behav_cap: float | None = None,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Decoupled PPO: the clip around π_prox, the behaviour gap corrected by a (truncated) weight.

        r = π_θ / π_prox,   w = π_prox / π_behav   (min(w, C) when ``behav_cap`` = C is given)
        ℓ = w · max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))     Hilton et al. 2021 (arXiv 2110.00641)

    which is ``clipped_surrogate(logp, prox_logp, ...)`` with ``weights = w``. Hilton's objective leaves w
    untruncated. AReaL (arXiv 2505.24298, ``ppo_actor_loss_fn``'s ``behav_imp_weight_cap``) instead zeroes the
    weight of tokens with w above its cap, keeping them in the token-count denominator, and has no lower bound;
    the nearest here is ``is_weights(method="double_sided", clip_ratio_high=cap − 1, clip_ratio_low=ε_low)``
    followed by ``clipped_surrogate`` with those weights, which also rejects w < 1 − ε_low (ε_low < 1, so that
    lower bound cannot be switched off). AReaL also takes w = exp(log π_prox − log π_behav) unclamped.
    With π_prox = π_behav it is PPO (w = 1). Not a ``PolicyLossFn``: it takes ``behav_logp`` as well.

    Args:
        logp: [B, L] log π_θ (with grad).
        prox_logp: [B, L] log π_prox (no grad); behav_logp: [B, L] log π_behav.
        advantages: [B] or [B, L]; mask: [B, L].
        clip_low, clip_high, dual_clip: as in ``clipped_surrogate``.
        behav_cap: C > 0 to truncate w (TIS), None for Hilton's untruncated w.
        weights: [B, L] further per-token multiplier (e.g. from ``is_weights``), detached; None = 1.

    Returns:
        loss: [B, L] per-token loss, 0 where mask is 0.
        metrics: those of ``clipped_surrogate`` plus ``behav_weight_mean``, ``behav_weight_max`` and
            ``behav_truncated_fraction`` over the unmasked tokens.
    """
    if behav_cap is not None and not behav_cap > 0.0:
        raise ValueError(f"behav_cap must be > 0 or None, got {behav_cap}")
    cap = math.inf if behav_cap is None else behav_cap
    w, _, m_is = is_weights(prox_logp, behav_logp, mask, method="truncated", tis_cap=cap)  # [B, L], min(ρ, C)
    if weights is not None:
        if weights.shape != w.shape:
            raise ValueError(f"weights {tuple(weights.shape)} must be [B, L] = {tuple(w.shape)}")
        w = w * weights.detach()
    loss, metrics = clipped_surrogate(
        logp, prox_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, weights=w
    )
    on = mask.bool()
    metrics["behav_weight_mean"] = _token_mean(w, mask)
    metrics["behav_weight_max"] = w[on].max().detach() if on.any() else torch.tensor(1.0)
    metrics["behav_truncated_fraction"] = m_is["is_truncated_fraction"]
    return loss, metrics
