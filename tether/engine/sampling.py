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
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)  # [B, V]
    tokens = logits.argmax(dim=-1)
    rows = (~greedy).nonzero().squeeze(1)
    if rows.numel():
        probs = logp[rows].exp()  # [S, V]
        p = top_p[rows]
        if bool((p < 1).any()):
            probs, order = probs.sort(dim=-1, descending=True)
            before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
            probs = probs.masked_fill(before >= p[:, None], 0.0)  # keeps the top token always
        else:
            order = None
        cdf = probs.cumsum(dim=-1)
        target = uniform[rows, None] * cdf[:, -1:]
        idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [S, 1]
        tokens[rows] = (order.gather(1, idx) if order is not None else idx).squeeze(1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
