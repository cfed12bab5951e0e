"""Stage timers for one RL step, attached by wrapping the pipeline's own functions (no change to tether's code).

Shared by ``step_profile.py`` and ``scaling.py``; it wraps only public-enough names that exist both in the
current tree and at the start of issue 12, so the same script measures the baseline worktree
(``PYTHONPATH=/tmp/speed-base``). A wrapper credits its *exclusive* wall time to its stage (time spent in a
nested stage, e.g. the reference model's forward inside the loss, goes to the inner one), per thread: the engine
thread (prefill, decode, KV-cache moves) runs beside the event-loop thread (environment, templates), so their
stage times overlap in wall-clock, while the trainer's stages (π_prox, forward, backward, optimizer, weight sync)
are the learner's and add up (they run in the learner's worker beside the engine with learner.overlap_rollout).

FLOPs come from the model config and the token counts each call sees (``Flops``): 2 × matmul parameters per
token, plus 4 × hidden × context per token and layer for attention, backward = 2 × forward. *Useful* FLOPs only:
padding is not counted, so a padded forward shows as a lower achieved rate.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

STAGES = ("prefill", "decode", "kv moves", "environment+verifier", "template/tokens", "pi_prox scoring",
          "reference forward", "forward", "backward", "optimizer", "weight sync")
TRAINER_STAGES = ("pi_prox scoring", "reference forward", "forward", "backward", "optimizer", "weight sync")


@dataclass(frozen=True)
class Flops:
    """Matmul shapes and FLOP counts of a Llama/Qwen2-family model, from its config."""

    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Flops:
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                   config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads, hd,
                   config.vocab_size)

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's matmuls: fused qkv, o, fused gate/up, down."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return [(h, self.heads * self.head_dim + 2 * kv), (self.heads * self.head_dim, h), (h, 2 * self.inter),
                (self.inter, h)]

    @property
    def layer_params(self) -> int:
        return sum(a * b for a, b in self.linears())

    def forward(self, tokens: int, attn_pairs: int, logit_rows: int) -> float:
        """Forward FLOPs: ``tokens`` through the layers, ``attn_pairs`` (query, key) pairs, ``logit_rows`` logits."""
        return (2.0 * self.layers * self.layer_params * tokens + 4.0 * self.layers * self.heads * self.head_dim
                * attn_pairs + 2.0 * self.hidden * self.vocab * logit_rows)


def causal_pairs(lengths: list[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


class Timers:
    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.flops: dict[str, float] = defaultdict(float)
        self.tokens: dict[str, int] = defaultdict(int)
        self.shapes: dict[str, list[int]] = defaultdict(list)  # rows (M) per matmul call, for the roofline
        self.extra: dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._lock = threading.Lock()

    def reset(self) -> None:
        for d in (self.wall, self.calls, self.flops, self.tokens, self.shapes, self.extra):
            d.clear()

    def _stack(self) -> list[list[float]]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def enter(self) -> None:
        self._stack().append([time.perf_counter(), 0.0])

    def leave(self, stage: str) -> None:
        stack = self._stack()
        t0, inner = stack.pop()
        elapsed = time.perf_counter() - t0
        if stack:
            stack[-1][1] += elapsed
        with self._lock:
            self.wall[stage] += elapsed - inner
            self.calls[stage] += 1

    def count(self, stage: str, flops: float = 0.0, tokens: int = 0, rows: int | None = None) -> None:
        with self._lock:
            self.flops[stage] += flops
            self.tokens[stage] += tokens
            if rows:
                self.shapes[stage].append(rows)

    def wrap(self, owner: Any, name: str, stage: str, measure: Callable[..., None] | None = None) -> None:
        """Replace ``owner.name`` by a timed version; ``measure(*args, **kwargs)`` counts FLOPs/tokens."""
        fn = getattr(owner, name)
        if getattr(fn, "_stage_timed", False):
            return
        timers = self
        if inspect.iscoroutinefunction(fn):
            raise TypeError(f"{name} is a coroutine function: time its synchronous parts instead")

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if measure is not None:
                measure(*args, **kwargs)
            timers.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.leave(stage)

        timed._stage_timed = True  # type: ignore[attr-defined]
        setattr(owner, name, timed)


def seq_lengths(mb: Any) -> list[int]:
    """Real sequence lengths of a learner micro-batch (padded rows, or packed with ``seq_lens``)."""
    lens = getattr(mb, "seq_lens", None)
    if lens is not None:
        return [int(n) for n in lens]
    return [int(n) for n in mb.attention_mask.sum(dim=1)]


def matmul_gflops(rows: int, shapes: list[tuple[int, int]], backward: bool = False, repeats: int = 5) -> float:
    """fp32 matmul GFLOP/s at ``rows`` × each (in, out) of ``shapes`` (and the two backward products), best of
    ``repeats``: the roofline a stage of those shapes can reach on this machine and thread count."""
    rows = max(int(rows), 1)
    best = float("inf")
    xs = [(torch.randn(rows, a), torch.randn(b, a), torch.randn(rows, b)) for a, b in shapes]
    flops = sum(2.0 * rows * a * b for a, b in shapes) * (2 if backward else 1)
    for _ in range(repeats):
        t = time.perf_counter()
        for x, w, g in xs:
            if backward:
                g @ w  # dX = dY W      [rows, out] x [out, in]
                g.t() @ x  # dW = dY^T X  [out, rows] x [rows, in]
            else:
                torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def attach(timers: Timers, model_config: Any) -> None:
    """Wrap the pipeline's functions (call before the run is built)."""
    from tether.agent import chat
    from tether.engine import forward as eng_forward
    from tether.engine.local import LocalEngine
    from tether.env.customer_service import env as cs_env
    from tether.learner import accumulate as accumulate_mod
    from tether.learner import learner as learner_mod
    from tether.learner import logits as logits_mod
    from tether.learner.optim import PolicyOptimizer
    from tether.pipeline.weights import WeightSync

    fl = Flops.of(model_config)
    runner = eng_forward.LlamaFamilyRunner

    def m_prefill(self: Any, seqs: list[list[int]], slots: list[int], starts: list[int] | None = None) -> None:
        starts = starts or [0] * len(seqs)
        new = [len(s) - st for s, st in zip(seqs, starts)]
        pairs = sum(sum(range(st + 1, len(s) + 1)) for s, st in zip(seqs, starts))
        timers.count("prefill", fl.forward(sum(new), pairs, len(seqs)), sum(new), rows=sum(new))

    def m_decode(self: Any, tokens: list[int], first: int = 0, **kwargs: Any) -> None:
        ctx = int(self.cache.lengths[first:first + len(tokens)].sum()) + len(tokens)
        timers.count("decode", fl.forward(len(tokens), ctx, len(tokens)), len(tokens), rows=len(tokens))

    timers.wrap(runner, "prefill", "prefill", m_prefill)
    timers.wrap(runner, "decode", "decode", m_decode)
    timers.wrap(LocalEngine, "_emit", "decode")  # sampling belongs to decoding
    for name in ("swap", "copy_prefix", "move"):
        if hasattr(runner, name):  # (an older tree has no move)
            timers.wrap(runner, name, "kv moves")
    timers.wrap(LocalEngine, "_apply", "weight sync")

    for name in ("reset", "_absorb", "_observation", "_end", "finalize"):
        timers.wrap(cs_env.CustomerServiceEnv, name, "environment+verifier")
    from tether.env import tools as tools_mod

    timers.wrap(tools_mod.Tool, "check_params", "environment+verifier")
    from tether.env.customer_service import user_sim, world

    for cls in (world.World, user_sim.UserSimulator):
        for attr, value in list(vars(cls).items()):
            if inspect.isfunction(value) and not attr.startswith("__") and not inspect.iscoroutinefunction(value):
                timers.wrap(cls, attr, "environment+verifier")

    timers.wrap(chat, "render_ids", "template/tokens")
    timers.wrap(chat.ChatAssembler, "__init__", "template/tokens")
    for name in ("prompt", "suffix_after_assistant"):
        timers.wrap(chat.ChatAssembler, name, "template/tokens")
    from tether.agent import loop as loop_mod
    from tether.learner import model as model_mod

    get_parser = loop_mod.get_parser

    def timed_parser(name: str) -> Any:
        holder = type("Parser", (), {"parse": staticmethod(get_parser(name))})
        timers.wrap(holder, "parse", "template/tokens")
        return holder.parse

    loop_mod.get_parser = timed_parser  # type: ignore[assignment]
    load = model_mod.load_model_and_tokenizer

    def load_and_time(*args: Any, **kwargs: Any) -> Any:
        model, tok = load(*args, **kwargs)
        for name in ("decode", "apply_chat_template", "get_vocab", "convert_tokens_to_ids"):
            if hasattr(type(tok), name):
                timers.wrap(type(tok), name, "template/tokens")
        return model, tok

    model_mod.load_model_and_tokenizer = load_and_time  # type: ignore[assignment]

    def m_score(self: Any, batch: Any, device: Any = None, skip: int = 0, **kwargs: Any) -> None:
        lens = seq_lengths(batch)[skip:]
        n_loss = int(batch.loss_mask[skip:, 1:].sum())
        timers.count("pi_prox scoring", fl.forward(sum(lens), causal_pairs(lens), n_loss), sum(lens))

    def m_micro(self: Any, mb: Any, *args: Any, **kwargs: Any) -> None:
        # useful FLOPs: every token through the layers, logits only where the loss reads them (loss mask 1)
        lens, n_loss = seq_lengths(mb), int(mb.loss_mask[:, 1:].sum())
        f = fl.forward(sum(lens), causal_pairs(lens), n_loss)
        timers.count("forward", f, sum(lens), rows=sum(lens))
        timers.count("backward", 2 * f, sum(lens), rows=sum(lens))
        if getattr(getattr(self, "learner", self), "ref_model", None) is not None:
            timers.count("reference forward", f, sum(lens), rows=sum(lens))
        padded = mb.input_ids.numel()
        timers.extra["learner padded tokens"] += padded
        timers.extra["learner real tokens"] += sum(lens)

    L = learner_mod.Learner
    timers.wrap(L, "score", "pi_prox scoring", m_score)
    timers.wrap(accumulate_mod.Accumulation, "inputs", "forward", m_micro)
    timers.wrap(PolicyOptimizer, "update", "optimizer")
    timers.wrap(WeightSync, "push", "weight sync")
    orig_backward = torch.Tensor.backward

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        timers.enter()
        try:
            orig_backward(self, *args, **kwargs)
        finally:
            timers.leave("backward")

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    orig_init = L.__init__

    @functools.wraps(orig_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        ref = getattr(self, "ref_model", None)
        if ref is not None:  # the instance's forward: nested inside the loss, so its time is its own
            timers.wrap(ref, "forward", "reference forward")
            ref._stage_reference = True  # for token_logits, which calls the backbone and the head directly

    L.__init__ = init  # type: ignore[method-assign]
    token_logits = getattr(logits_mod, "token_logits", None)
    if token_logits is not None and not getattr(token_logits, "_stage_timed", False):

        @functools.wraps(token_logits)
        def logits_of(model: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(model, "_stage_reference", False):
                return token_logits(model, *args, **kwargs)
            timers.enter()
            try:
                return token_logits(model, *args, **kwargs)
            finally:
                timers.leave("reference forward")

        logits_of._stage_timed = True  # type: ignore[attr-defined]
        logits_mod.token_logits = logits_of
