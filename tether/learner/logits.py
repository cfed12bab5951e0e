"""The logits a policy loss reads, and no others: ``token_logits``; and the one path from them to the sampled tokens'
log-probabilities (and entropy) that the learner's scoring, its loss and its KL reference all take: ``forward``.

The loss of a trajectory reads the logits that predict its model-sampled tokens (loss mask 1) and nothing else, and
in an agentic rollout most tokens are not those: the system prompt, the tool list, tool results, the user's turns.
So the backbone runs over every token (they are the context) but only the selected positions go through the LM
head, its log-softmax, entropy and their backward. And the leading tokens that every row of a micro-batch shares
(the system prompt and tool list of every episode; the whole prompt of one group's episodes) run through the
layers once, as a batch of one whose keys and values the rows attend to. Both are the plain forward's arithmetic
on fewer positions: the logits and gradients agree with it to float rounding (``tests/test_speed_equivalence.py``).

Mixed precision (``model.dtype: bfloat16``): ``compute_dtype`` runs the model's forward (and so its backward) under
``torch.autocast`` in that dtype over float32 weights, the LM head included, so the logits come out in bfloat16; their
log-softmax, the sampled tokens' log-probabilities and the entropy are taken in float32 (``tether.algo.logprobs``
upcasts chunk by chunk), and so is everything the loss computes from them. A model sharded with FSDP2's
``MixedPrecisionPolicy`` already computes in its ``param_dtype``: it is given no ``compute_dtype``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from tether.algo import entropy_from_logits, logprobs_from_logits


@dataclass(frozen=True)
class Forward:
    """A micro-batch's forward at the loss positions ``sel`` (shifted: position t predicts token t+1)."""

    logits: torch.Tensor  # [n, V] raw logits at the selected positions, n = sel.sum()
    logp: torch.Tensor  # [b, T-1] log_softmax(logits / T) of the sampled tokens, 0 where sel is False
    sel: torch.Tensor  # [b, T-1] bool
    temperature: float  # T: the sampling temperature the log-probabilities are taken at

    def entropy(self) -> torch.Tensor:
        """H(softmax(logits / T)) at the selected positions, [b, T-1] (0 elsewhere); with grad where it is on."""
        return scatter(entropy_from_logits(self.logits[None], self.temperature)[0], self.sel)


def forward(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, sel: torch.Tensor,
            temperature: float, compute_dtype: torch.dtype | None = None) -> Forward:
    """``model``'s log-probabilities of the tokens ``input_ids[:, 1:]`` at the positions ``sel`` [b, T-1], at
    ``temperature``: the logits there (``token_logits``), their log-softmax gathered at the sampled tokens, in float32.
    ``compute_dtype``: the model's forward under autocast in that dtype (None: in its parameters' own)."""
    with autocast(input_ids.device, compute_dtype):
        logits = token_logits(model, input_ids, attention_mask, sel)  # [n, V] in compute_dtype
    logp = logprobs_from_logits(logits[None], input_ids[:, 1:][sel][None], temperature)[0]  # [n] float32
    return Forward(logits, scatter(logp, sel), sel, temperature)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` on ``device``'s type in ``dtype``; nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def scatter(values: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``values`` [n] laid out at the True positions of ``sel`` [b, L], 0 elsewhere (differentiable)."""
    return values.new_zeros(sel.shape).masked_scatter(sel, values)


def token_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 sel: torch.Tensor) -> torch.Tensor:
    """The logits that predict ``input_ids[:, 1:][sel]``, [n, V]: the backbone's hidden states at the selected
    positions through the LM head. The loss reads only the model-sampled tokens, so the [b, T, V] logits of the
    prompt and tool tokens (and their log-softmax, entropy and backward), most of a forward's work at a small
    model's vocabulary, are never formed. Models whose head does more than a linear map (logit soft-capping or
    scaling) take the plain path: full logits, then the same positions."""
    if hasattr(model, "get_base_model"):  # a peft model (model.lora): the adapter lives in the HF model's own layers
        model = model.get_base_model()
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    plain_head = not any(getattr(config, k, None) for k in ("final_logit_softcapping", "logit_scale"))
    sharded = isinstance(model, FSDPModule)  # FSDP2 gathers the root's weights (embeddings, head) in its forward only
    if backbone is None or backbone is model or not isinstance(head, torch.nn.Linear) or not plain_head or sharded:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return logits[:, :-1][sel]
    prefix = shared_prefix(input_ids, attention_mask)
    if prefix >= MIN_SHARED_PREFIX and getattr(config, "model_type", None) in SHARED_PREFIX_MODELS:
        hidden = _hidden_with_shared_prefix(backbone, input_ids, attention_mask, prefix)  # [b, T, D]
    else:
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return head(hidden[:, :-1][sel])  # [n, V]


MIN_SHARED_PREFIX = 16  # tokens; below this a shared prefix is not worth a second forward call
SHARED_PREFIX_MODELS = ("llama", "qwen2", "qwen3")  # decoders whose cache and position handling is checked by tests


def shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading tokens every row has in common (unpadded), leaving each row at least one of its own:
    the system prompt and tool list of every episode, the whole prompt of a group's episodes."""
    if input_ids.shape[0] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(dim=0) & attention_mask.bool().all(dim=0)  # [T]
    run = int(same.long().cumprod(dim=0).sum())
    return max(0, min(run, int(attention_mask.sum(dim=1).min()) - 1))


def _hidden_with_shared_prefix(backbone: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               prefix: int) -> torch.Tensor:
    """The backbone's hidden states [b, T, D] with the rows' common first ``prefix`` tokens computed once.

    The prefix runs as a batch of one; its keys and values, repeated per row, are the cache the rows' own tokens
    attend to (positions continue at ``prefix``). Gradients flow through that cache and the prefix's hidden states
    into the one prefix forward, so the loss and its gradient are those of the plain forward (to float rounding;
    ``tests/test_speed_equivalence.py``) at a fraction of the work when the prompt is most of each sequence."""
    b, t = input_ids.shape
    out = backbone(input_ids=input_ids[:1, :prefix], use_cache=True)
    cache = out.cache
    cache.batch_repeat_interleave(b)
    positions = torch.arange(prefix, t, device=input_ids.device)
    rest = backbone(input_ids=input_ids[:, prefix:], attention_mask=attention_mask, cache=cache, use_cache=True,
                    position_ids=positions[None].expand(b, -1), cache_position=positions).last_hidden_state
    return torch.cat([out.last_hidden_state.expand(b, -1, -1), rest], dim=1)
