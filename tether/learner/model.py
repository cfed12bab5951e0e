"""Load any Hugging Face causal LM, or build the embedded ``tiny`` one.

``tiny`` is a randomly initialised Qwen2-architecture model with a BPE tokenizer trained on the given
corpus plus a built-in one, and a tool-capable ChatML template (see ``tiny.py``). It is saved in plain HF
format, so everything downstream runs the same code path as for a real checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.tokenization_utils_base import AddedToken

from tether.learner.tiny import CHAT_TEMPLATE, ENDOFTEXT, IM_END, builtin_corpus, train_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``model.dtype``'s value as a torch dtype (``"bfloat16"`` → ``torch.bfloat16``)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def cast_copy(model: Any, dtype: str | torch.dtype) -> Any:
    """A copy of ``model`` with its parameters in ``dtype``, in eval mode, as ``from_pretrained(dtype=...)`` would load
    it: the parameters cast, the buffers left as they are (the rotary ``inv_freq`` stays float32: in bfloat16 a
    position × frequency product would be off by radians at a few thousand tokens), ``config.dtype`` set.

    The rollout engine's copy of the learner's float32 master weights (``tether.runtime.local_engine``)."""
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    out = copy.deepcopy(model)
    for p in out.parameters():  # a tied head is the embedding's Parameter: cast once, still tied
        p.data = p.data.to(dtype)
    if getattr(out, "config", None) is not None:
        out.config.dtype = dtype
    return out.eval()

# Qwen2Config fields of the tiny preset; any of them can be overridden through build_tiny(**overrides).
TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.02,
)
TINY_VOCAB_SIZE = 2048  # BPE target; the model's vocab is the tokenizer's actual size
BUILD_VERSION = 2  # bump when the built-in corpus or build_tiny's code changes (invalidates cached presets)


def load_model_and_tokenizer(path: str | os.PathLike, dtype: str = "float32") -> tuple[Any, Any]:
    """A causal LM and its tokenizer (with its chat template) from a local HF folder, in eval mode; a LoRA checkpoint
    (an adapter in peft's format, ``tether.learner.lora``) gives its base model with the adapter merged in."""
    torch_dtype(dtype)  # a bad name fails before anything is read
    path = str(path)
    if Path(path, "adapter_config.json").is_file() and not Path(path, "config.json").is_file():
        from tether.learner import lora  # noqa: PLC0415 — peft, for a LoRA checkpoint only

        return lora.load_merged(path, _DTYPES[dtype]), AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not Path(path, "config.json").is_file():
        raise FileNotFoundError(f"{path!r} is not a Hugging Face model folder (no config.json in it)")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], local_files_only=True)
    return model.eval(), tokenizer


def build_tiny(path: str | os.PathLike, corpus: Iterable[str] = (), seed: int = 0,
               extra_tokens: Iterable[str] = (), **overrides: Any) -> str:
    """Build the tiny preset into ``path`` (model, tokenizer, generation config); returns ``path``.

    ``overrides`` are Qwen2Config fields (``num_hidden_layers=2``, ...) plus ``vocab_size``, which sets
    the BPE target size. ``extra_tokens`` are strings that each become one (non-special) token, matched
    before BPE (e.g. a world's entity ids, so that a tiny model copies ``O-3410`` as one token, not six).
    Deterministic in (corpus, seed, extra_tokens, overrides).
    """
    overrides = dict(overrides)
    vocab_target = int(overrides.pop("vocab_size", TINY_VOCAB_SIZE))
    tokenizer = train_tokenizer([*builtin_corpus(), *corpus], vocab_size=vocab_target)
    extra = list(dict.fromkeys(extra_tokens))  # ordered, deduplicated: ids are deterministic
    if extra:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    # transformers types the result int | list[int]; a list in gives a list out.
    eos, pad = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])  # type: ignore[misc]
    config = Qwen2Config(**{**TINY_DEFAULTS, **overrides}, vocab_size=len(tokenizer),
                         bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    tokenizer.model_max_length = config.max_position_embeddings
    path = str(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def ensure_tiny(cache_dir: str | os.PathLike, corpus: Iterable[str] = (), seed: int = 0, **overrides: Any) -> str:
    """``build_tiny`` once per distinct input into ``cache_dir/tiny-<hash>`` and reuse it afterwards.

    Safe across concurrent processes: each builds into a temporary folder and renames it into place.
    """
    corpus = list(corpus)
    key = json.dumps([BUILD_VERSION, CHAT_TEMPLATE, TINY_DEFAULTS, TINY_VOCAB_SIZE, seed, corpus,
                      sorted(overrides.items())], sort_keys=True, default=str)
    target = Path(cache_dir, "tiny-" + hashlib.sha256(key.encode()).hexdigest()[:16])
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=target.parent)
    try:
        build_tiny(tmp, corpus, seed, **overrides)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
