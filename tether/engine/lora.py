"""A LoRA adapter applied to an engine's weights: W = W_base + s · B @ A, merged into the weights the engine runs.

An adapter arrives as ``{"<layer>.lora_A": A [r, in], "<layer>.lora_B": B [out, r], ...}`` keyed by the base model's
own layer names (``tether.learner.lora.adapter_for_engine``) with the scaling s = alpha / rank. ``AdapterMerge``
keeps a copy of the base weights of the layers an adapter touches (taken the first time, before any adapter is
merged; weights loaded as they are, a full weight sync, replace it: ``forget``) and forms each merged weight from
that copy, so adapter after adapter never accumulates rounding, and ``base()`` gives the base weights back
(unloading an adapter).

Merged, not unmerged: the engine's fast path runs one matmul per projection (q, k, v fused; gate, up fused); an
unmerged adapter adds two low-rank matmuls per projection to every decode step, while merging costs one
[out, r] @ [r, in] product per layer once per sync. ``benchmarks/lora_merge.py`` measures both at the demo's shapes
and a 4× wider model's.
"""

from __future__ import annotations

from typing import Any

import torch


def layers_of(adapter: dict[str, torch.Tensor]) -> list[str]:
    """The layer names of an adapter's keys, each with both its A and its B (a half pair is an error)."""
    names = {key.rsplit(".", 1)[0] for key in adapter}
    bad = [key for key in adapter if not key.endswith((".lora_A", ".lora_B"))]
    if bad:
        raise KeyError(f"adapter keys must end in .lora_A or .lora_B, got {bad[:3]}")
    half = sorted(n for n in names if f"{n}.lora_A" not in adapter or f"{n}.lora_B" not in adapter)
    if half:
        raise KeyError(f"adapter layers without both lora_A and lora_B: {half[:3]}")
    return sorted(names)


class AdapterMerge:
    """The base weights an adapter replaces, and the merged weights of an adapter (``merged``)."""

    def __init__(self, model: Any):
        self._model = model
        self._base: dict[str, torch.Tensor] = {}  # "<layer>.weight" -> a copy of the base weight

    def merged(self, adapter: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
        """``{"<layer>.weight": W_base + scaling · B @ A}`` for every layer of ``adapter``, computed in float32 and cast
        to the base weight's dtype (a bfloat16 engine rounds once, as it does a full weight sync), plus the base
        weights of layers an earlier adapter touched and this one does not (so they return to the base)."""
        params = dict(self._model.named_parameters())
        out = {}
        for name in layers_of(adapter):
            key = f"{name}.weight"
            if key not in params and key not in self._base:
                raise KeyError(f"adapter layer {name!r} is not a layer of the engine's model")
            base = self._base.get(key)
            if base is None:
                base = self._base[key] = params[key].detach().clone()
            a, b = adapter[f"{name}.lora_A"], adapter[f"{name}.lora_B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != base.shape:
                raise ValueError(f"adapter layer {name!r}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} does "
                                 f"not make the weight's {tuple(base.shape)}")
            delta = b.to(base.device, torch.float32) @ a.to(base.device, torch.float32)
            out[key] = (base.float() + scaling * delta).to(base.dtype)
        for key, base in self._base.items():
            out.setdefault(key, base)
        return out

    def forget(self, weights: dict[str, Any]) -> None:
        """``weights`` were loaded as they are (a full weight sync): they are the base of the next adapter."""
        for key in weights:
            self._base.pop(key, None)

    def base(self) -> dict[str, torch.Tensor]:
        """The base weights of every layer an adapter has touched (empty before the first adapter)."""
        return dict(self._base)
