"""Policy-loss variants (``PolicyLossFn`` signature, as ``losses.clipped_surrogate``) and the algorithm registry.

``ALGORITHMS`` names the recipes the config's ``policy_optimization.algorithm`` can select, each a frozen
``AlgorithmSpec``: which loss, which aggregation, which advantage normalization, the clip range, whether DAPO's
dynamic sampling (the degenerate-group filter) is on, and the default entropy / KL / off-policy correction.
The trainer reads it once; nothing here branches on the algorithm name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tether.algo.advantages import Normalization
from tether.algo.aggregation import AggMode, aggregate
from tether.algo.correction import ISMethod
from tether.algo.losses import MAX_LOG_RATIO, Metrics, clipped_surrogate, importance_ratio, token_advantages


def gspo_surrogate(
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
    """GSPO-token: the PPO clip on the length-normalised sequence ratio (Zheng et al. 2025, arXiv 2507.18071).

        s_i     = exp( Σ_t m·(log π_θ − log π_old) / Σ_t m )             sequence ratio (geometric mean)
        s_{i,t} = sg[s_i] · π_θ(o_{i,t}) / sg[π_θ(o_{i,t})]               value s_i, ∇ = s_i·∇log π_θ(o_{i,t})
        ℓ_{i,t} = max(−A_{i,t}·s_{i,t}, −A_{i,t}·clip(s_{i,t}, 1 − ε_low, 1 + ε_high))

    The clip decision is per sequence (every token of a sequence has the value s_i), so a sequence is kept or
    dropped whole. With A_{i,t} = A_i and ``seq_mean_token_mean`` aggregation the gradient is exactly GSPO's
    sequence-level one, ∇ s_i = s_i · mean_t ∇log π_θ (verl forces that mode for ``gspo``). Paper ranges are tiny,
    ε_low = 3e-4, ε_high = 4e-4, because s_i averages the token log-ratios.

    Implemented as ``clipped_surrogate`` on the pseudo log-ratio log s_i + (log π_θ − sg[log π_θ]): same value,
    same gradient, and its metrics (``clip_ratio_*``, ``ratio_mean`` = token-weighted mean of s_i, ``ppo_kl``
    unchanged since Σ_t of the pseudo log-ratio equals Σ_t of the token log-ratios).

    Where verl's ``compute_policy_loss_gspo`` differs: it clamps log s_{i,t} from above only, at 10 (here log s_i
    is clamped to ±``max_log_ratio`` = ±20); it has no dual clip (here ``dual_clip`` applies to s_{i,t} with
    A < 0, and the config's ``clip_ratio_c`` default of 3 turns it on); and it always aggregates with
    ``seq-mean-token-mean``, whereas here that is only the default (``policy_optimization.loss_agg_mode``
    overrides it).
    """
    if not (logp.shape == old_logp.shape == mask.shape) or logp.dim() != 2:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, mask {tuple(mask.shape)} must be equal [B, L]"
        )
    on = mask.bool()  # [B, L]
    safe = torch.where(on, logp, torch.zeros_like(logp))  # [B, L] masked ±inf would give inf − inf = NaN below
    delta = torch.where(on, safe.detach() - old_logp.detach(), torch.zeros_like(safe))  # [B, L]
    count = on.sum(dim=-1, keepdim=True).clamp_min(1)  # [B, 1]
    log_s = (delta.sum(dim=-1, keepdim=True) / count).clamp(-max_log_ratio, max_log_ratio)  # [B, 1]
    pseudo = log_s + (safe - safe.detach())  # [B, L] value log s_i, gradient ∇log π_θ
    return clipped_surrogate(
        pseudo, torch.zeros_like(pseudo), advantages, mask,
        clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, weights=weights, max_log_ratio=max_log_ratio,
    )


def cispo_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_high: float,
    clip_low: float | None = None,
    weights: torch.Tensor | None = None,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO: clip the importance weight, not the update (MiniMax-M1, arXiv 2506.13585).

        r   = exp(log π_θ − log π_old)
        ℓ   = −sg[clip(r, 1 − ε_low, 1 + ε_high)] · A · log π_θ          ∇ℓ = −clip(r)·A·∇log π_θ

    Unlike PPO no token loses its gradient: a token whose ratio left the range is down- (or up-) weighted, never
    dropped. Bound convention: *relative*, as verl's ``cispo`` and the paper's 1 ± ε^IS, so ``clip_high`` means
    what it means for ``clipped_surrogate``; TRL's ``epsilon_high`` is an absolute cap (ScaleRL's 5.0 here is
    clip_high = 4.0). The paper imposes no lower bound ("we set ε_low^IS to a large value"): ``clip_low=None``.
    The loss *value* is not a meaningful objective (it scales with log π_θ); its gradient is the point.

    Args:
        clip_high: ε_high ≥ 0. clip_low: ε_low ≥ 0 (≥ 1 means no bound, as verl's example 10), or None.
        weights: [B, L] per-token multiplier (IS correction), detached; None = 1.

    Returns:
        loss [B, L], 0 where mask is 0; metrics ``cispo_clip_ratio`` (tokens whose weight was clipped, either
        side), ``clip_ratio_low`` / ``clip_ratio_high`` (per side, as counted for PPO: r < 1 − ε_low with A < 0,
        r > 1 + ε_high with A > 0), ``ratio_mean``, ``ppo_kl``.
    """
    if clip_high < 0.0 or (clip_low is not None and clip_low < 0.0):
        raise ValueError(f"clip_high ({clip_high}) and clip_low ({clip_low}) must be >= 0 (None: no lower bound)")
    if not (logp.shape == old_logp.shape == mask.shape) or logp.dim() != 2:
        raise ValueError(
            f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, mask {tuple(mask.shape)} must be equal [B, L]"
        )
    on = mask.bool()  # [B, L]
    safe = torch.where(on, logp, torch.zeros_like(logp))  # [B, L]
    adv = token_advantages(advantages, logp)  # [B, L] or [B, 1]
    r = importance_ratio(safe.detach(), old_logp.detach(), max_log_ratio=max_log_ratio)  # [B, L] constant
    low = None if clip_low is None else 1.0 - clip_low
    w = torch.clamp(r, min=low, max=1.0 + clip_high)  # [B, L]
    if weights is not None:
        if weights.shape != logp.shape:
            raise ValueError(f"weights {tuple(weights.shape)} must be [B, L] = {tuple(logp.shape)}")
        w = w * weights.detach()
    loss = -w * adv * safe  # [B, L]
    loss = torch.where(on, loss, torch.zeros_like(loss))  # [B, L]
    with torch.no_grad():
        below = r < low if low is not None else torch.zeros_like(on)
        above = r > 1.0 + clip_high
        metrics = {
            "cispo_clip_ratio": aggregate((below | above).float(), mask, "token_mean"),
            "clip_ratio_low": aggregate((below & (adv < 0)).float(), mask, "token_mean"),
            "clip_ratio_high": aggregate((above & (adv > 0)).float(), mask, "token_mean"),
            "ratio_mean": aggregate(r, mask, "token_mean"),
            "ppo_kl": aggregate(old_logp.detach() - safe.detach(), mask, "token_mean"),
        }
    return loss, metrics


@dataclass(frozen=True)
class AlgorithmSpec:
    """One recipe: the loss and the defaults that travel with it (config values override these)."""

    loss_fn: Callable[..., tuple[torch.Tensor, Metrics]]
    """A ``PolicyLossFn``; called with ``clip_low`` / ``clip_high`` below."""
    agg_mode: AggMode
    """How the per-token loss becomes a scalar (``aggregation.aggregate``)."""
    normalization: Normalization
    """Advantage scale: "group" | "batch" | "none" (``advantages.group_advantages``)."""
    clip_low: float | None
    """ε_low (relative to 1); None = no lower bound (CISPO)."""
    clip_high: float
    """ε_high (relative to 1)."""
    filter_degenerate_groups: bool
    """DAPO's dynamic sampling: drop / resample groups whose rewards do not differ (``filters.py``)."""
    kl_coef: float = 0.0
    """β of the KL-to-reference loss term; 0 = no reference model."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    is_method: ISMethod = "none"
    """Default behaviour/proximal correction (``correction.is_weights``)."""
    source: str = ""
    """Where the defaults come from."""

    def policy_loss_fn(self) -> Callable[..., tuple[torch.Tensor, Metrics]]:
        """The loss with its clip range bound: ``fn(logp, old_logp, advantages, mask, *, weights=None)``."""
        if self.clip_low is None:  # CISPO without a lower bound: its default
            return functools.partial(self.loss_fn, clip_high=self.clip_high)
        return functools.partial(self.loss_fn, clip_low=self.clip_low, clip_high=self.clip_high)


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(
        clipped_surrogate, "seq_mean_token_mean", "group", 0.2, 0.2, False, kl_coef=0.04,
        source="GRPO, Shao et al. 2024 (arXiv 2402.03300): per-sequence token mean, group std, ε = 0.2 (PPO's), "
               "k3 KL β = 0.04",
    ),
    "dapo": AlgorithmSpec(
        clipped_surrogate, "token_mean", "group", 0.2, 0.28, True,
        source="DAPO, Yu et al. 2025 (arXiv 2503.14476): token-level loss, clip-higher 0.2/0.28, dynamic sampling, "
        "no KL",
    ),
    "dr_grpo": AlgorithmSpec(
        clipped_surrogate, "seq_mean_token_sum_norm", "none", 0.2, 0.2, False,
        source="Dr. GRPO, Liu et al. 2025 (arXiv 2503.20783): constant length normaliser, no std division, no KL",
    ),
    "gspo": AlgorithmSpec(
        gspo_surrogate, "seq_mean_token_mean", "group", 3e-4, 4e-4, False,
        source="GSPO, Zheng et al. 2025 (arXiv 2507.18071): sequence ratio, ε = 3e-4/4e-4 (v2 §5.1), no KL",
    ),
    "cispo": AlgorithmSpec(
        cispo_surrogate, "token_mean", "group", None, 4.0, False,
        source="CISPO, MiniMax 2025 (arXiv 2506.13585): token-level, no lower bound; ε_high = 4 is ScaleRL's "
        "absolute cap 5 (arXiv 2510.13786) in the relative convention (the paper only says ε_high was tuned)",
    ),
    "grpo_variant": AlgorithmSpec(
        clipped_surrogate, "token_mean", "batch", 0.2, 0.28, True,
        kl_coef=0.001, entropy_coef=0.01, is_method="double_sided_truncated",
        source="the seed config (policy_optim.yaml): group-relative advantages with batch std, clip-higher 0.28, "
        "entropy 0.01, degenerate-group filter, double-sided IS with TIS, adaptive KL from 0.001",
    ),
}


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered recipe ``name``; ValueError listing the valid names otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {sorted(ALGORITHMS)}") from None
