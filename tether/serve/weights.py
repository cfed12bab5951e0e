"""Weight updates of the served engine: safetensors from a Hugging Face folder, or from a request body.

The new tensors go to ``engine.update_weights(state_dict, version)``, which swaps them in at the engine's next
step boundary (with partial rollout, in-flight generations resume under them and their later tokens carry the
new version). Names and shapes are checked against the served model first, so a wrong checkpoint is answered 400
naming the tensors instead of failing inside the engine. Updates are serialised with ``top_logprobs`` forward
passes (``Generator.model_lock``), which read the same module.

Paths a caller names (``/update_weights_from_disk``'s ``model_path``, ``/v1/load_lora_adapter``'s ``lora_path``) must
lie under the server's weights root (``tether serve --weights-root``), symlinks resolved; one outside it is refused
before anything is looked up there, with the same answer whether it exists or not.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, load_file, save

from tether.serve.generation import APIError, Generator


def under_root(path: str, root: Path | None, param: str) -> str:
    """``path`` resolved, when it lies under ``root`` (itself resolved); 403 otherwise, naming neither what exists
    there nor what does not."""
    if root is None:
        raise APIError(403, f"{param}: this server loads no weights from its disk (start it with --weights-root "
                            f"FOLDER to allow folders under FOLDER)", param=param, code="path_not_allowed",
                       type="permission_error")
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_relative_to(root):
        raise APIError(403, f"{param} {path!r} is not under this server's weights root {str(root)!r} "
                            f"(tether serve --weights-root)", param=param, code="path_not_allowed",
                       type="permission_error")
    return str(resolved)


async def read_folder(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path`` (one file or the shards of an indexed checkpoint)."""
    folder = Path(path)
    if not folder.is_dir():
        raise APIError(400, f"model_path {path!r} is not a folder on the server", param="model_path")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise APIError(400, f"model_path {path!r} holds no *.safetensors file", param="model_path")
    return await asyncio.to_thread(_load_files, files)


def _load_files(files: list[Path]) -> dict[str, torch.Tensor]:

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 — SafetensorError, OSError: the file is unusable either way
            raise APIError(400, f"{f} is not a readable safetensors file ({e})", param="model_path") from None
    return state


def state_bytes(state_dict: dict[str, torch.Tensor]) -> bytes:
    """The body of ``/update_weights_from_tensor`` for ``state_dict``: safetensors bytes of CPU copies, a tensor
    that shares its storage with an earlier one (tied embeddings) sent once under the first name."""

    seen: set[tuple[int, int]] = set()
    kept = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen:
            continue
        seen.add(key)
        kept[name] = t.detach().to("cpu").contiguous()
    return save(kept)


def read_bytes(body: bytes) -> dict[str, torch.Tensor]:
    """The state dict serialised by ``safetensors.torch.save(state_dict)``."""

    if not body:
        raise APIError(400, "the request body is empty; send the bytes of safetensors.torch.save(state_dict)")
    try:
        return load(body)
    except Exception as e:  # noqa: BLE001 — any parse failure means "not safetensors bytes"
        raise APIError(400, f"the request body is not safetensors bytes ({e})") from None


def check_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """400 naming the first tensors whose names are not the model's or whose shapes differ from it."""
    if not state:
        raise APIError(400, "no tensors to load")
    if model is None:
        return
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise APIError(400, f"{len(unknown)} tensors are not in the served model, e.g. {unknown[:3]}: is this a "
                            f"checkpoint of the same architecture?")
    wrong = [f"{k} {tuple(v.shape)} (served {tuple(own[k].shape)})" for k, v in state.items()
             if v.shape != own[k].shape]
    if wrong:
        raise APIError(400, f"{len(wrong)} tensors have other shapes than the served model's, e.g. {wrong[:3]}")


async def apply(gen: Generator, state: dict[str, torch.Tensor], version: int) -> None:
    """Check ``state`` and swap it into the engine as ``version`` (returns once the engine has loaded it)."""
    check_state(gen.model, state)

    def update() -> None:
        with gen.model_lock:
            gen.engine.update_weights(state, version)

    try:
        await asyncio.to_thread(update)
    except (KeyError, ValueError) as e:  # the engine refused the tensors
        raise APIError(400, f"the engine refused the weights: {e}") from None
