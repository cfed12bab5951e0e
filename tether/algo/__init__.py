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
``logprobs.py`` (log-probs and entropies from logits, chunked).
"""

from tether.algo.advantages import broadcast_to_tokens, group_advantages
from tether.algo.aggregation import aggregate, loss_denominator
from tether.algo.kl import kl_estimate, kl_penalty
from tether.algo.logprobs import entropy_from_logits, logprobs_from_logits
from tether.algo.losses import PolicyLossFn, clipped_surrogate, entropy_bonus, importance_ratio

__all__ = [
    "PolicyLossFn",
    "aggregate",
    "broadcast_to_tokens",
    "clipped_surrogate",
    "entropy_bonus",
    "entropy_from_logits",
    "group_advantages",
    "importance_ratio",
    "kl_estimate",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_denominator",
]
