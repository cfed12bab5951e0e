"""The policy objective a config asks for: which loss, which aggregation, and the off-policy correction.

    loss per token = policy_loss(logp, prox_logp, A, mask, weights=w)       (``policy_optimization.algorithm``)
    w, keep        = is_weights(prox_logp, behav_logp, mask, method, ...)  (``learner.off_policy_correction``)

``behav_logp`` are the engine's logprobs recorded at sampling time; ``prox_logp`` the learner's own logprobs of the
same tokens at the start of the step (one forward without grad). The PPO trust region is taken around π_prox and
the behaviour gap π_prox/π_behav — stale weights in the async modes, kernel/precision mismatch always — becomes a
per-token weight (``tether.algo.correction``). With no correction π_prox is not computed and the ratio is taken
to π_behav, plain PPO/GRPO.

Config → correction (``learner.off_policy_correction``; ε = ``clip_ratio``, C = ``tis_cap``):

    method                             tis_enabled: true                 tis_enabled: false
    double_sided_importance_sampling   w = min(ρ, C)·1[ρ ∈ [1−ε, 1+ε]]   w = 1[ρ ∈ [1−ε, 1+ε]]
                                       (IcePop when C ≥ 1+ε)             (rejection only, no weight)
    truncated_importance_sampling      w = min(ρ, C)                     w = min(ρ, C)
    decoupled_ppo                      w = min(ρ, C)                     w = ρ                     (Hilton et al.)
    none                               w = min(ρ, C)                     no correction, no π_prox

``token_level_clipping: false`` applies the table to the sequence ratio instead (``correction.is_weights``).

Clip range and dual clip: ε_low = ``policy_optimization.clip_ratio_low`` (else ``clip_ratio``), ε_high =
``exploration.clip_higher``, dual-clip c = ``policy_optimization.clip_ratio_c`` (None = off) for the PPO-clip
losses (grpo, dapo, dr_grpo, grpo_variant, and gspo on its sequence ratio). CISPO clips the weight, not the
update — no token's loss grows without bound with r — so c does not apply to it and is not passed.

Dr. GRPO's length normaliser (``seq_mean_token_sum_norm``) is the plan's ``max_response_tokens`` =
``engine.max_tokens`` × ``agent_loop.max_assistant_turns`` (``tether.config.plan``): the most model-sampled
(mask-1) tokens one trajectory can hold, fixed by the config, so the normaliser is the same constant at every step
whatever the batch's lengths. It plays the role of Dr. GRPO's "max generation length", TRL's
``max_completion_length`` (single turn: ``max_tokens`` exactly) and verl's constant ``loss_scale_factor`` (verl's
default, ``loss_mask.shape[-1]``, is the padded length of the micro-batch and changes with the data). Tool and
user tokens (mask 0) are not counted: they add nothing to the numerator either. ``environment.state.context_window``
can cut an episode sooner; the normaliser stays the configured bound.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from tether.algo.aggregation import AggMode
from tether.algo.correction import ISLevel, ISMethod, is_weights
from tether.algo.variants import algorithm_spec, cispo_surrogate
from tether.config.policy import PolicyOptimConfig
from tether.config.sections import OffPolicyCorrectionConfig


@dataclass(frozen=True)
class Objective:
    algorithm: str
    policy_loss: Any  # a PolicyLossFn with its clip range (and dual clip) bound
    agg_mode: AggMode
    is_method: ISMethod  # "none" = no correction (π_prox not computed)
    is_level: ISLevel
    band: float  # ε of the double-sided band
    tis_cap: float
    norm_len: int  # Dr. GRPO's constant length (used by seq_mean_token_sum_norm only)

    @classmethod
    def from_config(cls, po: PolicyOptimConfig, opc: OffPolicyCorrectionConfig, max_response_tokens: int) -> Objective:
        """``po``: ``policy_optimization``; ``opc``: ``learner.off_policy_correction``; ``max_response_tokens``:
        the plan's (Dr. GRPO's constant length)."""
        spec = algorithm_spec(po.algorithm)
        clip_low = po.clip_ratio_low if po.clip_ratio_low is not None else opc.clip_ratio
        clip_high = po.exploration.clip_higher
        if spec.loss_fn is cispo_surrogate:  # no lower bound unless one is asked for; no dual clip
            loss = functools.partial(cispo_surrogate, clip_high=clip_high, clip_low=po.clip_ratio_low)
        else:
            loss = functools.partial(spec.loss_fn, clip_low=clip_low, clip_high=clip_high, dual_clip=po.clip_ratio_c)
        method: ISMethod
        cap = opc.tis_cap
        if opc.method == "double_sided_importance_sampling":
            method = "double_sided_truncated" if opc.tis_enabled else "double_sided_mask"
        elif opc.method == "decoupled_ppo":
            method, cap = "truncated", (opc.tis_cap if opc.tis_enabled else math.inf)
        else:
            method = "truncated" if (opc.method == "truncated_importance_sampling" or opc.tis_enabled) else "none"
        return cls(po.algorithm, loss, po.loss_agg_mode or spec.agg_mode, method,
                   "token" if opc.token_level_clipping else "sequence", opc.clip_ratio, cap, max_response_tokens)

    @property
    def needs_prox(self) -> bool:
        return self.is_method != "none"

    def weights(self, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The behaviour-correction weights [B, L] (None without correction) and their metrics."""
        if not self.needs_prox:
            return None, {}
        w, _, m = is_weights(prox_logp, behav_logp, mask, method=self.is_method, clip_ratio_low=self.band,
                             clip_ratio_high=self.band, tis_cap=self.tis_cap, level=self.is_level)
        return w, m
