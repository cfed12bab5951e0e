"""The local engine on a bfloat16 model: behaviour logprobs vs a teacher-forced HF forward of the same model.

The engine keeps the KV cache in the model's dtype, normalises in float32 as HF's RMSNorm does, merges the cascade
attention's parts in float32 and samples from float32 logits; so its logprobs differ from a teacher-forced forward of
the same bf16 weights only by where bf16 rounds (the order of the sums, one token at a time vs the whole sequence).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from tether.engine import SamplingParams
from tether.engine.forward import LlamaFamilyRunner
from tether.engine.local import LocalEngine
from tether.learner import build_tiny, load_model_and_tokenizer

SYSTEM = ("<|im_start|>system\nYou are a customer service agent. Use the tools to look up orders, refunds and "
          "inventory.<|im_end|>\n<|im_start|>user\nMy order is late.<|im_end|>\n<|im_start|>assistant\n")
TEXTS = ["Where is my order ORD-1234? It is late.", '{"name": "query_inventory", "arguments": {"sku_id": "SKU-77"}}',
         "refund " * 30, "<|im_start|>user\nIs SKU-1 in stock?<|im_end|>\n<|im_start|>assistant\n"]
GROUP = [SamplingParams(temperature=1.0, max_tokens=30, seed=i) for i in range(4)]
OTHERS = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, seed=1),
          SamplingParams(temperature=1.3, max_tokens=20, seed=2), SamplingParams(temperature=0.0, max_tokens=25),
          SamplingParams(temperature=1.0, top_p=0.5, max_tokens=15, seed=3)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), seed=0)  # the tiny preset's shape: 4 layers, 256 wide


def workload(model, tok, monkeypatch) -> tuple[list[list[int]], list[SamplingParams], list, list[int]]:
    """A group of 4 samples of one system prompt (decoded together: cascade attention over it), then 4 different
    prompts (prefill and plain decode; seeded, top-p and greedy sampling). Returns the prompts, their parameters,
    the results and the shared prompt lengths decode was given."""
    seen: list[int] = []
    decode = LlamaFamilyRunner.decode

    def spy(self, tokens, first=0, shared=0):
        seen.append(shared)
        return decode(self, tokens, first, shared)
    monkeypatch.setattr(LlamaFamilyRunner, "decode", spy)
    prompts = [tok.encode(SYSTEM)] * 4 + [tok.encode(t) for t in TEXTS]

    async def main(engine, prompts, params):
        return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(prompts, params)])
    with LocalEngine(model) as engine:
        assert engine._runner.cache.store.dtype == model.dtype  # the KV cache in the model's dtype
        results = asyncio.run(main(engine, prompts[:4], GROUP)) + asyncio.run(main(engine, prompts[4:], OTHERS))
    return prompts, GROUP + OTHERS, results, seen


def teacher_forced(model, prompt: list[int], tokens: list[int], temperature: float) -> tuple[torch.Tensor, float]:
    """log_softmax(logits / T) of ``tokens`` from one forward of the whole sequence (in float32 from the model's bf16
    logits, as the learner takes them), and the largest |logit| there."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return logp, logits.abs().max().item()


def test_bf16_engine_logprobs_match_a_teacher_forced_forward(tiny_path, monkeypatch):
    """Tolerance: a logprob is z_t − logsumexp(z) over logits z that both sides round to bf16 (8 significant bits,
    as HF does), so their last bit alone can move it by one bf16 ulp of the largest logit, 2^(⌊log2 max|z|⌋ − 7),
    and the bf16 roundings of the hidden states before them (other sums, one token at a time vs the whole
    sequence) by about as much again: max |Δ| ≤ 4 ulps. The mean is the figure the field watches (0.01–0.02 called
    healthy, TRL #5312): ≤ 0.01. Measured here: max 0.0084 (≈ 1 ulp at max|z| ≈ 1.6), mean 0.0017; on the demo's
    SFT model (logits up to 31.9, ulp 0.125): max 0.119, mean 0.0035."""
    model, tok = load_model_and_tokenizer(tiny_path, "bfloat16")
    assert model.dtype == torch.bfloat16
    prompts, params, results, shared = workload(model, tok, monkeypatch)
    assert max(shared) >= 32  # the group's decodes read the system prompt once (cascade attention)
    gaps, top = [], 0.0
    for p, sp, r in zip(prompts, params, results):
        assert len(r.token_ids) == len(r.logprobs) == sp.max_tokens
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.logprobs)
        ref, biggest = teacher_forced(model, p, r.token_ids, sp.temperature or 1.0)
        gaps.append((ref - torch.tensor(r.logprobs)).abs())
        top = max(top, biggest)
    gap = torch.cat(gaps)
    ulp = 2.0 ** (math.floor(math.log2(top)) - 7)
    print(f"\nbf16 engine vs teacher-forced bf16 forward, {len(gap)} tokens: |Δ logp| max {gap.max():.4f}, "
          f"mean {gap.mean():.4f} (max |logit| {top:.2f}, bf16 ulp there {ulp:.4f})")
    assert gap.max().item() <= 4 * ulp
    assert gap.mean().item() <= 0.01


def test_bf16_engine_is_seeded_and_finite_beside_fp32(tiny_path, monkeypatch):
    """The same requests give the same tokens and logprobs again (per-request generators, whatever the dtype); the
    fp32 engine's greedy tokens need not agree with bf16's, but both give finite logprobs."""
    model, tok = load_model_and_tokenizer(tiny_path, "bfloat16")
    first = workload(model, tok, monkeypatch)[2]
    again = workload(model, tok, monkeypatch)[2]
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.logprobs for r in first] == [r.logprobs for r in again]
    fp32, _ = load_model_and_tokenizer(tiny_path)
    full = workload(fp32, tok, monkeypatch)[2]
    assert all(math.isfinite(lp) for r in full for lp in r.logprobs)
    greedy = [i for i, sp in enumerate(GROUP + OTHERS) if sp.temperature == 0]
    same = sum(a == b for i in greedy for a, b in zip(first[i].token_ids, full[i].token_ids))
    print(f"\ngreedy tokens equal in bf16 and fp32: {same} of {sum(len(first[i].token_ids) for i in greedy)}")
