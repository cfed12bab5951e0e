"""From a request to finished choices: prompt ids, sampling parameters, the engine call, stops and logprobs.

Chat prompts are rendered by the tokenizer's chat template with the request's tools, and the model's text is
decoded and parsed for tool calls exactly as the agent loop does in training (``tether.agent.chat.render_ids``,
``decode(..., skip_special_tokens=False)`` without the final stop id, the configured ``tool_parser``), so a served
policy sees the prompts and is read the way it was trained. Assistant tool calls in the history carry their
``arguments`` as a JSON string on the wire; they are parsed back to objects before rendering, as the agent loop
holds them (vLLM does the same), so a conversation renders to the same tokens either way.

Token-level fields (``token_ids``, logprobs, ``weight_versions``) are the engine's, stop id included; the text
leaves the final stop id out. A stop *string* is matched on the decoded text: the text is cut before it and the
token fields after the token that completed it. A stop string that is one token of the vocabulary also becomes a
stop id, so the engine ends there instead of running on to ``max_tokens``.

Logprobs are those of the sampling distribution, ``log_softmax(logits / T)`` (T = 1 when greedy), before top-p:
what the engine returns and what the trainer recomputes. The engine returns the sampled token's logprob only, so
``top_logprobs`` come from one teacher-forced forward pass of the served model over the finished sequence (under
the lock that weight updates take): equal to the sampling distribution's up to float error, unless a weight update
arrived during the generation, in which case they are the new weights'.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

import torch
from tokenizers.decoders import DecodeStream

from tether.agent.chat import render_ids
from tether.agent.parsers import get_parser
from tether.engine.base import GenerationResult, InferenceEngine, SamplingParams, takes
from tether.serve.protocol import SEED_MAX


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


@dataclass
class Choice:
    """One finished generation, cut at a stop string when one matched."""

    token_ids: list[int]  # engine ids (stop id included)
    logprobs: list[float]  # [len(token_ids)]
    versions: list[int]  # [len(token_ids)]
    text_ids: list[int]  # the ids whose text is shown: token_ids without a final stop id
    text: str
    finish_reason: str  # stop | length | abort
    stop_reason: int | str | None
    num_preempted: int
    top: list[list[tuple[int, float]]] | None = None  # [len(token_ids)] (id, logprob) alternatives, best first


# apply_chat_template's own arguments, which chat_template_kwargs may not override
_RENDER_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character standing for each byte → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


def _eos_ids(tokenizer: Any, model: Any) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
    return {i for i in ids if isinstance(i, int)}


class Generator:
    """Turns requests into engine calls for one served model. ``model`` (optional) is the engine's torch module:
    it provides ``max_model_len``, the vocabulary size and the ``top_logprobs`` forward pass."""

    def __init__(self, engine: InferenceEngine, tokenizer: Any, *, model: Any = None, parser: str = "hermes",
                 extra_stop_ids: tuple[int, ...] = ()):
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.parse, self.parser = get_parser(parser), parser
        self.grouped = takes(engine.generate, "group")  # fair admission (LocalEngine)
        config = getattr(model, "config", None)
        self.max_model_len: int | None = getattr(config, "max_position_embeddings", None)
        self.vocab_size: int = getattr(config, "vocab_size", None) or len(tokenizer)
        self.eos_ids = _eos_ids(tokenizer, model)
        im_end = tokenizer.get_vocab().get("<|im_end|>")
        # The agent loop's end-of-turn ids (tether.agent.loop.AgentLoopBase) plus tool_parser.stop_token_ids.
        self.chat_stop_ids = self.eos_ids | ({im_end} if im_end is not None else set()) | set(extra_stop_ids)
        self._added = set(tokenizer.get_added_vocab())
        # The longest token's piece: a byte-level piece has one character per byte, so no token covers more
        # characters of text than this (check_text's bound).
        self.max_token_chars = max((len(p) for p in tokenizer.get_vocab()), default=1)
        self.model_lock = threading.Lock()  # held by top_logprobs forward passes and by weight updates

    # --- prompts ---------------------------------------------------------------------------------------------

    def check_text(self, chars: int, param: str) -> None:
        """400 for text that cannot fit the context whatever its tokens (before rendering or tokenizing it: the cost
        grows with the text): at least chars / max_token_chars tokens, with a factor 2 for normalizers that merge
        characters."""
        if self.max_model_len is not None and chars > 2 * self.max_model_len * self.max_token_chars:
            raise APIError(400, f"the prompt has {chars} characters, more than this model's maximum context length of "
                                f"{self.max_model_len} tokens can hold", param=param, code="context_length_exceeded")

    def render_chat(self, messages: list[Any], tools: list[Any] | None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        taken = sorted(set(template_kwargs or ()) & _RENDER_ARGUMENTS)
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}: the server sets them",
                           param="chat_template_kwargs")
        msgs = [_message_dict(m) for m in messages]
        self.check_text(sum(len(m["content"] or "") for m in msgs), "messages")
        # strict is the server's (tether.serve.structured), not the prompt's: rendered as training rendered the tools
        schemas = [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in tools] if tools else None
        try:  # a prompt longer than the context is refused by check_prompt: not cached
            return render_ids(self.tokenizer, msgs, schemas, add_generation_prompt=True,
                              max_cached_len=self.max_model_len, template_kwargs=template_kwargs)
        except Exception as e:  # noqa: BLE001 — jinja errors: a template that cannot render this conversation
            raise APIError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                           param="messages") from None

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        self.check_text(len(text), param)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})",
                           param=param)
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                                f"{self.max_model_len} tokens, shared by the prompt and the completion",
                           param=param, code="context_length_exceeded")

    def max_new(self, requested: int | None, prompt_len: int) -> int:
        room = None if self.max_model_len is None else self.max_model_len - prompt_len
        if requested is None:
            return room if room is not None else 1024
        if room is not None and requested > room:
            raise APIError(400, f"max_tokens is {requested} but the prompt has {prompt_len} tokens; this model's "
                                f"maximum context length is {self.max_model_len} tokens (at most {room} new ones)",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    # --- generation ------------------------------------------------------------------------------------------

    def stops(self, req: Any, defaults: set[int]) -> tuple[tuple[int, ...], list[str]]:
        """Stop ids (defaults unless ``ignore_eos``, the request's, one-token stop strings) and stop strings."""
        strings = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in strings):
            raise APIError(400, "a stop string is empty", param="stop")
        ids = set() if req.ignore_eos else set(defaults)
        ids |= set(req.stop_token_ids or [])
        for s in strings:
            one = self.encode(s, "stop")
            if len(one) == 1:
                ids.add(one[0])
        bad = sorted(i for i in ids if i >= self.vocab_size)
        if bad:
            raise APIError(400, f"stop_token_ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})",
                           param="stop_token_ids")
        return tuple(sorted(ids)), strings

    def choices(self, prompt: list[int], params: SamplingParams, *, n: int, strings: list[str], top_k: int,
                skip_special_tokens: bool, include_stop: bool = False,
                group: Any = None) -> list[Coroutine[Any, Any, Choice]]:
        """``n`` choices of ``prompt``, one engine request each (choice i seeded ``seed + i``), to be awaited
        together: the engine batches them with every other request. ``include_stop``: vLLM's
        ``include_stop_str_in_output``, the text keeps the stop string or stop token that ended it. ``group``: the
        HTTP request's, for the engine's fair admission (``tether.engine.fair_share``)."""
        if top_k and self.model is None:
            raise APIError(400, "top_logprobs need the served model's logits; this server's engine has no model",
                           param="top_logprobs")
        return [self._choice(prompt, p, strings, top_k, skip_special_tokens, include_stop, group)
                for p in self.seeded(params, n)]

    @staticmethod
    def seeded(params: SamplingParams, n: int) -> list[SamplingParams]:
        """The parameters of ``n`` choices: choice i seeded ``seed + i``."""
        return [replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)]

    async def _choice(self, prompt: list[int], params: SamplingParams, strings: list[str], top_k: int,
                      skip: bool, include_stop: bool, group: Any = None) -> Choice:
        choice = self._finish(await self._one(prompt, params, group), params, strings, skip, include_stop)
        if top_k and choice.token_ids:
            choice.top = await asyncio.to_thread(self._top, prompt, choice.token_ids, params.temperature, top_k)
        elif top_k:
            choice.top = []
        return choice

    async def _one(self, prompt: list[int], params: SamplingParams, group: Any = None) -> GenerationResult:
        try:
            if group is not None and self.grouped:
                return await self.engine.generate(prompt, params, group=group)  # type: ignore[call-arg]
            return await self.engine.generate(prompt, params)
        except ValueError as e:  # the engine refused the request (prompt length, parameters)
            raise APIError(400, str(e)) from None

    def _finish(self, out: GenerationResult, params: SamplingParams, strings: list[str], skip: bool,
                include_stop: bool = False) -> Choice:
        ids, lps = list(out.token_ids), list(out.logprobs)
        versions = list(out.versions) or [self.engine.version] * len(ids)
        reason: str = out.finish_reason
        stopped_by = ids[-1] if reason == "stop" and ids and ids[-1] in params.stop_token_ids else None
        text_ids = ids[:-1] if stopped_by is not None and not include_stop else ids
        text = self.tokenizer.decode(text_ids, skip_special_tokens=skip)
        stop_reason: int | str | None = None if stopped_by in self.eos_ids else stopped_by
        # As vLLM: no stop string counts before min_tokens tokens (the engine holds back stop ids until then).
        floor = len(self.tokenizer.decode(text_ids[:params.min_tokens - 1], skip_special_tokens=skip)) \
            if params.min_tokens > 1 else 0
        hits = [(at, s) for s in strings if (at := _find_after(text, s, floor)) >= 0]
        if hits:
            cut, s = min(hits)
            k = self._first_prefix_with(text_ids, strings, skip, floor)
            ids, lps, versions, text_ids = ids[:k], lps[:k], versions[:k], text_ids[:k]
            text, reason, stop_reason = text[:cut + len(s) if include_stop else cut], "stop", s
        return Choice(ids, lps, versions, text_ids, text, reason, stop_reason, out.num_preempted)

    def _first_prefix_with(self, ids: list[int], strings: list[str], skip: bool, floor: int = 0) -> int:
        """The fewest leading ids whose text contains one of ``strings`` ending past character ``floor`` (binary
        search: containment only grows)."""
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            text = self.tokenizer.decode(ids[:mid], skip_special_tokens=skip)
            if any(_find_after(text, s, floor) >= 0 for s in strings):
                hi = mid
            else:
                lo = mid + 1
        return hi

    def _top(self, prompt: list[int], ids: list[int], temperature: float, k: int) -> list[list[tuple[int, float]]]:
        seq = torch.tensor([prompt + ids[:-1]], device=self.model.device)
        with self.model_lock, torch.inference_mode():
            logits = self.model(input_ids=seq).logits[0, len(prompt) - 1:].float()  # [len(ids), V]
        logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
        values, index = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]

    def prompt_logprobs(self, prompt: list[int], k: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: for each prompt position t ≥ 1, the prompt token's log-probability and rank
        and the ``k`` most likely tokens', keyed by id (None at position 0, which has no context). Raw model
        log-probs, log_softmax(logits) at temperature 1, as vLLM's default ``logprobs_mode``; one teacher-forced
        forward pass under the lock that weight updates take."""
        if self.model is None:
            raise APIError(400, "prompt_logprobs need the served model's logits; this server's engine has no model",
                           param="prompt_logprobs")
        seq = torch.tensor([prompt], device=self.model.device)
        with self.model_lock, torch.inference_mode():
            logp = torch.log_softmax(self.model(input_ids=seq).logits[0, :-1].float(), dim=-1)  # [P-1, V]
        target = torch.tensor(prompt[1:], device=logp.device)  # [P-1]
        own = logp.gather(1, target[:, None])  # [P-1, 1]
        ranks = ((logp > own).sum(-1) + 1).tolist()  # [P-1]
        values, index = logp.topk(min(k, logp.shape[-1]), dim=-1) if k else (logp[:, :0], target[:, None][:, :0])
        texts: dict[int, str] = {}  # one decode per distinct id (decoding dominated the time)

        def text(i: int) -> str:
            if i not in texts:
                texts[i] = self.token_text(i)
            return texts[i]

        out: list[dict[str, dict[str, Any]] | None] = [None]
        for t, (tok, lp, rank) in enumerate(zip(prompt[1:], own[:, 0].tolist(), ranks)):
            entry = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": text(i)}
                     for r, (i, v) in enumerate(zip(index[t].tolist(), values[t].tolist()))}
            entry[str(tok)] = {"logprob": lp, "rank": rank, "decoded_token": text(tok)}
            out.append(entry)
        return out

    # --- text views ------------------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: byte-level BPE pieces mapped back (a piece of a multi-byte character is not
        valid UTF-8 on its own); other tokens as the UTF-8 of their text."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece not in self._added:
            try:
                return [_BYTE_OF[ch] for ch in piece]
            except KeyError:
                pass
        return list(self.token_text(token_id).encode("utf-8"))

    def pieces(self, ids: list[int], skip: bool) -> list[str]:
        """The text each token adds when decoding incrementally ("" while a multi-byte character is incomplete):
        a window of the last tokens is re-decoded, as streaming detokenizers do."""
        decoder = Detokenizer(self.tokenizer, skip, window=True)
        return [decoder.add(i) for i in ids]


class Detokenizer:
    """Text added by each id appended ("" while a multi-byte character is incomplete): the tokenizers library's
    ``DecodeStream`` for a fast tokenizer, else (or with ``window``) a window of the last ids re-decoded."""

    def __init__(self, tokenizer: Any, skip: bool, *, window: bool = False):
        self.tokenizer, self.skip = tokenizer, skip
        self.backend: Any = None if window else getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=skip) if self.backend is not None else None
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def add(self, token_id: int) -> str:
        if self.stream is not None:
            return self.stream.step(self.backend, token_id) or ""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""


def _find_after(text: str, s: str, floor: int) -> int:
    """Where ``s`` first occurs in ``text`` ending past character ``floor`` (-1: nowhere)."""
    return text.find(s, max(0, floor - len(s) + 1))


def sampling_params(req: Any, max_tokens: int, stop_ids: tuple[int, ...], vocab_size: int) -> SamplingParams:
    """The engine's SamplingParams of a request (unset fields at their neutral values); 400 naming a field the engine
    refuses."""
    if req.seed is not None and req.seed + req.n - 1 > SEED_MAX:  # choice i samples with seed + i
        raise APIError(400, f"seed must be at most {SEED_MAX - req.n + 1} with n = {req.n} (choice i samples with "
                            f"seed + i, a 64-bit integer)", param="seed")
    bias = []
    for key, value in (req.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise APIError(400, f"logit_bias: {key!r} is not a token id of this model's vocabulary [0, {vocab_size})",
                           param="logit_bias")
        bias.append((int(key), float(value)))
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, max_tokens=max_tokens, stop_token_ids=stop_ids, seed=req.seed,
        top_k=max(0, req.top_k or 0), min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        min_tokens=req.min_tokens or 0, logit_bias=tuple(sorted(bias)))
    if params.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({params.min_tokens}) is more than max_tokens ({max_tokens})",
                       param="min_tokens")
    try:
        params.check(vocab_size)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return params


def _message_dict(m: Any) -> dict[str, Any]:
    """A request message as the agent loop holds it: text content, tool-call arguments as objects."""
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    return msg


def _arguments(args: str | dict[str, Any]) -> Any:
    if isinstance(args, dict):
        return args
    try:
        return json.loads(args)
    except ValueError:
        return args  # not JSON: rendered as the model wrote it
