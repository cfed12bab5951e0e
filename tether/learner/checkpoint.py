"""Checkpoints: a Hugging Face model folder that ``from_pretrained`` loads, plus the trainer state to resume.

Layout of ``run_dir/checkpoints/step_N/``: the model (``save_pretrained``: config, safetensors weights,
generation config), the tokenizer with its chat template, and ``trainer_state.pt`` — optimizer and schedule
state, the learner's version and KL coefficient, the torch/python/numpy RNG states and the caller's ``extra``
(e.g. the data cursor, so a resumed run trains no sample twice).

A save is written to a hidden temporary folder next to the target and renamed into place, so a folder named
``step_N`` is always complete and an interrupted save is never picked up by ``latest_checkpoint``.

``trainer_state.pt`` is read with ``torch.load(weights_only=True)`` (no arbitrary unpickling), so ``extra`` must
be plain data: dicts, lists, tuples, str, int, float, bool, None and tensors; anything else — a config
``Secret`` included — is refused when saving. The config dump is not written here: the caller writes the
redacted one (``RunConfig.to_yaml``).

The reference model is not saved: build the learner from the *initial* model, then ``load_checkpoint``.
"""

from __future__ import annotations

import errno
import io
import os
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from tether.learner import fsdp
from tether.learner.learner import Learner

STATE_FILE = "trainer_state.pt"
_FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d+)")
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """``run_dir/checkpoints/step_<step>``."""
    return Path(run_dir, "checkpoints", f"step_{step}")


def save_checkpoint(path: str | os.PathLike, learner: Learner, tokenizer: Any,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write a complete checkpoint folder at ``path`` atomically (replacing one already there); returns it."""
    path = Path(path)
    extra = dict(extra or {})
    _check_plain(extra, "extra")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"  # no step_N name: never taken for one
    tmp.mkdir()
    try:
        fsdp.unsharded(learner.model).save_pretrained(tmp)  # FSDP2: the whole weights
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        state = {
            "format": _FORMAT,
            "version": learner.version,
            "kl_coef": float(learner.kl_coef),
            "kl_guard_stops": int(learner.kl_guard_stops),  # cumulative counters continue across a resume
            "optimizer": fsdp.optimizer_state(learner),
            "rng": _rng_state(),
            "extra": extra,
        }
        buffer = io.BytesIO()  # serialised in memory, written by a plain file write: a full disk is an OSError
        torch.save(state, buffer)
        (tmp / STATE_FILE).write_bytes(buffer.getvalue())
        _replace_dir(tmp, path)
    except BaseException as e:
        full = not isinstance(e, OSError) and isinstance(e, Exception) and _disk_full(path.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            # libraries report a failed write in their own words (torch: "unexpected pos"); say what it was
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        raise
    return path


def _disk_full(folder: Path, margin: int = 1 << 20) -> bool:
    try:
        return shutil.disk_usage(folder).free < margin
    except OSError:
        return False


def load_checkpoint(path: str | os.PathLike, learner: Learner) -> dict[str, Any]:
    """Restore the policy weights, optimizer, schedule, version, KL coefficient and RNG states; returns ``extra``."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete tether checkpoint (no {STATE_FILE} in it)")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if state.get("format") != _FORMAT:
        raise ValueError(f"{path / STATE_FILE} has format {state.get('format')!r}; this tether reads {_FORMAT}")
    _load_weights(learner.model, path)
    fsdp.load_optimizer_state(learner, state["optimizer"])
    learner.version = int(state["version"])
    learner.kl_coef = float(state["kl_coef"])
    learner.kl_guard_stops = int(state.get("kl_guard_stops", 0))
    _set_rng_state(state["rng"])
    return state["extra"]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete ``run_dir/checkpoints/step_N`` with the largest N, or None."""
    root = Path(run_dir, "checkpoints")
    if not root.is_dir():
        return None
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.fullmatch(d.name)
        if m and (d / STATE_FILE).is_file() and (d / "config.json").is_file():
            found.append((int(m.group(1)), d))
    return max(found)[1] if found else None


# ---------------------------------------------------------------------------------------------- pieces


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and removed after."""
    old = None
    if dst.exists():
        old = dst.parent / f".old-{dst.name}-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    if isinstance(model, fsdp.FSDPModule):  # each rank keeps its shards of the whole weights
        return fsdp.load_weights(model, weights)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # save_pretrained leaves out a tied parameter (lm_head = embed_tokens); anything else missing is an error.
    loaded_storage = {t.data_ptr() for k, t in model.state_dict().items() if k in weights}
    untied = [k for k in missing if model.state_dict()[k].data_ptr() not in loaded_storage]
    if untied or unexpected:
        raise ValueError(f"{path}: weights do not match the model (missing {untied}, unexpected {unexpected})")


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # numpy's key array travels as a list of ints so that weights_only loading can read it.
        # numpy types get_state() as dict | tuple; the legacy form (the default) is the tuple.
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),  # type: ignore[index]
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_plain(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} must be a str or int")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(f"{where} is a {type(value).__name__}; checkpoints hold plain data only "
                        "(dict, list, tuple, str, int, float, bool, None, tensor) and never secrets")
