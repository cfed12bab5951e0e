"""A micro-batch's loss as a pure function of tensors: ``loss_fn(inputs: LossInputs, ...) -> LossOutputs``.

    loss = agg(policy_loss(logp, prox_logp, A, mask, weights=w)) − entropy_coef · agg(H)
           + kl_coef · agg(KL̂(π_θ ‖ π_ref))
           + coef · agg(ℓ_distill)       (with a teacher; alone when ``teacher.rl_loss`` is false: ``distill.py``)

The policy loss, its aggregation and the off-policy correction w come from the ``Objective`` (``objective.py``);
``Accumulation`` (``accumulate.py``) forwards the model to fill ``LossInputs`` and back-propagates the result.

Every ``agg`` here has denominator 1: the loss is the micro-batch's *undivided* sum, and ``Accumulation`` divides
the summed gradient by the whole mini-batch's denominator, so micro-batch × accumulation is the one-pass update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tether.algo import aggregate, entropy_bonus, kl_penalty
from tether.algo.kl import KLKind
from tether.learner.distill import Distillation, DistillInputs
from tether.learner.objective import Objective

_POLICY_METRICS = ("clip_ratio_low", "clip_ratio_high", "dual_clip_ratio", "cispo_clip_ratio")
_IS_METRICS = ("is_ratio_mean", "is_log_ratio_abs", "is_masked_fraction")


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's tensors as the loss reads them; positions are shifted (L = T-1: position t predicts the
    token at t+1), and everything is 0 where ``mask`` is 0."""

    logp: torch.Tensor  # [b, L] log π_θ(token) at the sampling temperature, with grad
    prox_logp: torch.Tensor | None  # [b, L] π_prox, the trust region's centre; None: π_prox = π_behav (no correction)
    behav_logp: torch.Tensor  # [b, L] the engine's, recorded at sampling time
    advantages: torch.Tensor  # [b] one per trajectory (row)
    mask: torch.Tensor  # [b, L] 1 on the model-sampled tokens
    entropy: torch.Tensor  # [b, L] H(π_θ) at the sampling temperature (with grad only under an entropy bonus)
    ref_logp: torch.Tensor | None = None  # [b, L] the KL reference's; None: KL is off
    distill: DistillInputs | None = None  # the student's and teacher's tensors, with a teacher


@dataclass(frozen=True)
class LossOutputs:
    loss: torch.Tensor  # [] the micro-batch's loss, undivided (denominator 1)
    metrics: dict[str, torch.Tensor]  # name -> [] per-token mean over the micro-batch's model tokens


def loss_fn(inputs: LossInputs, objective: Objective, *, entropy_coef: float, kl_coef: float,
            kl_estimator: KLKind, distill: Distillation | None = None) -> LossOutputs:
    """The policy-gradient loss of ``objective``, with the entropy bonus, the KL penalty (when ``inputs.ref_logp``
    is given) and the distillation term (with ``distill``), as in the module docstring."""
    mask = inputs.mask  # [b, L]
    mode = objective.agg_mode
    agg: dict[str, Any] = dict(mode=mode, denom=1.0,
                               norm_len=objective.norm_len if mode == "seq_mean_token_sum_norm" else None)

    corrected = inputs.prox_logp is not None  # π_prox ≠ π_behav: the off-policy correction applies
    prox_logp = inputs.prox_logp if inputs.prox_logp is not None else inputs.behav_logp  # [b, L]
    weights, m_is = objective.weights(prox_logp, inputs.behav_logp, mask) if corrected else (None, {})
    pg_tok, m_pg = objective.policy_loss(inputs.logp, prox_logp, inputs.advantages, mask, weights=weights)  # [b, L]
    loss = aggregate(pg_tok, mask, **agg)
    metrics = {f"optim/{k}": m_pg[k] for k in _POLICY_METRICS if k in m_pg}
    metrics.update({f"optim/{k}": m_is[k] for k in _IS_METRICS if k in m_is})
    if distill is not None:  # + coef · distillation, or it alone (teacher.rl_loss: false)
        if inputs.distill is None:
            raise ValueError("loss_fn: a distillation term without its inputs (LossInputs.distill)")
        term, m_teacher = distill.term(inputs.distill, inputs.logp, inputs.behav_logp, mask, agg)
        loss = loss + term if distill.rl_loss else term
        metrics.update(m_teacher)

    ent_term, m_ent = entropy_bonus(inputs.entropy, mask, coef=entropy_coef, **agg)
    metrics["optim/entropy"] = m_ent["entropy"]
    if entropy_coef > 0:
        loss = loss + ent_term

    if inputs.ref_logp is not None:
        kl_term, m_kl = kl_penalty(inputs.logp, inputs.ref_logp, mask, coef=kl_coef, kind=kl_estimator, **agg)
        loss = loss + kl_term
        metrics["optim/kl_divergence"] = m_kl["kl"]
    return LossOutputs(loss, metrics)
