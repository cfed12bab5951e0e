"""Per-token log-probabilities and entropies from logits, without a full [B, L, V] log-softmax in memory.

Both work on chunks of ``chunk_tokens`` positions, upcast to float32 one chunk at a time, as verl's
``entropy_from_logits_with_chunking`` does (chunks of 2048 positions, ``.float()``). TRL's ``selective_log_softmax``
saves memory the same way but loops over sequences (rows) rather than chunks of positions, and does not upcast:
bf16 logits get a bf16 log_softmax. Under ``torch.no_grad()`` (old and
reference log-probs) the peak extra memory is one float32 chunk; with autograd each chunk's float32 copy is kept
for the backward pass, so the saving there is only the log-softmax output.

The temperature must be the one the sampler used: the behaviour log-probs of the rollout engine are those of
softmax(logits / T), and the importance ratio compares like with like.
"""

from __future__ import annotations

import torch


def _check(logits: torch.Tensor, temperature: float, chunk_tokens: int) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, L, V], got {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")


def logprobs_from_logits(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, *, chunk_tokens: int = 1024
) -> torch.Tensor:
    """log π(ids | ·) = z[id] − logsumexp(z), z = logits / T, i.e. log_softmax(logits / T) gathered at ``ids``.

    Args:
        logits: [B, L, V] logits aligned with ``ids`` (already shifted: logits[:, t] predicts ids[:, t]).
        ids: [B, L] token ids.
        temperature: sampling temperature T > 0.
        chunk_tokens: positions processed at once.

    Returns:
        [B, L] float32 log-probabilities.
    """
    _check(logits, temperature, chunk_tokens)
    if ids.shape != logits.shape[:2]:
        raise ValueError(f"ids {tuple(ids.shape)} must match logits {tuple(logits.shape)}[:2]")
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [B*L, V]
    flat_ids = ids.reshape(-1, 1)  # [B*L, 1]
    out = []
    for start in range(0, flat_logits.shape[0], chunk_tokens):
        z = flat_logits[start : start + chunk_tokens].float()  # [C, V]
        if temperature != 1.0:
            z = z / temperature
        picked = z.gather(-1, flat_ids[start : start + chunk_tokens]).squeeze(-1)  # [C]
        out.append(picked - torch.logsumexp(z, dim=-1))  # [C]
    return torch.cat(out).reshape(ids.shape) if out else logits.new_zeros(ids.shape, dtype=torch.float32)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, *, chunk_tokens: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits / T) at every position: H = logsumexp(z) − Σ_v softmax(z)_v · z_v.

    The logsumexp form is exact and stable (no log of a probability that underflowed to 0); logits of -inf
    (tokens banned by the sampler) contribute 0.

    Args:
        logits: [B, L, V].
        temperature: T > 0, the sampling temperature.
        chunk_tokens: positions processed at once.

    Returns:
        [B, L] float32 entropies in nats.
    """
    _check(logits, temperature, chunk_tokens)
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [B*L, V]
    out = []
    for start in range(0, flat_logits.shape[0], chunk_tokens):
        z = flat_logits[start : start + chunk_tokens].float()  # [C, V]
        if temperature != 1.0:
            z = z / temperature
        p = torch.softmax(z, dim=-1)  # [C, V]
        # A logit of -inf (a banned token) has p = 0; 0 · -inf would be NaN, and its true contribution is 0.
        z_finite = z.masked_fill(torch.isneginf(z), 0.0)  # [C, V]
        out.append(torch.logsumexp(z, dim=-1) - (p * z_finite).sum(dim=-1))  # [C]
    return torch.cat(out).reshape(logits.shape[:2]) if out else logits.new_zeros(logits.shape[:2], dtype=torch.float32)
