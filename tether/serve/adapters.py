"""LoRA adapters in ``tether serve``: the training push (``/update_lora_adapter_from_tensor``) and the adapters users
load by name (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

An adapter is ``{"<layer>.lora_A": A [r, in], "<layer>.lora_B": B [out, r]}`` by the served model's own layer names
and a scaling s; an engine serves it as W = W_base + s · B @ A merged into its weights (``tether.engine.lora``).

**Training push.** A LoRA run with ``engine.type: remote`` sends only A and B (``RemoteEngine.update_adapter``): the
served model becomes the base plus that adapter as the given weight version, as ``/update_weights_from_tensor`` does
for whole weights. The base is the served weights as they were before the first adapter arrived.

**User-facing adapters.** ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` reads a folder in peft's format
(``adapter_config.json`` + ``adapter_model.safetensors``, e.g. a LoRA run's ``checkpoints/step_N``); a request whose
``model`` is ``lora_name`` is then generated with it, while the served model's own name keeps serving the base.
Departure from vLLM, which batches requests of several adapters over one copy of the base with per-request low-rank
kernels: here each loaded adapter is served by an engine of its own over a **copy of the served weights** with the
adapter merged in (one matmul per projection, the engine's fast path unchanged). Memory: one more copy of the model
per loaded adapter (plus its KV cache), so ``max_loras`` (vLLM's ``--max-loras``, default 4) bounds how many are
loaded at once, and an adapter's engine is closed when it is unloaded (its in-flight requests end with
``finish_reason: abort``). The copy is of the weights served when the adapter is loaded: a later weight update of the
base does not reach a loaded adapter (unload and load it again).

Supported peft adapters: LoRA on linear layers (``r``, ``lora_alpha``, ``use_rslora``). Refused with a 400 naming
the field: DoRA, per-layer ``rank_pattern`` / ``alpha_pattern``, ``modules_to_save``, embedding targets, LoRA
biases, ``fan_in_fan_out``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tether.serve.generation import APIError, Generator

_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<layer>.+)\.(?P<part>lora_A|lora_B)\.weight$")


@dataclass
class PeftAdapter:
    """A peft LoRA folder read for an engine: A and B by the served model's layer names, s = alpha / r."""

    adapter: dict[str, torch.Tensor]
    scaling: float
    rank: int


def engine_key(peft_key: str) -> str | None:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` → ``model.layers.0.self_attn.q_proj.lora_A``
    (None for a key that is not a linear layer's A or B)."""
    m = _PEFT_KEY.match(peft_key)
    return None if m is None else f"{m['layer']}.{m['part']}"


def read_peft_folder(path: str) -> PeftAdapter:
    """The adapter saved in ``path`` by peft (``save_pretrained``); APIError 400 (``param="lora_path"``) naming what
    is missing or not supported."""

    def bad(message: str) -> APIError:
        return APIError(400, f"lora_path {path!r}: {message}", param="lora_path")

    folder = Path(path)
    if not folder.is_dir():
        raise bad("is not a folder on the server")
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise bad("has no adapter_config.json: not an adapter saved by peft (a LoRA checkpoint holds "
                  "adapter_config.json and adapter_model.safetensors)")
    if not weights_file.is_file():
        pickled = " (it holds adapter_model.bin: save it with safe_serialization=True)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise bad(f"has no adapter_model.safetensors{pickled}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise bad(f"adapter_config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise bad(f"adapter_config.json is not a LoRA adapter's (peft_type {config.get('peft_type')!r})")
    for field, neutral in (("use_dora", False), ("rank_pattern", {}), ("alpha_pattern", {}),
                           ("modules_to_save", None), ("fan_in_fan_out", False), ("lora_bias", False)):
        if config.get(field) not in (neutral, None, [], {}, False):
            raise bad(f"adapter_config.json sets {field} = {config[field]!r}, which tether serve does not support "
                      f"(LoRA on linear layers with one rank and alpha)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise bad(f"adapter_config.json needs an integer r >= 1 and a number lora_alpha, got r={rank!r}, "
                  f"lora_alpha={alpha!r}")
    try:
        saved = load_file(str(weights_file))
    except Exception as e:  # noqa: BLE001 — SafetensorError, OSError: the file is unusable either way
        raise bad(f"adapter_model.safetensors is not a readable safetensors file ({e})") from None
    adapter, other = {}, []
    for key, value in saved.items():
        name = engine_key(key)
        if name is None:
            other.append(key)
        else:
            adapter[name] = value
    if other:
        raise bad(f"{len(other)} tensors are not LoRA A/B weights of linear layers, e.g. {other[:3]} (embedding "
                  f"targets, biases and modules_to_save are not supported)")
    if not adapter:
        raise bad("adapter_model.safetensors holds no tensors")
    wrong = [f"{k} {tuple(v.shape)}" for k, v in adapter.items()
             if v.dim() != 2 or (v.shape[0] if k.endswith("lora_A") else v.shape[1]) != rank]
    if wrong:
        raise bad(f"{len(wrong)} tensors do not have the rank r={rank} of adapter_config.json, e.g. {wrong[:3]}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a str is a regex over module names: the layers themselves are checked later
        layers = {k.rsplit(".", 1)[0] for k in adapter}
        missing = sorted(t for t in targets if not any(n == t or n.endswith(f".{t}") for n in layers))
        if missing:
            raise bad(f"target_modules {missing} of adapter_config.json have no weights in adapter_model.safetensors")
    return PeftAdapter(adapter, float(scaling), rank)


def check_adapter(model: Any, adapter: dict[str, torch.Tensor], *, param: str | None = None) -> None:
    """400 naming the layers of ``adapter`` that the served model lacks or whose A / B shapes do not make the
    layer's weight (``B @ A`` must be [out, in]): an adapter of another model, or of another size."""
    if not adapter:
        raise APIError(400, "the adapter holds no tensors", param=param)
    bad_keys = [k for k in adapter if not k.endswith((".lora_A", ".lora_B"))]
    if bad_keys:
        raise APIError(400, f"adapter keys must end in .lora_A or .lora_B, got {bad_keys[:3]}", param=param)
    layers = sorted({k.rsplit(".", 1)[0] for k in adapter})
    half = [n for n in layers if f"{n}.lora_A" not in adapter or f"{n}.lora_B" not in adapter]
    if half:
        raise APIError(400, f"adapter layers without both lora_A and lora_B: {half[:3]}", param=param)
    if model is None:
        raise APIError(400, "this server's engine has no model to apply an adapter to", param=param)
    params = dict(model.named_parameters())
    unknown = [n for n in layers if f"{n}.weight" not in params or params[f"{n}.weight"].dim() != 2]
    if unknown:
        raise APIError(400, f"{len(unknown)} adapter layers are not linear layers of the served model, e.g. "
                            f"{unknown[:3]}: an adapter of another architecture?", param=param)
    wrong = []
    for n in layers:
        a, b, w = adapter[f"{n}.lora_A"], adapter[f"{n}.lora_B"], params[f"{n}.weight"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            wrong.append(f"{n}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} vs weight {tuple(w.shape)}")
    if wrong:
        raise APIError(400, f"{len(wrong)} adapter layers do not fit the served model's shapes, e.g. {wrong[:2]}: an "
                            f"adapter of a model of another size?", param=param)


@dataclass
class Loaded:
    """A user-facing adapter: its name, folder and the generator over its own engine."""

    name: str
    path: str
    gen: Generator
    created: int


class Adapters:
    """The adapters a server has loaded by name (at most ``max_loras``).

    base: the served model's generator (its engine's version and weights, its model lock);
    make_engine: a new engine over a copy of the served model's current weights (called under the base's lock);
    make_generator: a generator over an engine (the served model's parser and stop ids).
    """

    def __init__(self, base: Generator, base_name: str, make_engine: Callable[[], Any] | None,
                 make_generator: Callable[[Any], Generator], max_loras: int):
        if max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {max_loras}")
        self.base, self.base_name, self.max_loras = base, base_name, max_loras
        self._make_engine, self._make_generator = make_engine, make_generator
        self._loaded: dict[str, Loaded] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time

    def get(self, name: str) -> Loaded | None:
        return self._loaded.get(name)

    def all(self) -> list[Loaded]:
        return list(self._loaded.values())

    async def load(self, name: str, path: str, *, replace: bool = False) -> Loaded:
        """Read ``path`` and serve it as ``name``; with ``replace`` an adapter already loaded as ``name`` is
        swapped for it (vLLM's ``load_inplace``)."""
        async with self._lock:
            if name == self.base_name:
                raise APIError(400, f"lora_name {name!r} is the served model's own name; choose another",
                               param="lora_name")
            if name in self._loaded and not replace:
                raise APIError(400, f"the LoRA adapter {name!r} is already loaded (from {self._loaded[name].path}); "
                                    f"unload it first or send load_inplace: true", param="lora_name")
            if self._make_engine is None:
                raise APIError(400, "this server cannot load adapters: its engine has no model to copy",
                               param="lora_path")
            if name not in self._loaded and len(self._loaded) >= self.max_loras:
                raise APIError(400, f"{len(self._loaded)} LoRA adapters are loaded, the most this server holds "
                                    f"(--max-loras {self.max_loras}; each is a copy of the model): unload one of "
                                    f"{sorted(self._loaded)} first", param="lora_name")
            peft = await asyncio.to_thread(read_peft_folder, path)
            check_adapter(self.base.model, peft.adapter, param="lora_path")
            engine = await asyncio.to_thread(self._start, peft)
            loaded = Loaded(name, path, self._make_generator(engine), int(time.time()))
            old = self._loaded.get(name)
            self._loaded[name] = loaded
        if old is not None:
            await asyncio.to_thread(old.gen.engine.close)
        return loaded

    def _start(self, peft: PeftAdapter) -> Any:
        assert self._make_engine is not None
        with self.base.model_lock:  # no weight update of the base while it is copied
            engine = self._make_engine()
        try:
            engine.update_adapter(peft.adapter, peft.scaling, self.base.engine.version)
        except BaseException:
            engine.close()
            raise
        return engine

    async def unload(self, name: str) -> None:
        async with self._lock:
            loaded = self._loaded.pop(name, None)
        if loaded is None:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded (loaded: {sorted(self._loaded)})",
                           param="lora_name", code="model_not_found")
        await asyncio.to_thread(loaded.gen.engine.close)

    def close(self) -> None:
        """Close every adapter's engine (the server is stopping)."""
        while self._loaded:
            _, loaded = self._loaded.popitem()
            loaded.gen.engine.close()


async def push(gen: Generator, adapter: dict[str, torch.Tensor], scaling: float, version: int) -> None:
    """The training push: the served engine serves its base plus ``adapter`` as ``version`` (returns once loaded)."""
    if not math.isfinite(scaling):
        raise APIError(400, f"scaling must be a finite number (alpha / rank), got {scaling}", param="scaling")
    update_adapter = getattr(gen.engine, "update_adapter", None)
    if update_adapter is None:
        raise APIError(400, f"this server's engine ({type(gen.engine).__name__}) does not take adapters")
    check_adapter(gen.model, adapter)

    def update() -> None:
        with gen.model_lock:
            update_adapter(adapter, scaling, version)

    try:
        await asyncio.to_thread(update)
    except (KeyError, ValueError) as e:  # the engine refused the adapter
        raise APIError(400, f"the engine refused the adapter: {e}") from None
