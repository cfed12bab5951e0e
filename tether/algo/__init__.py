"""Algorithms as pure functions of tensors: advantages, policy losses, aggregation, entropy and KL terms.

One optimisation step, for a micro-batch of a step whose totals the learner computed beforehand:

    adv, m_adv = group_advantages(rewards, group_sizes=sizes, normalization="group")   # [N]
    logp = logprobs_from_logits(logits, ids, temperature)                              # [B, L]
    pg_tok, m_pg = clipped_surrogate(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28)
    denom = sum(loss_denominator(mb.mask, mode) for mb in step)                        # whole step
    loss = aggregate(pg_tok, mask, mode, denom=denom)
    ent, m_ent = entropy_bonus(entropy_from_logits(logits, temperature), mask, coef=0.01, mode=mode, denom=denom)
    kl, m_kl = kl_penalty(logp, ref_logp, mask, coef=0.001, kind="k3", mode=mode, denom=denom)
    (loss + ent + kl).backward()

Files: ``advantages.py`` (group-relative advantages), ``losses.py`` (policy losses, entropy bonus),
``aggregation.py`` (per-token loss → scalar, micro-batch denominators), ``kl.py`` (KL estimators and penalty),
``logprobs.py`` (log-probs and entropies from logits, chunked), ``correction.py`` (behaviour/proximal IS weights:
TIS, IcePop, decoupled PPO), ``variants.py`` (GSPO and CISPO losses, the ``ALGORITHMS`` registry),
``filters.py`` (degenerate-group filter), ``allocation.py`` (adaptive rollouts per task),
``kl_control.py`` (fixed/adaptive KL coefficient, max-KL guard), ``diversity.py`` (strategy signatures and the
diversity bonus).
"""

from tether.algo.advantages import broadcast_to_tokens, group_advantages
from tether.algo.aggregation import aggregate, loss_denominator
from tether.algo.allocation import TaskRewardWindow, allocate_rollouts, gradient_variance_proxy
from tether.algo.correction import behaviour_log_ratio, decoupled_surrogate, is_weights, mismatch_metrics
from tether.algo.diversity import cluster_ids, diversity_bonus, strategy_signature
from tether.algo.filters import degenerate_groups, group_reward_std, resample_or_drop
from tether.algo.kl import kl_estimate, kl_penalty
from tether.algo.kl_control import AdaptiveKLController, FixedKLController, exceeds_max_kl, kl_controller
from tether.algo.logprobs import entropy_from_logits, logprobs_from_logits
from tether.algo.losses import PolicyLossFn, clipped_surrogate, entropy_bonus, importance_ratio
from tether.algo.variants import ALGORITHMS, AlgorithmSpec, algorithm_spec, cispo_surrogate, gspo_surrogate

__all__ = [
    "ALGORITHMS",
    "AdaptiveKLController",
    "AlgorithmSpec",
    "FixedKLController",
    "PolicyLossFn",
    "TaskRewardWindow",
    "aggregate",
    "algorithm_spec",
    "allocate_rollouts",
    "behaviour_log_ratio",
    "broadcast_to_tokens",
    "cispo_surrogate",
    "clipped_surrogate",
    "cluster_ids",
    "decoupled_surrogate",
    "degenerate_groups",
    "diversity_bonus",
    "entropy_bonus",
    "entropy_from_logits",
    "exceeds_max_kl",
    "gradient_variance_proxy",
    "group_advantages",
    "group_reward_std",
    "gspo_surrogate",
    "importance_ratio",
    "is_weights",
    "kl_controller",
    "kl_estimate",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_denominator",
    "mismatch_metrics",
    "resample_or_drop",
    "strategy_signature",
]
