"""The learner's side of distillation: the teacher's scores as batch tensors, and the loss term.

    loss = pg + coef · agg(ℓ_distill)      teacher.rl_loss: true
    loss = coef · agg(ℓ_distill)           teacher.rl_loss: false (pure on-policy distillation)

(+ the entropy bonus and the reference KL when configured, in both cases). ℓ_distill per token is
``reverse_kl_loss`` (estimator ``teacher.kl_estimator``) or ``topk_forward_kl`` (``tether.algo.distill``), and
``agg`` is the policy-gradient term's aggregation with the whole mini-batch's denominator, so micro-batching
stays exact. Student and teacher are compared at temperature 1: the teacher is scored so (a server's prompt
log-probs are the raw model's), and the student's log-probs here come from the same logits as the RL term's but
without ``engine.temperature``, so the fixed point is the teacher itself whatever the sampling temperature (at
τ = 0.7 against a teacher at 1 it would be softmax(z/τ) = p: τ × the teacher's logits, and a student would move
away from a copy of itself). Only the importance ratio ρ = q_τ/μ uses the student at ``engine.temperature``: the
distribution that sampled.

Metrics (means over the model tokens of the step, like ``optim/*``):
    teacher/kl          per-token estimate (k1 or k3, ``teacher.kl_estimator``) of KL(student ‖ teacher) at
                        temperature 1 on the sampled tokens, under the weights being trained
    teacher/loss        per-token distillation loss before ``coef`` (k1: ρ·k1 ≈ teacher/kl; k3: ρ·k3;
                        topk_forward_kl: KL_K)
    teacher/topk_forward_kl, teacher/teacher_mass, teacher/student_mass   with loss topk_forward_kl
    teacher/latency_s   mean per trajectory of the time its scoring took (ask → answer, queueing included)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tether.algo.aggregation import aggregate
from tether.algo.distill import DistillEstimator, gather_logprobs, reverse_kl_loss, topk_forward_kl
from tether.config import RunConfig
from tether.learner.batch import TrainBatch
from tether.metrics import record_metric
from tether.types import Trajectory


@dataclass(frozen=True)
class Distillation:
    loss: str  # reverse_kl | topk_forward_kl
    estimator: DistillEstimator
    coef: float
    rl_loss: bool
    top_k: int  # K of the top-k tensors (0 with reverse_kl)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Distillation | None:
        tc = cfg.teacher
        if not tc.enabled:
            return None
        top_k = tc.top_k if tc.loss == "topk_forward_kl" else 0
        return cls(tc.loss, tc.kl_estimator, tc.coef, tc.rl_loss, top_k)

    def attach(self, batch: TrainBatch, trajectories: Sequence[Trajectory]) -> None:
        """Fill ``batch.teacher_*`` from the trajectories' scores (rows = segments, as ``from_trajectories`` lays
        them out) and record ``teacher/latency_s``."""
        b, length = batch.input_ids.shape
        teacher_logp = torch.zeros((b, length), dtype=torch.float32)  # [B, T]
        top_ids = torch.zeros((b, length, self.top_k), dtype=torch.long)  # [B, T, K]
        top_logp = torch.full((b, length, self.top_k), -torch.inf)  # [B, T, K] -inf = no entry
        row, latency = 0, []
        for traj in trajectories:
            if traj.teacher is None or len(traj.teacher) != len(traj.segments):
                raise RuntimeError(f"trajectory {traj.task_id} reached the learner without the teacher's scores "
                                   "of each segment: the teacher loop did not score it")
            latency.append(sum(s.latency_s for s in traj.teacher))
            for seg, scores in zip(traj.segments, traj.teacher):
                p, n = len(seg.prompt_ids), len(seg.prompt_ids) + len(seg.response_ids)
                teacher_logp[row, p:n] = torch.tensor(scores.logprobs, dtype=torch.float32)
                if self.top_k:
                    if scores.top_ids is None or scores.top_logprobs is None:
                        raise RuntimeError(f"trajectory {traj.task_id}: the teacher returned no top-k log-probs, "
                                           "which teacher.loss topk_forward_kl needs")
                    for t, (ids, lps) in enumerate(zip(scores.top_ids, scores.top_logprobs)):
                        k = min(len(ids), self.top_k)
                        top_ids[row, p + t, :k] = torch.tensor(ids[:k], dtype=torch.long)
                        top_logp[row, p + t, :k] = torch.tensor(lps[:k], dtype=torch.float32)
                row += 1
        if row != b:
            raise RuntimeError(f"{row} scored segments for a batch of {b} rows")
        batch.teacher_logp = teacher_logp
        if self.top_k:
            batch.teacher_top_ids, batch.teacher_top_logp = top_ids, top_logp
        record_metric("teacher/latency_s", sum(latency) / len(latency))

    def combine(self, pg_loss: torch.Tensor, logits: torch.Tensor, sel: torch.Tensor, logp: torch.Tensor,
                mb: TrainBatch, temperature: float,
                agg: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss with the distillation term, and the per-token ``teacher/*`` metrics.

        sel: [b, T-1] the loss positions (shifted: position t predicts token t+1); logits: [n, V] the student's
        raw logits there (n = sel.sum()); logp: [b, T-1] the student's log-probs of the sampled tokens at
        ``temperature`` (the sampling one), as the learner computed them; agg: the policy-gradient term's
        aggregation arguments (mode, denom, norm_len)."""
        if mb.teacher_logp is None:
            raise RuntimeError("the batch has no teacher scores (Distillation.attach was not called)")
        mask = mb.loss_mask[:, 1:]  # [b, T-1]
        logp_1 = logp  # [b, T-1] the student at temperature 1, as the teacher is scored (module docstring)
        if temperature != 1.0:
            ids = mb.input_ids[:, 1:][sel]  # [n]
            logp_1 = logp.new_zeros(sel.shape).masked_scatter(
                sel, gather_logprobs(logits[None], ids[None, :, None])[0, :, 0])
        tok, m = reverse_kl_loss(logp_1, mb.teacher_logp[:, 1:], mb.old_logp[:, 1:], mask, estimator=self.estimator,
                                 sample_logp=logp)
        metrics = {"teacher/kl": m["kl"]}
        if self.loss == "topk_forward_kl":
            assert mb.teacher_top_ids is not None and mb.teacher_top_logp is not None
            t_top = mb.teacher_top_logp[:, 1:][sel]  # [n, K]
            s_top = gather_logprobs(logits[None], mb.teacher_top_ids[:, 1:][sel][None])[0]  # [n, K] at T = 1
            kl_n, m_top = topk_forward_kl(s_top[None], t_top[None], torch.isfinite(t_top)[None],
                                          torch.ones_like(t_top[None, :, 0]))  # [1, n]
            tok = kl_n.new_zeros(sel.shape).masked_scatter(sel, kl_n[0])  # [b, T-1]
            metrics.update({f"teacher/{k}": v for k, v in m_top.items()})
        metrics["teacher/loss"] = aggregate(tok.detach(), mask, "token_mean")
        term = self.coef * aggregate(tok, mask, **agg)
        return (pg_loss + term if self.rl_loss else term), metrics
