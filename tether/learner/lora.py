"""The policy as a frozen base plus a low-rank adapter (``model.lora``), through peft.

Each target linear layer W [out, in] computes x W^T + s · (x A^T) B^T with A [r, in], B [out, r] and the scaling
s = alpha / r; peft initialises B to zero, so the wrapped model starts as the base. Only A and B require gradients
(``wrap``), so ``PolicyOptimizer`` (which keeps the parameters that do) holds AdamW moments for the adapter alone.

What leaves the learner is keyed by the base model's own module names (peft's ``base_model.model.`` prefix and its
``.default`` adapter name removed), so that a consumer that knows nothing of peft can use it:

    adapter_for_engine(model)  {"model.layers.0.self_attn.q_proj.lora_A": A [r, in],
                                "model.layers.0.self_attn.q_proj.lora_B": B [out, r], ...}; with ``scaling(model)``
                               the engine forms W = W_base + s · B @ A for ``<name>.weight``
    merged_state_dict(model)   the base's state dict with every adapter merged in (the full-weights paths)

The KL reference is the same model with the adapter switched off (``reference``): no second copy of the weights.

Sharded (``actor_worker.strategy: fsdp2``, ``tether.learner.fsdp.sharded_learner``): the model is wrapped first, then
``fully_shard`` shards the base model's decoder layers and root with the adapter inside them (FSDP2 holds frozen and
trainable parameters in one unit; only the adapter's gradients are reduced). Every function here that reads weights
gathers the whole tensors first (``full_tensor``: a collective, so every rank calls it, in the same order), and
``adapter_state_dict`` gathers the adapter alone, in peft's names, for a checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer

from tether.config.sections import LoraConfig
from tether.learner.ranks import full_tensor

ADAPTER = "default"  # peft's name of the one adapter
_PREFIX = "base_model.model."  # what peft puts before the base model's parameter names


def wrap(model: Any, lora: LoraConfig) -> PeftModel:
    """``model`` (modified in place: its target layers become peft's LoRA layers) as a PeftModel whose base is frozen
    and whose adapter (A random, B zero) is the only thing that requires gradients."""
    alpha: Any = lora.alpha  # peft types it int; a float works (s = alpha / r is a float division)
    config = PeftLoraConfig(r=lora.rank, lora_alpha=alpha, lora_dropout=lora.dropout,
                            target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # peft's "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules {list(lora.target_modules)}: {e}") from None


def scaling(model: Any) -> float:
    """s = alpha / rank, the factor of B @ A (one value: every layer has the config's rank and alpha)."""
    config = model.peft_config[ADAPTER]
    return float(config.lora_alpha) / float(config.r)


def _layers(model: Any) -> Iterator[tuple[str, Any]]:
    """(the base model's name of the layer, e.g. ``model.layers.0.self_attn.q_proj``; the LoRA layer)."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name.removeprefix(_PREFIX), module


def adapter_for_engine(model: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Detached copies of every A [r, in] and B [out, r], keyed ``<layer>.lora_A`` / ``<layer>.lora_B`` by the base
    model's layer names, in ``dtype`` (None: the master weights'): what a weight sync sends instead of the model."""
    out = {}
    for name, layer in _layers(model):
        for part, weights in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
            w = full_tensor(weights[ADAPTER].weight.detach())  # sharded: gathered (every rank, the same order)
            out[f"{name}.{part}"] = w.to(dtype, copy=True) if dtype is not None else w.clone()
    return out


def merged_state_dict(model: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own names) with W + s · B @ A in place of every adapted W, computed in
    float32 then cast to ``dtype``: what the paths that move whole weights (an evaluation engine of the trainer's own,
    ``backend: ray``'s buckets) send. A copy: training goes on without changing it. Sharded: gathered first (every
    rank calls it)."""
    s = scaling(model)
    state = {k: full_tensor(v.detach()) for k, v in model.state_dict().items()}
    deltas = {}
    for name, _ in _layers(model):
        peft_name = _PREFIX + name
        b, a = (state[f"{peft_name}.lora_{part}.{ADAPTER}.weight"].float() for part in ("B", "A"))
        deltas[f"{name}.weight"] = (b @ a) * s
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(_PREFIX).replace(".base_layer.", ".")
        v = value
        if name in deltas:
            v = v.float() + deltas[name]  # a new tensor
        to = dtype if dtype is not None and v.is_floating_point() else value.dtype
        out[name] = v.to(to, copy=True)
    return out


def adapter_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's whole tensors under the model's own (peft) state-dict names, on the CPU: what ``save_adapter``
    writes. Sharded: gathered (every rank calls it); the base is not gathered."""
    return {k: full_tensor(v.detach()).cpu() for k, v in model.state_dict().items() if ".lora_" in k}


def save_adapter(model: Any, folder: str | Path, weights: dict[str, torch.Tensor]) -> None:
    """``weights`` (``adapter_state_dict``) in peft's format into ``folder``: ``adapter_config.json`` naming the base
    and ``adapter_model.safetensors`` (``PeftModel.from_pretrained(base, folder)`` loads it)."""
    model.save_pretrained(str(folder), state_dict=weights)


@contextlib.contextmanager
def reference(model: Any) -> Iterator[Any]:
    """The base policy for the KL term: ``model`` itself with its adapter switched off for the block (the same
    forward without the s · B A terms, so exactly the base model's logits), in eval mode as a frozen copy would be."""
    was_training = model.training
    model.eval()  # as a frozen reference computes: no dropout
    try:
        with model.disable_adapter():
            yield model
    finally:
        model.train(was_training)


def merged_copy(model: Any) -> Any:
    """A plain model (the base's class) with the adapter merged into a copy of its weights: ``tether export --merge``
    and what needs the trained policy as an ordinary model. Sharded: built from the gathered ``merged_state_dict``
    (every rank calls it; ``fsdp.unsharded``'s plain copy)."""
    from tether.learner import fsdp  # noqa: PLC0415 — fsdp imports the learner, which imports this module lazily

    base = model.get_base_model()
    if fsdp.is_sharded(base):
        return fsdp.unsharded(base, merged_state_dict(model))
    return copy.deepcopy(model).merge_and_unload()


# ---------------------------------------------------------------------------------------------- on disk


def is_adapter_folder(folder: str | Path) -> bool:
    """A folder holding an adapter in peft's format and no whole model of its own (a LoRA checkpoint)."""
    folder = Path(folder)
    return (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()


def base_of(folder: str | Path) -> str:
    """The base model's folder an adapter was trained on (``adapter_config.json``'s ``base_model_name_or_path``)."""
    return str(json.loads(Path(folder, "adapter_config.json").read_text())["base_model_name_or_path"])


def load_adapter_weights(model: Any, folder: str | Path) -> None:
    """The adapter saved in ``folder`` into ``model``'s (same targets and rank; a mismatch is an error). Sharded: each
    rank reads the whole file and keeps its shards."""
    from safetensors.torch import load_file  # noqa: PLC0415 — only on resume

    from tether.learner import fsdp  # noqa: PLC0415 — as in merged_copy

    weights = load_file(str(Path(folder, "adapter_model.safetensors")))
    ours = {k.replace(f".{ADAPTER}.", "."): k for k in model.state_dict() if ".lora_" in k}  # saved name → ours
    missing, unexpected = sorted(set(ours) - set(weights)), sorted(set(weights) - set(ours))
    if unexpected or missing:
        raise ValueError(f"{folder}: the adapter does not match the model.lora of this run (missing {missing}, "
                         f"unexpected {unexpected})")
    named = {ours[k]: v for k, v in weights.items()}
    if fsdp.is_sharded(model):
        fsdp.load_weights(model, named)
        return
    result = model.load_state_dict(named, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{folder}: unexpected adapter weights {result.unexpected_keys}")


def load_merged(folder: str | Path, dtype: torch.dtype) -> Any:
    """A LoRA checkpoint as a plain model: its base (``base_of``) with the adapter merged in, in ``dtype``, eval mode
    (``tether eval`` / ``serve`` / ``export --merge`` read checkpoints through this)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    base = AutoModelForCausalLM.from_pretrained(base_of(folder), dtype=torch.float32, local_files_only=True)
    merged = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()  # merged in float32, then cast
    for p in merged.parameters():  # parameters only: the rotary frequencies stay float32 (``model.cast_copy``)
        p.data = p.data.to(dtype)
    merged.config.dtype = dtype
    return merged.eval()
