"""Token-in/token-out assembly of a multi-turn conversation.

The prompt is rendered once by the model's own chat template (tools included). After that, assistant
tokens are appended exactly as the engine produced them (mask 1, their behaviour logprobs), and every
non-assistant message (tool results, user replies) plus the next generation prompt is appended as the
*suffix difference* of two template renderings (mask 0). Nothing is ever re-tokenised from text: the
sequence the trainer sees is the one the engine generated from.

The suffix is cut right after the assistant's end-of-turn token, so the separator that the template puts
between turns (Qwen's ``\n`` after ``<|im_end|>``) is kept — verl issue #6501 is the bug of dropping it.

A *memory segment* (``tether.agent.loop``) starts from a fresh prompt: the template's rendering of its header
messages (system prompt, opening request, summary) followed by the kept turns' own token ids, copied from the
sequence they were generated and observed in. For a prefix-stable template that is the rendering of the same
conversation, and the policy's own tokens are still never re-tokenised.

``observation_text`` is what a tool message shows the policy: the environment's ``last_tool_result`` and its
other listed ``observation_fields`` (``environment.state.observation_fields``).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

# Observation keys defined by the Env protocol (tether.env.base); every other key is a listed state field.
PROTOCOL_KEYS = frozenset({"last_tool_result", "user_reply", "tool_error", "memory"})

# A placeholder conversation the deltas are cut from; its content never reaches the model.
_ANCHOR_SYSTEM = {"role": "system", "content": "s"}
_ANCHOR_USER = {"role": "user", "content": "u"}


_RENDER_CACHE_BYTES = 64 << 20  # per tokenizer: the keys' characters plus ~36 bytes an id (a boxed int, a slot)
_ID_BYTES = 36


@dataclass
class _RenderCache:
    entries: OrderedDict[str, tuple[int, ...]] = field(default_factory=OrderedDict)
    nbytes: int = 0

    @staticmethod
    def size(key: str, ids: tuple[int, ...]) -> int:
        return len(key) + _ID_BYTES * len(ids)

    def put(self, key: str, ids: tuple[int, ...]) -> None:
        size = self.size(key, ids)
        if size > _RENDER_CACHE_BYTES // 16 or key in self.entries:  # one huge rendering would flush the rest
            return
        self.entries[key] = ids
        self.nbytes += size
        while self.nbytes > _RENDER_CACHE_BYTES:
            old_key, old_ids = self.entries.popitem(last=False)
            self.nbytes -= self.size(old_key, old_ids)


_render_caches: weakref.WeakKeyDictionary[Any, _RenderCache] = weakref.WeakKeyDictionary()
_render_lock = threading.Lock()


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, *,
               add_generation_prompt: bool, max_cached_len: int | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the chat template applied to ``messages``.

    Cached per tokenizer, keyed by the messages, tools and flag as JSON: the episodes of a group share their
    opening prompt, every suffix is cut from the same anchor rendering, and tool results repeat, so most
    renderings of a step were rendered before. A rendering is a pure function of those inputs and the
    tokenizer, so a cached one is the one the template would give (``tests/test_speed_equivalence.py``).
    The cache is bounded in bytes (``_RENDER_CACHE_BYTES``, least recently used first out, no entry over a
    sixteenth of it); a rendering of ``max_cached_len`` ids or more is not kept (``tether serve`` refuses it).
    ``template_kwargs``: more variables for the template (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``).
    """
    key = json.dumps([messages, tools, add_generation_prompt, *([template_kwargs] if template_kwargs else [])],
                     sort_keys=True, default=repr)
    with _render_lock:
        cache = _render_caches.get(tokenizer)
        if cache is None:
            cache = _render_caches[tokenizer] = _RenderCache()
        hit = cache.entries.get(key)
        if hit is not None:
            cache.entries.move_to_end(key)
            return list(hit)
    out = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=True,
        return_dict=False, **(template_kwargs or {}),
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # BatchEncoding in some versions
        out = out["input_ids"]
    ids = tuple(out)
    if max_cached_len is None or len(ids) < max_cached_len:
        with _render_lock:
            cache.put(key, ids)
    return list(ids)


def _end_of_turn_id(tokenizer: Any) -> int | None:
    """``<|im_end|>``'s id if the vocabulary has it, else the eos id (looked up once per tokenizer: ``get_vocab``
    builds a dict of the whole vocabulary)."""
    with _render_lock:
        cached = _eot_ids.get(tokenizer)
    if cached is not None:
        return cached[0]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    found = eos if eos is not None else tokenizer.eos_token_id
    with _render_lock:
        _eot_ids[tokenizer] = (found,)
    return found


_eot_ids: weakref.WeakKeyDictionary[Any, tuple[int | None]] = weakref.WeakKeyDictionary()


def observation_text(obs: dict[str, Any]) -> str:
    """The content of the tool message for one observation: ``last_tool_result`` (when listed), then one
    ``state: {...}`` line (JSON, in the order the fields are listed) with every other listed observation field
    that holds something — e.g. ``state: {"user_intent": "refund", "order_status": "delivered"}``. A field
    with no value yet (no order checked, nothing queried) is left out rather than shown empty."""
    lines = [str(obs["last_tool_result"])] if obs.get("last_tool_result") is not None else []
    state = {k: v for k, v in obs.items() if k not in PROTOCOL_KEYS and v not in (None, "", {}, [])}
    if state:
        lines.append("state: " + json.dumps(state, ensure_ascii=False))
    return "\n".join(lines)


@dataclass
class TokenBuffer:
    """The growing token sequence of one trajectory: prompt, then response tokens with their mask."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_model_tokens(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"engine returned {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        self.response_ids += ids
        self.response_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def add_context_tokens(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


class ChatAssembler:
    """Renders the initial prompt and the mask-0 suffix that follows each assistant turn."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        eot = _end_of_turn_id(tokenizer)
        if eot is None:
            raise ValueError("the tokenizer has neither <|im_end|> nor an eos token; cannot delimit turns")
        self.end_of_turn_id: int = eot

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return render_ids(self.tokenizer, messages, self.tools, add_generation_prompt=True)

    def suffix_after_assistant(self, assistant_msg: dict[str, Any], new_messages: list[dict[str, Any]]) -> list[int]:
        """Ids that follow the assistant's end-of-turn token: ``new_messages`` + the generation prompt.

        Rendered as the difference between [anchor…, assistant] and [anchor…, assistant, *new_messages]
        with the generation prompt, cut right after the assistant's end-of-turn token.
        """
        base = [_ANCHOR_SYSTEM, _ANCHOR_USER, assistant_msg]
        base_ids = render_ids(self.tokenizer, base, self.tools, add_generation_prompt=False)
        full_ids = render_ids(self.tokenizer, base + new_messages, self.tools, add_generation_prompt=True)
        try:
            cut = len(base_ids) - 1 - base_ids[::-1].index(self.end_of_turn_id)
        except ValueError:
            raise ValueError("the chat template does not end the assistant turn with its end-of-turn token") from None
        if full_ids[: cut + 1] != base_ids[: cut + 1]:
            raise ValueError("the chat template renders earlier turns differently once later messages are "
                             "added; token-in/token-out assembly needs a prefix-stable template")
        return full_ids[cut + 1 :]
