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

With ``model.lora`` the model's files are the adapter in peft's format instead (``adapter_config.json``, naming the
base's folder, and ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, step_N)`` loads it), megabytes
instead of the whole weights; no ``config.json``, so that ``from_pretrained(step_N)`` is not mistaken for a whole
model. A LoRA learner sharded over several ranks writes the same folder: the adapter and its AdamW state gathered whole
(the moments keyed by parameter name; no ``shards/``, the base is never gathered), so it resumes into one plain
learner or any number of ranks. ``tether eval`` and ``serve`` load such a folder as its base with the adapter merged in
(``tether.learner.model.load_model_and_tokenizer``); ``tether export CKPT --merge`` writes the merged weights.

A learner sharded over several ranks (``tether.learner.group``) saves with ``save_sharded_checkpoint``, every rank at
once: its weights and AdamW state as ``torch.distributed.checkpoint`` shards in ``shards/`` (each rank writes its own
file; no rank gathers the optimizer state), plus the same consolidated HF weights and ``trainer_state.pt`` (the
optimizer's schedule and counters; its moments are in the shards). ``load_checkpoint`` reads the shards when a
checkpoint has them, into any layout — M ranks (DCP reshards), one FSDP rank or a plain model in one process — so a
run saved with N ranks resumes with M; a checkpoint without shards loads as before, into any layout too.

A corrupt checkpoint (a truncated ``trainer_state.pt`` or ``*.safetensors``: a disk fault or a partial copy, never
an interrupted save, which the rename above rules out) is refused with ``CorruptCheckpoint``, one line that names
the complete checkpoint before it and how to resume from that one (move the corrupt folder aside). Refused rather
than skipped: falling back by itself would silently retrain the steps in between and drop their metrics rows,
on damage that someone should look at. ``resumable_checkpoint`` checks the files' structure (safetensors headers
and sizes, the zip directory of ``trainer_state.pt``), which costs no read of the data; damage inside the data
that still parses is found by ``load_checkpoint``, which says the same.
"""

from __future__ import annotations

import errno
import io
import os
import random
import re
import shutil
import uuid
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tether.learner import fsdp
from tether.learner.learner import Learner

STATE_FILE = "trainer_state.pt"
SHARDS_DIR = "shards"  # torch.distributed.checkpoint's files: the weights and the AdamW state, one file per rank
_FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d+)")
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


class CorruptCheckpoint(ValueError):
    """A checkpoint folder whose files cannot be read; the message names the complete one before it."""


def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """``run_dir/checkpoints/step_<step>``."""
    return Path(run_dir, "checkpoints", f"step_{step}")


def temp_dir(path: str | os.PathLike) -> Path:
    """Where the checkpoint ``path`` is written before it is renamed into place (no step_N name: never taken for
    one; ``Run.build`` removes those an interruption left)."""
    path = Path(path)
    return path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"


def save_checkpoint(path: str | os.PathLike, learner: Learner, tokenizer: Any,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write a complete checkpoint folder at ``path`` atomically (replacing one already there); returns it."""
    path, tmp = Path(path), temp_dir(path)
    extra = dict(extra or {})
    _check_plain(extra, "extra")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    write = _model_writer(learner)
    return _finish_save(path, tmp, write, learner, fsdp.optimizer_state(learner), tokenizer, extra)


def save_sharded_checkpoint(path: str | os.PathLike, tmp: str | os.PathLike, learner: Learner, tokenizer: Any,
                            extra: dict[str, Any] | None = None) -> Path | None:
    """Every rank of a sharded learner at once (collectives): each writes its shards of the weights and AdamW state
    into ``tmp/shards``, then rank 0 the consolidated weights, tokenizer and trainer state, and renames ``tmp`` to
    ``path``; returns ``path`` on rank 0 (None on the others). ``tmp``: ``temp_dir(path)``, the same on every rank.

    ``model.lora``: no shards. The adapter and its AdamW state are gathered whole (megabytes: every rank takes part,
    rank 0 keeps them) and written as one rank writes them (peft's format, the moments keyed by parameter name), so
    any number of ranks, or a plain learner, resumes it; the frozen base is never gathered."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 — only sharded learners save this way

    path, tmp, lead = Path(path), Path(tmp), learner.ranks.rank == 0
    extra = dict(extra or {})
    _check_plain(extra, "extra")
    if learner.lora_scaling is not None:
        write = _model_writer(learner)  # gathers the adapter
        optimizer_state = fsdp.optimizer_state(learner)  # gathers its AdamW state
        if not lead:
            return None
        tmp.mkdir(parents=True, exist_ok=True)
        return _finish_save(path, tmp, write, learner, optimizer_state, tokenizer, extra)
    (tmp / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    try:
        dcp.save(_dcp_state(learner), checkpoint_id=tmp / SHARDS_DIR)  # ends when every rank has written
        if not lead:
            fsdp.full_state_dict(learner.model)  # fsdp.unsharded's gathers, which rank 0 runs below
            return None
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    optimizer = {**learner.optimizer.state_dict(), "optimizer": None}  # the moments are in the shards
    return _finish_save(path, tmp, _model_writer(learner), learner, optimizer, tokenizer, extra)


def _model_writer(learner: Learner) -> Callable[[Path], None]:
    """What writes the model's files into a folder: ``save_pretrained`` of the whole weights (gathered when the writer
    runs), or with ``model.lora`` the adapter in peft's format (gathered now: every rank calls this)."""
    model = learner.model
    if learner.lora_scaling is None:
        return lambda folder: fsdp.unsharded(model).save_pretrained(folder)
    from tether.learner import lora  # noqa: PLC0415 — peft, with model.lora only

    weights = lora.adapter_state_dict(model)
    return lambda folder: lora.save_adapter(model, folder, weights)


def _dcp_state(learner: Learner) -> dict[str, Any]:
    """The learner's weights and AdamW state keyed by parameter name, as ``torch.distributed.checkpoint`` saves and
    loads them (this rank's shards of a sharded model; everything for a plain one)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415 — as above

    model, optim = get_state_dict(learner.model, learner.optimizer.optimizer)
    return {"model": model, "optim": optim}


def _finish_save(path: Path, tmp: Path, write_model: Callable[[Path], None], learner: Learner,
                 optimizer: dict[str, Any], tokenizer: Any, extra: dict[str, Any]) -> Path:
    """Write the consolidated weights (``write_model(tmp)``), tokenizer and trainer state into ``tmp`` and rename it to
    ``path``; a failure removes ``tmp`` (a full disk is said as one)."""
    try:
        write_model(tmp)  # FSDP2: the whole weights; model.lora: the adapter (peft's format)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        state = {
            "format": _FORMAT,
            "version": learner.version,
            "kl_coef": float(learner.kl_coef),
            "kl_guard_stops": int(learner.kl_guard_stops),  # cumulative counters continue across a resume
            "optimizer": optimizer,
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
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:  # torch's words for a torn file
        raise CorruptCheckpoint(_corrupt(path, f"{path / STATE_FILE} cannot be read ({_first_line(e)})")) from e
    if state.get("format") != _FORMAT:
        raise ValueError(f"{path / STATE_FILE} has format {state.get('format')!r}; this tether reads {_FORMAT}")
    if (path / SHARDS_DIR).is_dir():  # saved by several ranks: the weights and moments from the shards, resharded
        _load_shards(learner, path / SHARDS_DIR)
        learner.optimizer.load_state_dict({**state["optimizer"], "optimizer": learner.optimizer.optimizer.state_dict()})
    elif learner.lora_scaling is not None:  # model.lora: the adapter; the base is the model the learner was built on
        from tether.learner import lora  # noqa: PLC0415 — peft, with model.lora only

        if not (path / "adapter_model.safetensors").is_file():
            raise ValueError(f"{path} holds whole weights, not an adapter: it was saved by a run without model.lora")
        lora.load_adapter_weights(learner.model, path)
        fsdp.load_optimizer_state(learner, state["optimizer"])
    else:
        if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            raise ValueError(f"{path} holds a LoRA adapter: resume it with model.lora set as in its run")
        _load_weights(learner.model, path)
        fsdp.load_optimizer_state(learner, state["optimizer"])
    learner.version = int(state["version"])
    learner.kl_coef = float(state["kl_coef"])
    learner.kl_guard_stops = int(state.get("kl_guard_stops", 0))
    _set_rng_state(state["rng"])
    return state["extra"]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete ``run_dir/checkpoints/step_N`` with the largest N, or None."""
    found = _complete(Path(run_dir, "checkpoints"))
    return found[-1] if found else None


def resumable_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """``latest_checkpoint`` with its files checked: raises ``CorruptCheckpoint`` (one line naming the complete
    checkpoint before it, and how to resume from it) when they cannot be read."""
    latest = latest_checkpoint(run_dir)
    problem = checkpoint_problem(latest) if latest is not None else None
    if latest is not None and problem is not None:
        raise CorruptCheckpoint(_corrupt(latest, problem))
    return latest


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the files of checkpoint ``path`` cannot be read (a torn or truncated ``*.safetensors`` or
    ``trainer_state.pt``), or None. The structure only: headers, sizes, the zip directory — no read of the data."""
    path = Path(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        return f"{path} has no *.safetensors weights"
    for f in weights:
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 — SafetensorError, OSError: all mean "this file is unusable"
            return f"{f} is not a readable safetensors file ({_first_line(e)})"
    try:
        with zipfile.ZipFile(path / STATE_FILE):  # torch.save writes a zip; a cut one has lost its directory
            pass
    except (zipfile.BadZipFile, OSError) as e:
        return f"{path / STATE_FILE} is not a readable torch file ({_first_line(e)})"
    return None


# ---------------------------------------------------------------------------------------------- pieces


def _complete(root: Path) -> list[Path]:
    """The ``step_N`` folders under ``root`` that a finished save made, by N."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.fullmatch(d.name)
        model = (d / "config.json").is_file() or (d / "adapter_config.json").is_file()  # whole weights or an adapter
        if m and (d / STATE_FILE).is_file() and model:
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def _corrupt(path: Path, problem: str) -> str:
    """The one line that refuses corrupt checkpoint ``path``: what is wrong, the complete one before it (its
    files checked as ``resumable_checkpoint`` checks them), and how to resume from that one."""
    step = _STEP_DIR.fullmatch(path.name)
    if step is None:  # not a run's checkpoints/step_N folder: nothing to fall back to
        return f"checkpoint {path} is corrupt: {problem}"
    earlier = [d for d in _complete(path.parent)
               if int(d.name[len("step_"):]) < int(step.group(1)) and checkpoint_problem(d) is None]
    aside = path.parent / f"corrupt-{path.name}"
    if earlier:
        then = f"the complete checkpoint before it is {earlier[-1]}: to resume from it, move the corrupt one aside " \
               f"(mv {path} {aside}) and --resume again (the steps after {earlier[-1].name} are trained again)"
    else:
        then = f"there is no complete checkpoint before it: move it aside (mv {path} {aside}) and --resume starts " \
               "the run again from step 0"
    return f"checkpoint {path} is corrupt: {problem}; {then}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and removed after."""
    old = None
    if dst.exists():
        old = dst.parent / f".old-{dst.name}-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _load_shards(learner: Learner, folder: Path) -> None:
    """``save_sharded_checkpoint``'s shards into ``learner`` (any ranks, any layout; without a process group DCP
    reads them in this process alone)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 — as in save_sharded_checkpoint
    from torch.distributed.checkpoint.state_dict import set_state_dict  # noqa: PLC0415

    state = _dcp_state(learner)
    try:
        with warnings.catch_warnings():  # one process reading every shard is what it is asked to do
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=folder)
    except Exception as e:  # noqa: BLE001 — CheckpointException, OSError, pickle errors: the shards are unusable
        raise CorruptCheckpoint(_corrupt(folder.parent, f"{folder} cannot be read ({_first_line(e)})")) from e
    set_state_dict(learner.model, learner.optimizer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(f))
        except Exception as e:  # noqa: BLE001 — SafetensorError, OSError: all mean "this file is unusable"
            raise CorruptCheckpoint(_corrupt(path, f"{f} cannot be read ({_first_line(e)})")) from e
    if fsdp.is_sharded(model):  # each rank keeps its shards of the whole weights
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
