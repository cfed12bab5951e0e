"""Batched next-token sampling: per-row temperature, truncation (min-p, top-k, top-p), uniform draws, and the
logit shaping of repetition / presence / frequency penalties, logit bias and min_tokens.

Each row's randomness is one uniform number supplied by the caller (drawn from that request's own
``torch.Generator``), and sampling is an inverse-CDF lookup, so a row's token does not depend on the
other rows in the batch: every operation here is row by row, and the rows that use a parameter are computed
apart from those that do not (which therefore pay nothing for it).

The recorded logprob is always log_softmax(logits / T) of the *unshaped* logits, before truncation — the
distribution the trainer recomputes (``tether.engine.base`` says what that means for each parameter).
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor, *,
           top_k: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
           shaped: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    logits [B, V] float32; temperature [B] (0 = greedy); top_p [B] in (0, 1]; uniform [B] in [0, 1);
    top_k [B] int (0 = off) and min_p [B] in [0, 1] (0 = off), or None when no row uses them;
    shaped: (rows [S], their logits after ``shape_logits`` [S, V]): those rows draw from these instead.
    Returns tokens [B] and their logprobs [B] = log_softmax(logits / T)[token] with T = 1 when greedy,
    taken from the unshaped ``logits`` and *before* truncation (the sampling distribution the trainer recomputes).
    Truncation, in vLLM's order: min-p keeps the tokens of probability >= min_p × the largest; top-k the k largest
    and any tied with the k-th; top-p then the most likely tokens until top_p of the mass those two kept.
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    z = logits / temp[:, None]  # [B, V]
    z -= z.amax(dim=-1, keepdim=True)
    weights = z.exp()  # unnormalised probabilities (a greedy row's are computed and not used)
    total = weights.sum(dim=-1, keepdim=True)  # [B, 1] the unshaped mass: the logprobs' normaliser
    best = None if not bool(greedy.any()) else logits.argmax(dim=-1)  # [B] a greedy row's token
    recount = None  # [B] rows whose truncation mass is recounted from what they keep (shaped, top-k, min-p)
    if shaped is not None:
        rows, shaped_logits = shaped
        zs = shaped_logits / temp[rows, None]  # [S, V]
        zs -= zs.amax(dim=-1, keepdim=True)
        weights[rows] = zs.exp()
        recount = torch.zeros_like(greedy)
        recount[rows] = True
        if best is not None:
            best[rows] = shaped_logits.argmax(dim=-1)
    tokens = _inverse_cdf(weights, uniform)
    cut = top_p < 1
    for threshold in (top_k, min_p):
        if threshold is not None:
            on = threshold > 0
            cut |= on
            recount = on if recount is None else recount | on
    cut &= ~greedy
    if bool(cut.any()):  # those rows draw from their truncated distribution, most likely first
        idx = cut.nonzero().squeeze(1)  # [C]
        ranked, order = weights[idx].sort(dim=-1, descending=True)  # [C, V]
        if min_p is not None:  # ranked[:, :1] is the largest weight
            ranked = ranked.masked_fill(ranked < min_p[idx, None] * ranked[:, :1], 0.0)
        if top_k is not None:
            k = top_k[idx]
            kth = ranked.gather(1, (k - 1).clamp(0, ranked.shape[1] - 1)[:, None])  # [C, 1] the k-th largest weight
            ranked = ranked.masked_fill((k[:, None] > 0) & (ranked < kth), 0.0)
        p = top_p[idx, None]
        mass = total[idx] if recount is None else torch.where(recount[idx, None], ranked.sum(dim=-1, keepdim=True),
                                                              total[idx])  # [C, 1] the mass kept so far
        before = ranked.cumsum(dim=-1) - ranked  # mass of strictly more likely tokens
        ranked = ranked.masked_fill((p < 1) & (before >= p * mass), 0.0)  # keeps the top token always
        tokens[idx] = order.gather(1, _inverse_cdf(ranked, uniform[idx])[:, None]).squeeze(1)
    if best is not None:
        tokens = torch.where(greedy, best, tokens)
    return tokens, (z.gather(1, tokens[:, None]) - total.log()).squeeze(1)  # log_softmax(logits / T)[token]


def shape_logits(logits: torch.Tensor, *, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 banned: tuple[torch.Tensor, torch.Tensor] | None = None,
                 repetition: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The logits [S, V] the rows draw from, in vLLM's order (a new tensor; ``logits`` is left as it was).

    bias: (row [N], token [N], value [N]) added to those logits (``logit_bias``; a pair per entry, rows may repeat);
    banned: (row [M], token [M]) set to -inf (``min_tokens``: the stop ids of the rows that are still short);
    repetition: (rows [R], penalty [R], seen [R, V] bool): a seen token's logit l becomes l / penalty if l > 0 else
        l × penalty (vLLM's and HF's ``repetition_penalty``; seen = the prompt and the output so far);
    counts: (rows [F], presence [F], frequency [F], counts [F, V] of the generated tokens): l − frequency × count −
        presence × (count > 0) (OpenAI's presence / frequency penalties, over the output only).
    """
    x = logits.clone()
    if bias is not None:
        row, tok, value = bias
        x.index_put_((row, tok), value, accumulate=True)
    if banned is not None:
        x[banned] = float("-inf")
    if repetition is not None:
        rows, penalty, seen = repetition
        sub, pen = x[rows], penalty[:, None]
        x[rows] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    if counts is not None:
        rows, presence, frequency, n = counts
        x[rows] -= frequency[:, None] * n + presence[:, None] * (n > 0)
    return x


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index each row's uniform falls at in its cumulated (unnormalised) weights [B, V]; returns [B]."""
    cdf = weights.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    return idx.clamp_(max=cdf.shape[1] - 1).squeeze(1)
