"""The local engine serving base + a LoRA adapter (``LocalEngine.update_adapter``, ``tether.engine.lora``).

What is checked, with numbers: the behaviour logprobs of the engine with an adapter merged equal a teacher-forced
forward of the PEFT model (unmerged: x W^T + s · x A^T B^T) within 1e-5 in float32, so merged and unmerged agree; an
adapter after an adapter is merged from the base (no drift), and unloading gives the base weights back bit for bit;
a bad adapter is refused naming its layer; a bfloat16 engine merges in float32 and rounds once.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from tether.config.sections import LoraConfig
from tether.engine import SamplingParams
from tether.engine.local import LocalEngine
from tether.engine.lora import AdapterMerge
from tether.learner import load_model_and_tokenizer, lora

torch.set_num_threads(1)
TEXTS = ["Where is my order ORD-1234? It is late.", '{"name": "query_inventory", "arguments": {"sku_id": "SKU-7"}}',
         "refund please", "<|im_start|>user\nIs SKU-1 in stock?<|im_end|>\n<|im_start|>assistant\n"]


def adapted(tiny_model: str, seed: int, rank: int = 4, alpha: float = 8.0):
    """The tiny model wrapped by peft with a random adapter (B non-zero, so it changes the policy)."""
    model, tok = load_model_and_tokenizer(tiny_model)
    peft_model = lora.wrap(model, LoraConfig(rank=rank, alpha=alpha))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return peft_model.eval(), tok


def generate(engine: LocalEngine, prompts: list[list[int]]) -> list:
    async def main():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=1.0, max_tokens=20, seed=i))
                                      for i, p in enumerate(prompts)])
    return asyncio.run(main())


def teacher_forced_gap(model, prompts, results) -> float:
    """max |engine logprob − log_softmax of a forward over prompt + tokens| over every generated token."""
    gap = 0.0
    with torch.no_grad():
        for p, r in zip(prompts, results):
            logits = model(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
            gap = max(gap, (ref - torch.tensor(r.logprobs)).abs().max().item())
    return gap


def test_the_engine_with_an_adapter_samples_the_peft_models_logprobs(tiny_model):
    """Merged (the engine) vs unmerged (peft's forward): measured max |Δ| ≈ 5e-7 (fp32 rounding of the two sums)."""
    peft_model, tok = adapted(tiny_model, seed=1)
    base, _ = load_model_and_tokenizer(tiny_model)
    prompts = [tok.encode(t) for t in TEXTS]
    with LocalEngine(copy.deepcopy(base)) as engine:
        engine.update_adapter(lora.adapter_for_engine(peft_model), lora.scaling(peft_model), 3)
        results = generate(engine, prompts)
    assert all(r.versions == [3] * len(r.token_ids) and len(r.token_ids) == 20 for r in results)
    gap = teacher_forced_gap(peft_model, prompts, results)
    assert gap <= 1e-5, gap
    assert teacher_forced_gap(base, prompts, results) > 1e-2  # the adapter changed the policy it samples


def test_adapter_after_adapter_is_merged_from_the_base_and_unloading_restores_it(tiny_model):
    base, _ = load_model_and_tokenizer(tiny_model)
    first, tok = adapted(tiny_model, seed=1)
    second, _ = adapted(tiny_model, seed=2, alpha=4.0)
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = copy.deepcopy(base)
    with LocalEngine(model) as engine:
        engine.update_adapter(lora.adapter_for_engine(first), lora.scaling(first), 1)
        engine.update_adapter(lora.adapter_for_engine(second), lora.scaling(second), 2)
        results = generate(engine, prompts)
        assert teacher_forced_gap(second, prompts, results) <= 1e-5  # the second adapter on the base, not on the first
        engine.unload_adapter(3)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # the base, bit for bit
        results = generate(engine, prompts)
    assert all(r.versions[0] == 3 for r in results)
    assert teacher_forced_gap(base, prompts, results) <= 1e-5


def test_a_full_weight_load_is_the_base_of_the_next_adapter(tiny_model):
    """An adapter, then full weights (another base), then an adapter: merged onto the new base, not the first."""
    base, _ = load_model_and_tokenizer(tiny_model)
    peft_model, _ = adapted(tiny_model, seed=1)
    adapter, s = lora.adapter_for_engine(peft_model), lora.scaling(peft_model)
    new_base = {k: v + 0.01 for k, v in base.state_dict().items()}
    model = copy.deepcopy(base)
    key = "model.layers.0.self_attn.o_proj.weight"
    a, b = adapter["model.layers.0.self_attn.o_proj.lora_A"], adapter["model.layers.0.self_attn.o_proj.lora_B"]
    with LocalEngine(model) as engine:
        engine.update_adapter(adapter, s, 1)
        engine.update_weights(new_base, 2)
        assert torch.equal(model.state_dict()[key], new_base[key])
        engine.update_adapter(adapter, s, 3)
        assert torch.equal(model.state_dict()[key], new_base[key] + s * b @ a)
        engine.unload_adapter(4)
        assert torch.equal(model.state_dict()[key], new_base[key])


def test_an_adapter_on_fewer_layers_returns_the_others_to_the_base(tiny_model):
    base, _ = load_model_and_tokenizer(tiny_model)
    peft_model, _ = adapted(tiny_model, seed=1)
    adapter = lora.adapter_for_engine(peft_model)
    merge = AdapterMerge(base)
    full = merge.merged(adapter, 2.0)
    q_only = {k: v for k, v in adapter.items() if ".q_proj." in k}
    partial = merge.merged(q_only, 2.0)
    assert full.keys() == partial.keys()  # every layer the first touched is sent again
    v_proj = "model.layers.0.self_attn.v_proj.weight"
    assert torch.equal(partial[v_proj], base.state_dict()[v_proj])
    assert not torch.equal(full[v_proj], partial[v_proj])


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.pop("model.layers.0.self_attn.q_proj.lora_B"), "without both lora_A and lora_B"),
    (lambda a: a.update({"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 31)}), "does not make the weight"),
    (lambda a: a.update({"model.layers.9.mlp.up_proj.lora_A": torch.zeros(4, 32),
                         "model.layers.9.mlp.up_proj.lora_B": torch.zeros(64, 4)}), "not a layer of the engine"),
    (lambda a: a.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(64, 32)}), "must end in .lora_A or"),
])
def test_a_bad_adapter_is_refused_naming_the_layer_and_changes_nothing(tiny_model, edit, message):
    base, _ = load_model_and_tokenizer(tiny_model)
    peft_model, _ = adapted(tiny_model, seed=1)
    adapter = lora.adapter_for_engine(peft_model)
    edit(adapter)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with LocalEngine(base) as engine, pytest.raises((KeyError, ValueError), match=message):
        engine.update_adapter(adapter, 2.0, 1)
    assert engine.version == 0 and all(torch.equal(base.state_dict()[k], v) for k, v in before.items())


def test_a_bfloat16_engine_merges_in_float32_and_rounds_once(tiny_model):
    base, _ = load_model_and_tokenizer(tiny_model, "bfloat16")
    peft_model, _ = adapted(tiny_model, seed=1)
    adapter = lora.adapter_for_engine(peft_model, torch.bfloat16)
    merged = AdapterMerge(base).merged(adapter, 2.0)
    key = "model.layers.0.mlp.down_proj.weight"
    w = base.state_dict()[key].float()
    a, b = (adapter[f"model.layers.0.mlp.down_proj.{p}"].float() for p in ("lora_A", "lora_B"))
    assert merged[key].dtype == torch.bfloat16
    assert torch.equal(merged[key], (w + 2.0 * b @ a).to(torch.bfloat16))
