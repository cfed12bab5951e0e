"""Model runners for the local engine: batched prefill and decode over per-slot KV caches.

``LlamaFamilyRunner`` is the fast path: the Llama/Qwen2/Qwen3 decoder written out with the HF modules'
own weights (fused q|k|v and gate|up projections, RoPE tables from the model's rotary embedding, RMSNorm,
SiLU MLP) and ``scaled_dot_product_attention`` over a ``SlotKVCache`` with a per-slot length mask. It is
checked against the HF forward in tests. ``HFRunner`` is the slow fallback for any other causal LM: one
HF forward per sequence per step with its own ``DynamicCache``.

Both runners keep the same contract: running sequences live in slots ``0..n-1``; ``prefill`` fills the
given slots from scratch and returns the logits of each sequence's last token; ``decode`` appends one
token to each of slots ``0..n-1`` (or ``first..first+n-1``: the deterministic engine decodes one slot at a
time) and returns the next-token logits; ``move`` puts one slot's cache into another.
The fast runner can also extend a slot whose cache already holds a prefix (``prefill(..., starts)``,
``copy_prefix``), which the engine uses to reuse the KV of an earlier turn or a shared prompt.

Devices and dtypes: every operator the fast path calls has a CUDA kernel but one, the CPU attention kernel that
``attention_lse`` calls on a CPU (its portable path elsewhere; ``tests/test_cuda_kernels.py`` checks both). A bf16 or
fp16 model runs as HF runs it: weights, activations and the KV cache in the model's dtype, RMSNorm in float32, logits
cast to float32 (sampling and logprobs in float32); the cascade's log-sum-exps and their merge in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from tether.engine.kv_cache import SlotKVCache

FAST_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# scaled_dot_product_attention's CPU kernel, which also returns the log-sum-exp of each query's scores
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# attention_lse's portable path on a CPU too (the path every other device takes; the tests check it there). Read when a
# runner is built.
PORTABLE_ATTENTION = False


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale + attn_mask)·v and the log-sum-exp of each query's scores, for cascade attention.

    q [B, H, M, hd], k/v [B, H, N, hd], attn_mask additive, broadcast to [B, H, M, N]. Returns out [B, H, M, hd] in
    q's dtype and lse [B, H, M] in float32; by ``attention_lse_for(q.device)``."""
    return attention_lse_for(q.device)(q, k, v, attn_mask=attn_mask, scale=scale)


def attention_lse_for(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``attention_lse``'s implementation on ``device`` (a runner picks it once: decode calls it twice a layer).

    On a CPU: the CPU kernel of ``scaled_dot_product_attention``, which returns the log-sum-exp but has no CUDA kernel
    (``_portable_attention_lse`` measured 2x slower per call on a CPU: 108 vs 53 µs for 8 samples' 16 queries per
    KV head over the demo model's 600-token shared prompt).
    Elsewhere, and on a CPU with ``PORTABLE_ATTENTION``: ``_portable_attention_lse``."""
    return _flash if device.type == "cpu" and not PORTABLE_ATTENTION else _portable_attention_lse


def _portable_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_lse`` from device-generic ops: the scores and their log-sum-exp in float32, as flash kernels keep
    them (bf16 scores would round a score of 10 by up to 0.03), the probabilities rounded to v's dtype for the second
    matmul, as flash kernels do. It forms the [B, H, M, N] scores: fine for cascade decode (a few queries per head,
    or one batch row of them over the shared prompt), not for a long prefill. A query that sees no key gets a NaN
    row (the engine never asks for one)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float() * scale, k.float().mT)  # [B, H, M, N]
    if attn_mask is not None:
        scores += attn_mask
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, M]
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs.to(v.dtype), v).to(q.dtype), lse


def fast_path_problem(model: Any) -> str | None:
    """Why ``LlamaFamilyRunner`` cannot run ``model`` (None when it can)."""
    cfg = model.config
    if cfg.model_type not in FAST_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {FAST_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "sliding-window layers"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if "dynamic" in str(rope.get("rope_type", "default")):
        return "dynamic RoPE scaling (position tables depend on the sequence length)"
    if model.device.type != "cpu" and model.device.type != "cuda":
        return f"device {model.device.type}"
    return None


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    @classmethod
    def snapshot(cls, **tensors: torch.Tensor | None) -> _Layer:
        copies: dict[str, Any] = {k: None if t is None else t.detach().clone() for k, t in tensors.items()}
        return cls(**copies)


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                      for lin in linears])


def _residual(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + a·weightᵀ (+ bias): one addmm for the token rows of decode and packed prefill."""
    if bias is None and x.dim() == 2:
        return torch.addmm(x, a, weight.t())
    return x + F.linear(a, weight, bias)


class LlamaFamilyRunner:
    def __init__(self, model: Any):  # a HF Llama/Qwen2/Qwen3 causal LM, read module by module
        problem = fast_path_problem(model)
        if problem:
            raise ValueError(f"LlamaFamilyRunner cannot run this model: {problem}")
        cfg = model.config
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scaling = model.model.layers[0].self_attn.scaling
        self.dtype, self.device = model.dtype, model.device
        self._attention_lse = attention_lse_for(self.device)
        self.cache = SlotKVCache(cfg.num_hidden_layers, self.num_kv_heads, self.head_dim,
                                 cfg.max_position_embeddings, self.dtype, self.device)
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self.reload()

    def reload(self) -> None:
        """Snapshot the weights of the HF modules (after they changed).

        Copies, not views: the snapshot stays consistent even if someone updates the module in place
        mid-step, and it changes only when the engine says so (so token versions are exact).
        """
        m = self.model.model
        self.embed = m.embed_tokens.weight.detach().clone()
        self.norm = m.norm.weight.detach().clone()
        lm_head = self.model.lm_head.weight
        self.lm_head = self.embed if lm_head is m.embed_tokens.weight else lm_head.detach().clone()
        self.layers = []
        for layer in m.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer.snapshot(
                ln1=layer.input_layernorm.weight,
                qkv=torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                qkv_bias=_cat_bias(att.q_proj, att.k_proj, att.v_proj),
                q_norm=att.q_norm.weight if hasattr(att, "q_norm") else None,
                k_norm=att.k_norm.weight if hasattr(att, "k_norm") else None,
                o=att.o_proj.weight, o_bias=att.o_proj.bias,
                ln2=layer.post_attention_layernorm.weight,
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                gate_up_bias=_cat_bias(mlp.gate_proj, mlp.up_proj),
                down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias,
            ))

    def _rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [n, head_dim] for positions < n, from the model's own rotary embedding; the sin table's first
        half negated (``_rotate``)."""
        if self._cos.shape[0] < n:
            size = min(self.cache.max_len, max(n, 2 * self._cos.shape[0], 256))
            pos = torch.arange(size, device=self.device)[None]
            dummy = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = self.model.model.rotary_emb(dummy, pos)
            half = self.head_dim // 2
            self._cos, self._sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return self._cos, self._sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE: HF's x·cos + rotate_half(x)·sin, where rotate_half(x) = [-x₂, x₁] is the roll [x₂, x₁] times the sign
        that ``_rope`` folded into sin (one op where chunk, neg and cat were three; the same products)."""
        return x * cos + x.roll(self.head_dim // 2, -1) * sin

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op (half the time of six)
            return F.rms_norm(x, weight.shape, weight, self.eps)
        # Same arithmetic as HF's RMSNorm: normalise in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    def _qkv(self, w: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections + RoPE. h [..., D] -> q [..., H, hd], k/v [..., KV, hd]; cos/sin [..., 1, hd]."""
        hd, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = F.linear(h, w.qkv, w.qkv_bias).unflatten(-1, (nh + 2 * nkv, hd))
        if w.q_norm is None:  # queries and keys rotated together
            qk = self._rotate(qkv[..., :nh + nkv, :], cos, sin)
            return qk[..., :nh, :], qk[..., nh:, :], qkv[..., nh + nkv:, :]
        assert w.k_norm is not None  # q_norm and k_norm come together (Qwen3)
        q, k = self._norm(qkv[..., :nh, :], w.q_norm), self._norm(qkv[..., nh:nh + nkv, :], w.k_norm)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), qkv[..., nh + nkv:, :]

    def _mlp(self, w: _Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(self._norm(x, w.ln2), w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        return _residual(x, F.silu(gate) * up, w.down, w.down_bias)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x, self.norm), self.lm_head).float()

    def prefill(self, seqs: list[list[int]], slots: list[int], starts: list[int] | None = None) -> torch.Tensor:
        """Compute ``seqs[i][starts[i]:]`` into slot ``slots[i]``, whose cache already holds the first
        ``starts[i]`` tokens (0 by default); returns last-token logits [k, V]."""
        if starts is None or not any(starts):
            return self._prefill_fresh(seqs, slots)
        return self._prefill_extend(seqs, slots, starts)

    def _prefill_fresh(self, seqs: list[list[int]], slots: list[int]) -> torch.Tensor:
        k, T = len(seqs), max(len(s) for s in seqs)
        self.cache.reserve(max(slots) + 1, T)
        ids = torch.zeros(k, T, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        lens = torch.tensor([len(s) for s in seqs], device=self.device)
        slot_idx = torch.tensor(slots, device=self.device)
        cos, sin = (t[:T, None] for t in self._rope(T))  # [T, 1, hd]: broadcast over heads
        where = self.cache.token_index(slot_idx.repeat_interleave(T), torch.arange(T, device=self.device).repeat(k))
        x = F.embedding(ids, self.embed)  # [k, T, D]
        for i, w in enumerate(self.layers):
            q, kk, v = self._qkv(w, self._norm(x, w.ln1), cos, sin)  # [k, T, heads, hd]
            self.cache.write(i, where, kk, v)  # pads too: beyond a slot's length, never read
            q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)  # [k, heads, T, hd]
            # Right padding + causal mask: a real query never sees a pad key, so no padding mask.
            a = F.scaled_dot_product_attention(q, kk, v, is_causal=True, scale=self.scaling, enable_gqa=True)
            x = x + F.linear(a.transpose(1, 2).flatten(2), w.o, w.o_bias)
            x = self._mlp(w, x)
        self.cache.lengths[slot_idx] = lens
        return self._logits(x[torch.arange(k), lens - 1])

    def _prefill_extend(self, seqs: list[list[int]], slots: list[int], starts: list[int]) -> torch.Tensor:
        """The new tokens of every row packed into one sequence for the projections and the MLP (no padding), and
        unpacked per row, its queries padded, for attention over the row's cache (``_attend``). (Reading a prompt
        prefix common to the rows once, as decode does, measured no faster here: each row's keys already serve
        all of its new tokens' queries.)"""
        k, L, dev = len(seqs), max(len(s) for s in seqs), self.device
        new = [s[st:] for s, st in zip(seqs, starts)]
        T = max(len(n) for n in new)
        self.cache.reserve(max(slots) + 1, L)
        ids = torch.tensor([t for n in new for t in n], device=dev)  # [N] the new tokens, row after row
        new_lens = torch.tensor([len(n) for n in new], device=dev)
        start = torch.tensor(starts, device=dev)
        rows = torch.repeat_interleave(torch.arange(k, device=dev), new_lens)  # [N] each token's row
        ends = new_lens.cumsum(0)
        cols = torch.arange(len(ids), device=dev) - (ends - new_lens)[rows]  # [N] its index among the row's new tokens
        pos = start[rows] + cols  # [N] absolute positions
        slot_idx = torch.tensor(slots, device=dev)
        where = self.cache.token_index(slot_idx[rows], pos)
        cos, sin = self._rope(L)
        cos, sin = cos[pos, None], sin[pos, None]  # [N, 1, hd]
        # query t of row i sees the keys j < L with j <= start_i + t (additive); the pad queries (t >= the row's
        # new tokens) see garbage and are never read back
        qpos = start[:, None] + torch.arange(T, device=dev)  # [k, T]
        keep = torch.arange(L, device=dev)[None, None] <= qpos[:, :, None]  # [k, T, L]
        mask = torch.zeros(k, T, L, dtype=self.dtype, device=dev).masked_fill_(~keep, float("-inf"))
        nkv, rep, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        mask = mask[:, None].expand(k, rep, T, L).reshape(k, 1, rep * T, L)
        sel = slice(slots[0], slots[0] + k) if slots == list(range(slots[0], slots[0] + k)) else slot_idx
        x = F.embedding(ids, self.embed)  # [N, D]
        for i, w in enumerate(self.layers):
            q, kk, v = self._qkv(w, self._norm(x, w.ln1), cos, sin)  # q [N, H, hd], k/v [N, KV, hd]
            self.cache.write(i, where, kk, v)
            padded = q.new_zeros(k, T, self.num_heads, hd)
            padded[rows, cols] = q
            # each KV head's queries: its rep query heads × T positions, [k, KV, rep * T, hd]
            q = padded.view(k, T, nkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(k, nkv, rep * T, hd)
            a = self._attend(q, i, sel, 0, L, mask).view(k, nkv, rep, T, hd).permute(0, 3, 1, 2, 4)[rows, cols]
            x = _residual(x, a.reshape(len(ids), -1), w.o, w.o_bias)
            x = self._mlp(w, x)
        self.cache.lengths[slot_idx] = start + new_lens
        return self._logits(x[ends - 1])

    def decode(self, tokens: list[int], first: int = 0, shared: int = 0) -> torch.Tensor:
        """Append ``tokens[i]`` to slot ``first + i`` for i < n; returns next-token logits [n, V].

        ``shared``: the first ``shared`` cached positions hold the same tokens in every decoded slot (a system prompt
        and tool list): attention reads their keys and values once, from slot ``first``, for all the queries
        (``_attend``), instead of once per slot."""
        n, cache = len(tokens), self.cache
        s = slice(first, first + n)  # the slots decoded
        L = int(cache.lengths[s].max()) + 1
        cache.reserve(first + n, L)
        pos = cache.lengths[s]  # [n] where each new token goes (read after reserve, which may reallocate)
        shared = min(shared, int(pos.min()))  # each slot attends to one position at least on its own: its new token
        cos, sin = self._rope(L)
        cos, sin = cos[pos, None], sin[pos, None]  # [n, 1, hd]
        # additive (a bit faster), over the positions each slot attends to on its own: [shared, L)
        keep = torch.arange(shared, L, device=self.device)[None] <= pos[:, None]  # [n, L - shared]
        mask = torch.zeros(n, 1, 1, L - shared, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~keep[:, None, None, :], float("-inf"))
        where = cache.token_index(torch.arange(first, first + n, device=self.device), pos)
        rep = self.num_heads // self.num_kv_heads
        x = F.embedding(torch.tensor(tokens, device=self.device), self.embed)  # [n, D]
        for i, w in enumerate(self.layers):
            q, kk, v = self._qkv(w, self._norm(x, w.ln1), cos, sin)  # q [n, H, hd], k/v [n, KV, hd]
            cache.write(i, where, kk, v)
            # Grouped-query attention without repeating the cache: the query heads of one KV head
            # become that head's query "positions".
            a = self._attend(q.view(n, self.num_kv_heads, rep, self.head_dim), i, s, shared, L, mask)
            x = _residual(x, a.reshape(n, -1), w.o, w.o_bias)
            x = self._mlp(w, x)
        cache.lengths[s] += 1
        return self._logits(x)

    def _attend(self, q: torch.Tensor, layer: int, slots: slice | torch.Tensor, shared: int, length: int,
                mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [n, KV, m, hd] (m queries per KV head of each of n sequences) over positions [0, length) of
        the cache's ``slots`` (consecutive ones as a slice, or an index tensor); ``mask`` [n, 1, 1 or m, length -
        shared] additive, over the positions [shared, length) that each sequence attends to on its own.

        The first ``shared`` positions hold the same keys and values in every one of these slots (a system prompt and
        tool list; cascade attention): they are read once, from the first slot, by one attention of all n·m queries
        per KV head, the rest by one attention per sequence over its own, and the two are merged by their
        log-sum-exps."""
        k, v = self.cache.k[layer], self.cache.v[layer]
        own_k, own_v = k[slots, :, shared:length], v[slots, :, shared:length]
        if not shared:
            return F.scaled_dot_product_attention(q, own_k, own_v, attn_mask=mask, scale=self.scaling)
        n, kv, m, hd = q.shape
        src = slots.start if isinstance(slots, slice) else int(slots[0])
        qp = q.transpose(0, 1).reshape(1, kv, n * m, hd)  # every query of a KV head, one batch row
        attention_lse = self._attention_lse
        out_p, lse_p = attention_lse(qp, k[src:src + 1, :, :shared], v[src:src + 1, :, :shared], scale=self.scaling)
        out_p, lse_p = out_p.view(kv, n, m, hd).transpose(0, 1), lse_p.view(kv, n, m).transpose(0, 1)
        out_s, lse_s = attention_lse(q, own_k, own_v, attn_mask=mask, scale=self.scaling)
        # weights e^lse_p : e^lse_s, i.e. sigmoid(lse_p - lse_s) for the shared part
        weight = torch.sigmoid(lse_p - lse_s).unsqueeze(-1)  # float32, as the log-sum-exps
        if out_s.dtype != weight.dtype:  # bf16/fp16 parts: merged in float32, then rounded to their dtype
            return torch.lerp(out_s.float(), out_p.float(), weight).to(out_s.dtype)
        return torch.lerp(out_s, out_p, weight)

    def copy_prefix(self, src: int, dst: int, n: int, keep: int = 0) -> None:
        """Slot ``dst`` gets the first ``n`` cached tokens of slot ``src``; it holds the first ``keep`` already."""
        self.cache.copy_prefix(src, dst, n, keep)

    def move(self, src: int, dst: int, keep: int = 0) -> None:
        """Slot ``src``'s cached tokens into slot ``dst``, which holds the first ``keep`` of them already (the rest of
        its contents are dropped); ``src`` is left as it was."""
        self.cache.copy_prefix(src, dst, self.length(src), keep)

    def length(self, slot: int) -> int:
        """How many tokens ``slot`` holds."""
        return int(self.cache.lengths[slot]) if slot < self.cache.num_slots else 0

    def truncate(self, slot: int, n: int) -> None:
        """Keep only the first ``n`` cached tokens of ``slot``."""
        self.cache.reserve(slot + 1, n)
        self.cache.lengths[slot] = n


class HFRunner:
    """Fallback for any causal LM: per-sequence HF forwards with a DynamicCache each (slow, exact).
    No prefix reuse: ``prefill`` always starts from an empty cache."""

    def __init__(self, model: Any):  # any HF causal LM
        self.model = model
        self.caches: list[DynamicCache | None] = []

    def reload(self) -> None:
        pass  # reads the live modules

    def _forward(self, ids: list[int], cache: DynamicCache | None) -> torch.Tensor:
        input_ids = torch.tensor([ids], device=self.model.device)
        return self.model(input_ids=input_ids, cache=cache, use_cache=True).logits[0, -1].float()

    def prefill(self, seqs: list[list[int]], slots: list[int], starts: list[int] | None = None) -> torch.Tensor:
        assert not starts or not any(starts), "HFRunner has no prefix reuse"
        self.caches.extend([None] * (max(slots) + 1 - len(self.caches)))
        out = []
        for seq, slot in zip(seqs, slots):
            cache = self.caches[slot] = DynamicCache(config=self.model.config)
            out.append(self._forward(seq, cache))
        return torch.stack(out)

    def decode(self, tokens: list[int], first: int = 0, shared: int = 0) -> torch.Tensor:
        """``shared`` is ignored: every sequence attends over its own cache."""
        return torch.stack([self._forward([t], self.caches[first + i]) for i, t in enumerate(tokens)])

    def truncate(self, slot: int, n: int) -> None:
        assert n == 0, "HFRunner has no prefix reuse"
        self.caches.extend([None] * (slot + 1 - len(self.caches)))
        self.caches[slot] = None

    def move(self, src: int, dst: int, keep: int = 0) -> None:
        self.caches.extend([None] * (max(src, dst) + 1 - len(self.caches)))
        self.caches[dst], self.caches[src] = self.caches[src], None
