"""Batched next-token sampling with per-row temperature, top-p and uniform draws.

Each row's randomness is one uniform number supplied by the caller (drawn from that request's own
``torch.Generator``), and sampling is an inverse-CDF lookup, so a row's token does not depend on the
other rows in the batch.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    logits [B, V] float32; temperature [B] (0 = greedy); top_p [B] in (0, 1]; uniform [B] in [0, 1).
    Returns tokens [B] and their logprobs [B] = log_softmax(logits / T)[token] with T = 1 when greedy,
    taken *before* top-p truncation (the sampling distribution the trainer recomputes).
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    z = logits / temp[:, None]  # [B, V]
    z -= z.amax(dim=-1, keepdim=True)
    weights = z.exp()  # unnormalised probabilities (a greedy row's are computed and not used)
    total = weights.sum(dim=-1, keepdim=True)
    tokens = _inverse_cdf(weights, uniform)
    nucleus = (top_p < 1) & ~greedy
    if bool(nucleus.any()):  # those rows draw from their top-p tokens, most likely first
        ranked, order = weights.sort(dim=-1, descending=True)
        before = ranked.cumsum(dim=-1) - ranked  # mass of strictly more likely tokens
        ranked = ranked.masked_fill(before >= top_p[:, None] * total, 0.0)  # keeps the top token always
        tokens = torch.where(nucleus, order.gather(1, _inverse_cdf(ranked, uniform)[:, None]).squeeze(1), tokens)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, (z.gather(1, tokens[:, None]) - total.log()).squeeze(1)  # log_softmax(logits / T)[token]


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index each row's uniform falls at in its cumulated (unnormalised) weights [B, V]; returns [B]."""
    cdf = weights.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    return idx.clamp_(max=cdf.shape[1] - 1).squeeze(1)
