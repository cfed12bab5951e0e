"""``teacher``: on-policy distillation — a teacher scores the student's own rollouts token by token
(``tether.teacher``, the losses in ``tether.algo.distill``)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from tether.config.base import NonNegFloat, PosInt, Section, _check
from tether.config.sections import LLMClientConfig

__all__ = ["TeacherConfig"]

MAX_TOP_K = 20  # what tether serve and vLLM return at most per position (``prompt_logprobs``)


class TeacherConfig(Section):
    """A teacher model that scores every response token of the student's rollouts as they finish (verl's Teacher
    Loop, on-policy distillation). The distillation term is added to the loss, or replaces the policy-gradient term
    (``rl_loss: false``). The teacher and the student must share a tokenizer (checked at start). Metrics:
    ``teacher/kl``, ``teacher/loss``, ``teacher/latency_s``."""

    enabled: bool = False
    """Distil from the teacher. false: no teacher, no ``teacher/*`` metrics; the other keys must then keep their
    defaults."""
    path: str | None = None
    """The teacher as a local Hugging Face checkpoint folder, run in this process (its own copy, scored on a
    worker thread). Exactly one of ``path`` and ``remote``."""
    remote: LLMClientConfig | None = None
    """The teacher behind an OpenAI-compatible server (tether serve, vLLM): each finished segment is sent as token
    ids to ``/v1/completions`` with ``max_tokens: 1`` and ``prompt_logprobs`` (vLLM's extension; tether serve has
    it). Exactly one of ``path`` and ``remote``."""
    loss: Literal["reverse_kl", "topk_forward_kl"] = "reverse_kl"
    """reverse_kl: KL(student ‖ teacher) on the student's sampled tokens (needs only the teacher's log-prob of each
    token; the estimator is ``kl_estimator``). topk_forward_kl: KL(teacher ‖ student) over the teacher's ``top_k``
    tokens at each position plus the rest of the vocabulary (GKD's forward KL; ``tether.algo.distill``)."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """Estimator of the per-token reverse KL (Schulman's k1 = log q − log p, k3 = (r − 1) − log r). With loss
    reverse_kl it selects the loss: k1 in its policy-gradient form (Thinking Machines' on-policy distillation; the
    gradient of the reverse KL), k3 back-propagated (verl's default; its gradient is the forward KL's). With either
    loss it is the estimator ``teacher/kl`` reports."""
    coef: NonNegFloat = 1.0
    """Weight of the distillation term in the loss: loss = pg + coef · distill (``rl_loss: true``) or
    coef · distill (``rl_loss: false``), aggregated like the policy-gradient term."""
    rl_loss: bool = True
    """true: the distillation term is added to the RL (policy-gradient) loss. false: pure distillation, the
    policy-gradient term is dropped (rewards are still computed and logged; the degenerate-group filter must be
    off, since every rollout carries the teacher's signal)."""
    top_k: PosInt = 20
    """Teacher log-probs per position for loss topk_forward_kl (the K of KL_K), at most 20. Only that loss reads
    it (another value with reverse_kl is refused)."""

    @model_validator(mode="after")
    def _coherent(self) -> TeacherConfig:
        # Values, not keys set: a dumped config (every key written out) must load back.
        fields = type(self).model_fields
        others = sorted(k for k, f in fields.items() if k != "enabled" and getattr(self, k) != f.default)
        if not self.enabled:
            _check(not others, "teacher.enabled is false, so these keys would do nothing; set teacher.enabled: true "
                               "or remove them", **{k: getattr(self, k) for k in others})
            return self
        _check((self.path is None) != (self.remote is None),
               "teacher.enabled needs exactly one teacher: a local checkpoint (teacher.path) or a server "
               "(teacher.remote)", path=self.path, remote=None if self.remote is None else "set")
        _check(self.top_k <= MAX_TOP_K, f"teacher.top_k is at most {MAX_TOP_K} (what servers return per position)",
               top_k=self.top_k)
        _check(self.loss == "topk_forward_kl" or self.top_k == type(self).model_fields["top_k"].default,
               "teacher.top_k is read only by loss topk_forward_kl; remove it or set teacher.loss: topk_forward_kl",
               top_k=self.top_k, loss=self.loss)
        _check(self.rl_loss or self.coef > 0, "teacher.rl_loss: false with teacher.coef: 0 leaves nothing to train",
               rl_loss=self.rl_loss, coef=self.coef)
        return self
