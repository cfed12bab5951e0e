"""KL(π_θ ‖ π_ref) estimated per sampled token, and the penalty it adds to the loss.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html): for x ~ q = π_θ and
p = π_ref, with r = p(x)/q(x) = exp(log π_ref − log π_θ), KL[q ‖ p] = E_q[−log r] and

    k1 = −log r            = log π_θ − log π_ref       unbiased, high variance, can be negative
    k2 = ½ (log r)²                                     biased, low variance, ≥ 0
    k3 = (r − 1) − log r                                unbiased, low variance, ≥ 0 (log x ≤ x − 1)

GRPO (Shao et al. 2024, arXiv 2402.03300) adds k3 to the loss (not to the reward) with β = 0.04; verl calls it
``low_var_kl``. The log-ratio is clamped to [−20, 20] before use, as verl's ``kl_penalty_forward`` does, so that
exp(log r) stays finite; verl additionally clamps k3 to [−10, 10], which we do not (it zeroes the gradient of
the tokens that need it most).
"""

from __future__ import annotations

from typing import Callable, Literal

import torch

from tether.algo.aggregation import AggMode, Denominator, aggregate

KLKind = Literal["k1", "k2", "k3"]

MAX_LOG_RATIO = 20.0  # verl kl_penalty_forward: clamp(ref − logp, −20, 20)


def _k1(log_r: torch.Tensor) -> torch.Tensor:
    return -log_r


def _k2(log_r: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_r.square()


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    # expm1 keeps (r − 1) accurate for r ≈ 1; the clamp only removes rounding below 0 (the true value is ≥ 0).
    return (torch.expm1(log_r) - log_r).clamp_min(0.0)


_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind, *, max_log_ratio: float = MAX_LOG_RATIO
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from the sampled tokens' log-probs (formulas in the module docstring).

    Args:
        logp: [B, L] log π_θ (with grad).
        ref_logp: [B, L] log π_ref (no grad).
        kind: "k1" | "k2" | "k3".
        max_log_ratio: clamp on log r = ref_logp − logp.

    Returns:
        [B, L] estimate; values at masked positions are meaningless (aggregate with the mask).
    """
    if kind not in _ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(_ESTIMATORS)}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must be equal")
    log_r = torch.clamp(ref_logp.detach() - logp, -max_log_ratio, max_log_ratio)  # [B, L]
    return _ESTIMATORS[kind](log_r)


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    kind: KLKind,
    mode: AggMode,
    norm_len: int | None = None,
    denom: Denominator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-to-reference loss term: β · aggregate(k(logp, ref_logp)), aggregated like the policy-gradient loss.

        loss = pg + β · agg(KL̂)        GRPO objective (Shao et al. 2024); verl ``use_kl_loss``, TRL ``beta``

    ``coef`` is β for this step: fixed here; an adaptive controller (Ziegler et al. 2019, arXiv 1909.08593)
    would pass its current value. Pass the same ``mode``, ``norm_len`` and ``denom`` as for the policy-gradient
    term so micro-batching stays exact.

    Returns:
        term: [] β · agg(KL̂), to be added to the loss.
        metrics: ``kl`` (mean per-token estimate over unmasked tokens), ``kl_coef`` (β).
    """
    kl = kl_estimate(logp, ref_logp, kind)  # [B, L]
    term = coef * aggregate(kl, mask, mode, norm_len=norm_len, denom=denom)  # []
    metrics = {
        "kl": aggregate(kl.detach(), mask, "token_mean"),
        "kl_coef": torch.tensor(float(coef)),
    }
    return term, metrics
