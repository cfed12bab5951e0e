"""The learner's side of distillation: the teacher's scores as batch tensors, and the loss term.

A teacher is loaded and queried by ``tether.teacher`` (its scores travel on the trajectories); what the learner
does with them is here, so that the learner never imports the teacher package.

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
from tether.config.teacher import TeacherConfig
from tether.learner.batch import TrainBatch
from tether.learner.logits import Forward, scatter
from tether.metrics import record_metric
from tether.types import Trajectory


@dataclass(frozen=True)
class DistillInputs:
    """A micro-batch's student and teacher tensors at the loss positions (shifted: position t predicts t+1)."""

    student_logp: torch.Tensor  # [b, L] log q(token) at temperature 1, as the teacher is scored (module docstring)
    teacher_logp: torch.Tensor  # [b, L] log p(token), the teacher's
    sel: torch.Tensor  # [b, L] bool, the loss positions (n = sel.sum())
    student_top_logp: torch.Tensor | None = None  # [n, K] log q at T = 1 of the teacher's top-K ids (topk_forward_kl)
    teacher_top_logp: torch.Tensor | None = None  # [n, K] the teacher's; -inf = no entry


@dataclass(frozen=True)
class Distillation:
    loss: str  # reverse_kl | topk_forward_kl
    estimator: DistillEstimator
    coef: float
    rl_loss: bool
    top_k: int  # K of the top-k tensors (0 with reverse_kl)

    @classmethod
    def from_config(cls, teacher: TeacherConfig) -> Distillation | None:
        """The term the ``teacher`` section asks for; None when no teacher is configured."""
        if not teacher.enabled:
            return None
        top_k = teacher.top_k if teacher.loss == "topk_forward_kl" else 0
        return cls(teacher.loss, teacher.kl_estimator, teacher.coef, teacher.rl_loss, top_k)

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

    def inputs(self, student: Forward, mb: TrainBatch) -> DistillInputs:
        """The student's log-probabilities the term compares with the teacher's, from the same logits as the RL
        term's (``student``: the forward at the sampling temperature), and the teacher's, laid out alike."""
        if mb.teacher_logp is None:
            raise RuntimeError("the batch has no teacher scores (Distillation.attach was not called)")
        sel = student.sel  # [b, L]
        logp_1 = student.logp  # [b, L] at T = 1 already when the sampling temperature is 1
        if student.temperature != 1.0:
            ids = mb.input_ids[:, 1:][sel]  # [n]
            logp_1 = scatter(gather_logprobs(student.logits[None], ids[None, :, None])[0, :, 0], sel)  # [b, L]
        if self.loss != "topk_forward_kl":
            return DistillInputs(logp_1, mb.teacher_logp[:, 1:], sel)
        assert mb.teacher_top_ids is not None and mb.teacher_top_logp is not None
        s_top = gather_logprobs(student.logits[None], mb.teacher_top_ids[:, 1:][sel][None])[0]  # [n, K] at T = 1
        return DistillInputs(logp_1, mb.teacher_logp[:, 1:], sel, s_top, mb.teacher_top_logp[:, 1:][sel])

    def term(self, inputs: DistillInputs, sample_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
             agg: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """coef · agg(ℓ_distill) [], and the per-token ``teacher/*`` metrics.

        sample_logp: [b, L] the student's log-probs of the sampled tokens at the sampling temperature (the
        importance ratio's q_τ); behav_logp: [b, L] the engine's (μ); mask: [b, L]; agg: the policy-gradient term's
        aggregation arguments (mode, denom, norm_len)."""
        tok, m = reverse_kl_loss(inputs.student_logp, inputs.teacher_logp, behav_logp, mask, estimator=self.estimator,
                                 sample_logp=sample_logp)  # [b, L]
        metrics = {"teacher/kl": m["kl"]}
        if self.loss == "topk_forward_kl":
            s_top, t_top = inputs.student_top_logp, inputs.teacher_top_logp  # [n, K]
            assert s_top is not None and t_top is not None
            kl_n, m_top = topk_forward_kl(s_top[None], t_top[None], torch.isfinite(t_top)[None],
                                          torch.ones_like(t_top[None, :, 0]))  # [1, n]
            tok = scatter(kl_n[0], inputs.sel)  # [b, L]
            metrics.update({f"teacher/{k}": v for k, v in m_top.items()})
        metrics["teacher/loss"] = aggregate(tok.detach(), mask, "token_mean")
        return self.coef * aggregate(tok, mask, **agg), metrics
