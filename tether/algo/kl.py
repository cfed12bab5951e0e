"""KL(π_θ ‖ π_ref) estimated per sampled token, and the penalty it adds to the loss.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html): for x ~ q = π_θ and
p = π_ref, with r = p(x)/q(x) = exp(log π_ref − log π_θ), KL[q ‖ p] = E_q[−log r] and

    k1 = −log r            = log π_θ − log π_ref       unbiased, high variance, can be negative
    k2 = ½ (log r)²                                     biased, low variance, ≥ 0
    k3 = (r − 1) − log r                                unbiased, low variance, ≥ 0 (log x ≤ x − 1)

GRPO (Shao et al. 2024, arXiv 2402.03300) adds k3 to the loss (not to the reward) with β = 0.04; verl calls it
``low_var_kl``.

Clamping follows verl's ``kl_penalty_forward`` (``verl/trainer/ppo/core_algos.py``) exactly:
  * k1 and k2 are not clamped: they are polynomials in log r, finite whenever the log-probs are.
  * k3 only: log r is clamped to [−20, 20] before exp (e^20 ≈ 4.9e8 stays finite in fp32/bf16), and the
    estimate to [−10, 10] (the lower bound never binds, k3 ≥ 0). A clamp passes no gradient outside its bounds,
    so a token with k3 > 10 — log r > 2.61 (π_θ at least 13.6× below π_ref on that token) or log r < −11.0 —
    contributes 10 to the value and nothing to the gradient. That caps one token's KL gradient |1 − r| at
    e^2.61 − 1 ≈ 12.6 instead of up to e^20; the price is that the furthest-drifted tokens are not pulled back
    by the KL term (the policy-gradient clip still bounds them). ``max_k3=None`` removes that clamp.
Not implemented: verl's ``abs`` estimator and its ``k1+``/``k3+`` straight-through variants (value of the
estimator, gradient of k2). TRL's GRPO k3 clamps nothing.
"""

from __future__ import annotations

from typing import Literal

import torch

from tether.algo.aggregation import AggMode, Denominator, aggregate

KLKind = Literal["k1", "k2", "k3"]

MAX_LOG_RATIO = 20.0  # verl kl_penalty_forward, k3 only: clamp(ref − logp, −20, 20)
MAX_K3 = 10.0  # verl kl_penalty_forward, k3 only: clamp(kld, −10, 10)


def _k1(log_r: torch.Tensor) -> torch.Tensor:
    return -log_r


def _k2(log_r: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_r.square()


def _k3(log_r: torch.Tensor, max_log_ratio: float, max_k3: float | None) -> torch.Tensor:
    log_r = torch.clamp(log_r, -max_log_ratio, max_log_ratio)
    # expm1 keeps (r − 1) accurate for r ≈ 1; clamping at 0 only removes rounding below 0 (the true value is ≥ 0).
    return (torch.expm1(log_r) - log_r).clamp(0.0, max_k3)


_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: KLKind,
    *,
    max_log_ratio: float = MAX_LOG_RATIO,
    max_k3: float | None = MAX_K3,
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from the sampled tokens' log-probs (formulas in the module docstring).

    Args:
        logp: [B, L] log π_θ (with grad).
        ref_logp: [B, L] log π_ref (no grad).
        kind: "k1" | "k2" | "k3".
        max_log_ratio: k3 only: clamp on log r = ref_logp − logp before exp.
        max_k3: k3 only: upper clamp on the estimate (no gradient above it); None = no clamp.

    Returns:
        [B, L] estimate; values at masked positions are meaningless (aggregate with the mask).
    """
    if kind not in _ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(_ESTIMATORS)}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} must be equal")
    log_r = ref_logp.detach() - logp  # [B, L]
    if kind == "k1":
        return _k1(log_r)
    if kind == "k2":
        return _k2(log_r)
    return _k3(log_r, max_log_ratio, max_k3)


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

    ``coef`` is β for this step: a constant here; the learner passes its KL controller's current value
    (``kl_control.py``). Pass the same ``mode``, ``norm_len`` and ``denom`` as for the policy-gradient term so
    micro-batching stays exact. Masked positions are scored as log r = 0 (KL̂ = 0, no gradient), so ±inf
    log-probs there cannot turn the unclamped k1/k2 into a NaN gradient.

    Returns:
        term: [] β · agg(KL̂), to be added to the loss.
        metrics: ``kl`` (mean per-token estimate over unmasked tokens), ``kl_coef`` (β).
    """
    on = mask.bool()  # [B, L]
    ref_logp = torch.where(on, ref_logp.detach(), torch.zeros_like(ref_logp))  # [B, L] masked: 0
    logp = torch.where(on, logp, torch.zeros_like(logp))  # [B, L] masked: 0, so log r = 0 there
    kl = kl_estimate(logp, ref_logp, kind)  # [B, L]
    term = coef * aggregate(kl, mask, mode, norm_len=norm_len, denom=denom)  # []
    metrics = {
        "kl": aggregate(kl.detach(), mask, "token_mean"),
        "kl_coef": torch.tensor(float(coef)),
    }
    return term, metrics
