"""On-policy distillation losses: the student samples, a teacher scores the sampled tokens (``tether.teacher``).

Notation per response position t of a student rollout: q = π_θ and p = π_T, the student and the teacher, both
at temperature 1 (their raw softmax: the teacher is scored so, and comparing like with like makes q = p the fixed
point, whatever the sampling temperature τ); μ = the behaviour policy that sampled the token at τ (the engine's
logprob), q_τ = softmax(z_θ / τ) the student's sampling distribution, ρ_t = q_τ(x_t)/μ(x_t) (1 on-policy; off-policy
after the first update of a step, or in the async modes). With τ = 1, q_τ = q.

**Reverse KL on the sampled tokens** (``reverse_kl_loss``): KL(q ‖ p) = E_{x~q}[log q(x) − log p(x)], per token,
estimated on the student's own samples with Schulman's estimators ("Approximating KL Divergence", 2020;
``tether.algo.kl``), log r = log p − log q:

    k1 = −log r = log q − log p                 unbiased, can be negative
    k3 = (r − 1) − log r                        unbiased, low variance, ≥ 0

An unbiased *value* is not an unbiased *gradient* (Tang & Munos, "On a few pitfalls in KL divergence gradient
estimation for RL", arXiv 2506.09477): back-propagating k1 itself gives E_q[∇log q] = 0 in expectation. So:

    k1: ℓ_t = sg(log q − log p) · ρ_t                        ∇ = E_μ[ρ (log q − log p) ∇log q_τ]
        — the score-function (policy-gradient) form: the per-token reverse KL as a negative advantage with
        discount 0 and an importance weight, as Thinking Machines' "On-Policy Distillation" (2025) trains it;
        = ∇KL(q ‖ p) at τ = 1, exact per token on- and off-policy (the state distribution is not corrected:
        discount 0). At τ ≠ 1 the tokens come from q_τ and the advantage −(log q − log p) still vanishes only at
        q = p (scoring the student at τ against a teacher at 1 would pull it to softmax(z_θ/τ) = p instead, i.e.
        toward τ × the teacher's logits: a student distilled from itself would move).
    k3: ℓ_t = sg(ρ_t) · k3(log q, log p)  back-propagated     ∇ = E_μ[ρ (1 − p/q) ∇log q] = ∇KL(p ‖ q)
        — verl's OPD default (``distillation_loss.loss_mode: k3``, GRPO's KL term). Its value estimates the
        reverse KL, but its expected gradient (at τ = 1) is that of the *forward* KL KL(p ‖ q) over the full
        vocabulary at each visited state. Same fixed point (q = p), different path. k3 is clamped as in
        ``tether.algo.kl`` (log r to ±20, k3 ≤ 10: a token past the clamp passes no gradient).

**Top-k forward KL** (``topk_forward_kl``): where the teacher returns its top-k log-probs at each position
(GKD's forward KL, Agarwal et al. 2023, arXiv 2306.13649, on student-generated states), over the K teacher ids
plus one "rest of the vocabulary" outcome:

    KL_K(p ‖ q) = Σ_{j∈K} p_j (log p_j − log q_j) + p_rest (log p_rest − log q_rest),   p_rest = 1 − Σ_K p_j

back-propagated through the student's full softmax. It is the exact KL of the two distributions coarsened to
K+1 outcomes: ≥ 0, a lower bound on the full forward KL, and 0 iff q matches p on the K ids. Departure from
verl's ``forward_kl_topk``, which drops the rest term (Σ_K p (log p − log q), then ``clamp_min(0)``): its minimum
is at q_j = p_j / Σ_K p, i.e. it pushes the student to put *all* its mass on the teacher's top k.

Aggregation (token_mean, …) is the caller's: these functions return per-token values, 0 where the mask is 0.
"""

from __future__ import annotations

from typing import Literal

import torch

from tether.algo.aggregation import aggregate
from tether.algo.kl import kl_estimate
from tether.algo.losses import importance_ratio

DistillEstimator = Literal["k1", "k3"]
_ESTIMATORS = ("k1", "k3")
_MIN_REST = 1e-6  # floor of the rest-of-vocabulary mass, so its log stays finite when the top k hold everything


def _check_same(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shapes must be equal: {shapes}")


def reverse_kl_loss(
    logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: DistillEstimator,
    sample_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token reverse-KL distillation loss on the sampled tokens (formulas in the module docstring).

    Args:
        logp: [B, L] log q(x_t), the student's log-prob of the sampled token at temperature 1 (with grad).
        teacher_logp: [B, L] log p(x_t), the teacher's at temperature 1 (no grad).
        behav_logp: [B, L] log μ(x_t), the behaviour log-prob recorded at sampling (no grad).
        mask: [B, L] 1 on the student's sampled tokens.
        estimator: "k1" (score-function form) | "k3" (back-propagated).
        sample_logp: [B, L] log q_τ(x_t), the student's at the sampling temperature (with grad), for ρ (and k1's
            score function); None = ``logp`` (τ = 1).

    Returns:
        loss: [B, L] per-token loss, 0 where the mask is 0.
        metrics: ``kl`` — [] mean per-token estimate (of the chosen estimator) of KL(q ‖ p) over unmasked tokens.
    """
    if estimator not in _ESTIMATORS:
        raise ValueError(f"unknown distillation estimator {estimator!r}; expected one of {list(_ESTIMATORS)}")
    sample_logp = logp if sample_logp is None else sample_logp
    _check_same(logp=logp, teacher_logp=teacher_logp, behav_logp=behav_logp, mask=mask, sample_logp=sample_logp)
    on = mask.bool()  # [B, L]
    zero = torch.zeros_like(logp)
    # Masked positions are scored as q = p = μ (KL̂ = 0, ρ = 1), so ±inf there cannot make a NaN gradient.
    logp = torch.where(on, logp, zero)  # [B, L]
    sample_logp = torch.where(on, sample_logp, zero)  # [B, L]
    teacher_logp = torch.where(on, teacher_logp.detach(), zero)  # [B, L]
    behav_logp = torch.where(on, behav_logp.detach(), zero)  # [B, L]
    ratio = importance_ratio(sample_logp, behav_logp)  # [B, L] ρ = q_τ/μ, log-ratio clamped to ±20
    if estimator == "k1":
        value = kl_estimate(logp, teacher_logp, "k1")  # [B, L] log q − log p
        loss = value.detach() * ratio  # [B, L] ∇ = ρ (log q − log p) ∇log q_τ
    else:
        value = kl_estimate(logp, teacher_logp, "k3")  # [B, L] (r − 1) − log r, clamped as in algo.kl
        loss = ratio.detach() * value  # [B, L] ∇ = ρ (1 − p/q) ∇log q
    loss = torch.where(on, loss, zero)
    return loss, {"kl": aggregate(value.detach(), mask, "token_mean")}


def gather_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, *,
                    chunk_tokens: int = 1024) -> torch.Tensor:
    """log_softmax(logits / T) gathered at K ids per position, without a [B, L, V] log-softmax in memory.

    Args:
        logits: [B, L, V] (aligned: logits[:, t] is the distribution of position t).
        ids: [B, L, K] token ids (any valid id where unused: the caller masks those entries).
        temperature: T > 0.

    Returns:
        [B, L, K] float32 log-probabilities (with grad through ``logits``).
    """
    if logits.dim() != 3 or ids.dim() != 3 or ids.shape[:2] != logits.shape[:2]:
        raise ValueError(f"need logits [B, L, V] and ids [B, L, K], got {tuple(logits.shape)} and {tuple(ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    flat = logits.reshape(-1, logits.shape[-1])  # [B*L, V]
    flat_ids = ids.reshape(-1, ids.shape[-1])  # [B*L, K]
    out = []
    for start in range(0, flat.shape[0], chunk_tokens):
        z = flat[start:start + chunk_tokens].float() / temperature  # [C, V]
        out.append(z.gather(-1, flat_ids[start:start + chunk_tokens]) - torch.logsumexp(z, -1, keepdim=True))
    if not out:
        return logits.new_zeros(ids.shape, dtype=torch.float32)
    return torch.cat(out).reshape(ids.shape)


def _log_rest(logps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log(1 − Σ_valid exp(logps)) over the last dim, the mass floored at ``_MIN_REST``. [.., K] → [..]."""
    mass = torch.where(valid, logps.exp(), torch.zeros_like(logps)).sum(-1)  # [..]
    return torch.log((1.0 - mass).clamp_min(_MIN_REST))


def topk_forward_kl(
    student_topk_logp: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    valid: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token forward KL over the teacher's top-k ids plus the rest of the vocabulary (module docstring).

    Args:
        student_topk_logp: [B, L, K] log q at the teacher's top-k ids (``gather_logprobs``; with grad).
        teacher_topk_logp: [B, L, K] log p at those ids (no grad).
        valid: [B, L, K] bool, False where the teacher returned fewer than K entries (ignored entries).
        mask: [B, L] 1 on the student's sampled tokens.

    Returns:
        loss: [B, L] KL_K(p ‖ q) per token, 0 where the mask is 0.
        metrics (means over unmasked tokens): ``topk_forward_kl``; ``teacher_mass`` / ``student_mass`` — the
        probability the teacher's top k hold under the teacher / the student.
    """
    _check_same(student=student_topk_logp, teacher=teacher_topk_logp, valid=valid)
    if student_topk_logp.shape[:2] != mask.shape:
        raise ValueError(f"top-k log-probs {tuple(student_topk_logp.shape)} do not match mask {tuple(mask.shape)}")
    valid = valid & mask.bool().unsqueeze(-1)  # [B, L, K]
    zero = torch.zeros_like(student_topk_logp)
    t_logp = torch.where(valid, teacher_topk_logp.detach(), zero)  # [B, L, K]
    s_logp = torch.where(valid, student_topk_logp, zero)  # [B, L, K]
    p = torch.where(valid, t_logp.exp(), zero)  # [B, L, K]
    head = (p * (t_logp - s_logp)).sum(-1)  # [B, L]
    t_rest, s_rest = _log_rest(t_logp, valid), _log_rest(s_logp, valid)  # [B, L]
    loss = head + t_rest.exp() * (t_rest - s_rest)  # [B, L]
    loss = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    metrics = {
        "topk_forward_kl": aggregate(loss.detach(), mask, "token_mean"),
        "teacher_mass": aggregate(p.sum(-1), mask, "token_mean"),
        "student_mass": aggregate(torch.where(valid, s_logp.detach().exp(), zero).sum(-1), mask, "token_mean"),
    }
    return loss, metrics
