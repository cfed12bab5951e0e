"""A choice told as it is generated: OpenAI deltas from the engine's token stream (``stream_generation``).

Each decode step's tokens are decoded incrementally (a window of the last tokens re-decoded, as streaming
detokenizers do) and sent at once, except text that may still change what is shown:

- the tail that could be the start of a stop string (held until the next token decides; a stop string that
  matches ends the engine request at once, and the choice is what the same tokens would give unstreamed);
- the final stop token (not shown unless ``include_stop_str_in_output``);
- with tools (the hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``): content from the
  first ``<tool_call>`` on. Each call's id and name go in its first delta as soon as ``"arguments":`` is written,
  then its arguments as they grow (a ``}`` and a ``</tool_call>`` being written are held until the call closes).
  Content is stripped of its leading and trailing whitespace, as the unstreamed message's is.

When the choice ends, its finished form (``Generator._finish`` and ``ChatView.message``, as unstreamed) decides
the rest: what of it was not sent yet is sent, then the finish reason. A call the model wrote malformed was
streamed up to where it broke; the finish reason is then the unstreamed one's. Logprob entries go with the
delta that showed their token's text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tether.engine.base import GenerationResult, SamplingParams, TokenDelta, stream_generation
from tether.serve.generation import Choice, Detokenizer, Generator

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
MAX_STREAMED_CALLS = 64
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _held(text: str, marks: list[str], start: int = 0) -> int:
    """Characters at the end of ``text`` (past ``start``) that are a proper prefix of one of ``marks``."""
    most = 0
    for m in marks:
        for k in range(min(len(m) - 1, len(text) - start), most, -1):
            if text.endswith(m[:k]):
                most = k
                break
    return most


AUTO_CHUNKS_PER_STEP = 16  # auto pacing: about this many chunks a decode step, however many choices stream
AUTO_MAX_INTERVAL = 8  # auto pacing: at most this many tokens a chunk


@dataclass
class Pace:
    """Tokens per streamed chunk after a choice's first, shared by a server's streams (vLLM's ``--stream-interval``).

    ``interval``: a fixed number of tokens (1 = every decode step's tokens as the step ends); None = auto: 1 while at
    most ``AUTO_CHUNKS_PER_STEP`` choices stream at once, above that ⌈streaming / AUTO_CHUNKS_PER_STEP⌉ (at most
    ``AUTO_MAX_INTERVAL``). A chunk costs the server and the client the same CPU whatever it carries, so under many
    concurrent streams the chunks a decode step makes stay about ``AUTO_CHUNKS_PER_STEP``; one stream alone is told
    every token.
    """

    interval: int | None = None
    streaming: int = 0  # choices streaming now (choice_deltas, on the event loop)

    def __post_init__(self) -> None:
        if self.interval is not None and self.interval < 1:
            raise ValueError(f"stream_interval must be >= 1 token (or auto), got {self.interval}")

    def tokens(self) -> int:
        if self.interval is not None:
            return self.interval
        return min(AUTO_MAX_INTERVAL, max(1, -(-self.streaming // AUTO_CHUNKS_PER_STEP)))


@dataclass
class _Call:
    header: bool = False  # id and name sent
    sent: str = ""  # arguments sent


@dataclass
class ChoiceStream:
    """One choice's deltas, fed the engine's tokens. ``tools``: parse hermes tool calls out of the text."""

    gen: Generator
    params: SamplingParams
    strings: list[str]  # stop strings
    skip: bool
    include_stop: bool
    tools: bool = False
    first_call_only: bool = False
    group: Any = None  # the engine's fair-admission group: the HTTP request's
    pace: Pace = field(default_factory=lambda: Pace(1))  # tokens per streamed chunk after the first (choice_deltas)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    ends: list[int] = field(default_factory=list)  # len(text) after each shown token
    floor: int | None = None  # stop strings count only when they end past it (min_tokens, as Generator._finish)
    cut: int | None = None  # a stop string matched: the shown text ends here
    sent_content: str = ""
    entries_sent: int = 0  # shown tokens whose logprobs were sent
    calls: list[_Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.decoder = Detokenizer(self.gen.tokenizer, self.skip)
        if self.params.min_tokens <= 1:
            self.floor = 0

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    def feed(self, delta: TokenDelta) -> list[tuple[dict[str, Any], range]]:
        """The deltas (and the shown tokens whose logprobs go with them) these new tokens make sendable."""
        for tid, lp, v in zip(delta.token_ids, delta.logprobs, delta.versions):
            if self.stopped:
                break
            self.tokens.append(tid)
            self.logprobs.append(lp)
            self.versions.append(v)
            if tid in self.params.stop_token_ids and not self.include_stop:
                continue  # it ends the generation; its text is not shown
            before = len(self.text)
            self.text += self.decoder.add(tid)
            self.ends.append(len(self.text))
            if self.floor is None and len(self.tokens) >= self.params.min_tokens - 1:
                self.floor = len(self.text)
            if self.floor is not None and self.strings:
                hits = [(at, s) for s in self.strings
                        if (at := self.text.find(s, max(0, self.floor - len(s) + 1, before - len(s) + 1))) >= 0]
                if hits:
                    at, s = min(hits)
                    self.cut = at + len(s) if self.include_stop else at
        return self._sendable()

    def _sendable(self, final: bool = False) -> list[tuple[dict[str, Any], range]]:
        """Deltas of what can be sent now; ``final``: the text is complete, nothing is held."""
        text = self.text if self.cut is None else self.text[:self.cut]
        hold = 0 if final or self.cut is not None else _held(text, self.strings, self.floor or 0)
        marker = text.find(_OPEN) if self.tools else -1
        deltas: list[dict[str, Any]] = []
        if marker < 0:
            end = len(text) - max(hold, _held(text, [_OPEN]) if self.tools and not final else 0)
            content, frontier = text[:end], end
        else:
            content, frontier = text[:marker], marker
        if self.tools:  # shown stripped, as the unstreamed message's content
            content = content.strip()
        piece = content[len(self.sent_content):] if content.startswith(self.sent_content) else ""
        if piece:
            deltas.append({"content": piece})
            self.sent_content += piece
        if marker >= 0:
            covered, calls = self._call_deltas(text[marker:], hold, final)
            deltas.extend(calls)
            frontier = marker + covered
        return self._with_entries(deltas, frontier)

    def _call_deltas(self, region: str, hold: int, final: bool) -> tuple[int, list[dict[str, Any]]]:
        """Deltas of the tool calls in ``region`` (the text from the first ``<tool_call>`` on) and how many of its
        characters they have told."""
        out: list[dict[str, Any]] = []
        covered, start = 0, 0
        for k in range(MAX_STREAMED_CALLS):
            start = region.find(_OPEN, start)
            if start < 0 or (self.first_call_only and k > 0):
                break
            start += len(_OPEN)
            block = region[start:]
            header = _HEADER.match(block)
            if header is None:
                break  # not (yet) a call whose name can be told
            if len(self.calls) <= k:
                self.calls.append(_Call())
            call = self.calls[k]
            if not call.header:
                call.header = True
                out.append({"tool_calls": [{"index": k, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                            "function": {"name": json.loads(header.group(1)), "arguments": ""}}]})
            body = block[header.end():]
            close = body.find(_CLOSE)
            if close >= 0:
                args = body[:close].rstrip()
                args = args[:-1].rstrip() if args.endswith("}") else args  # the call object's own brace
            else:
                args = body[:len(body) - hold]
                if not final:  # "}", whitespace and the start of "</tool_call>" may be the call's end
                    args = args[:len(args) - _held(args, [_CLOSE])].rstrip()
                    args = args[:-1] if args.endswith("}") else args
            if args.startswith(call.sent) and len(args) > len(call.sent):
                out.append({"tool_calls": [{"index": k, "function": {"arguments": args[len(call.sent):]}}]})
                call.sent = args
            covered = start + header.end() + (close + len(_CLOSE) if close >= 0 else len(call.sent))
            start = covered
        return covered, out

    def _with_entries(self, deltas: list[dict[str, Any]], frontier: int) -> list[tuple[dict[str, Any], range]]:
        """Pair the deltas with the shown tokens whose text ends within ``frontier`` characters (on the last)."""
        done = self.entries_sent
        while done < len(self.ends) and self.ends[done] <= frontier:
            done += 1
        out = [(d, range(0)) for d in deltas]
        if out and done > self.entries_sent:
            out[-1] = (out[-1][0], range(self.entries_sent, done))
            self.entries_sent = done
        return out

    def finish(self, result: GenerationResult | None, view: Any) -> tuple[Choice, list[tuple[dict[str, Any], range]]]:
        """The finished choice (from the engine's result, or from the tokens so far when a stop string ended it)
        and the deltas of what was not sent yet."""
        if result is None or self.stopped:
            result = GenerationResult(self.tokens, self.logprobs, "length", self.versions,
                                      result.num_preempted if result is not None else 0)
        choice = self.gen._finish(result, self.params, self.strings, self.skip, self.include_stop)
        first = self.entries_sent
        out = [d for d, _ in self._sendable(final=True)]
        msg = view.message(choice)[0] if self.tools else None
        content = choice.text if msg is None or not msg.tool_calls else (msg.content or "")
        if content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            out.append({"content": content[len(self.sent_content):]})  # (a decode the pieces did not give)
            self.sent_content = content
        for k, call in enumerate(msg.tool_calls or [] if msg is not None else []):
            if k >= len(self.calls) or not self.calls[k].header:  # a call whose name could not be told early
                out.append({"tool_calls": [{"index": k, **call.model_dump()}]})
        entries = range(first, len(choice.text_ids))
        if entries and not out:
            out.append({"content": ""})
        paired = [(d, range(0)) for d in out]
        if paired:
            paired[-1] = (paired[-1][0], entries)
        return choice, paired


async def choice_deltas(stream: ChoiceStream, prompt: list[int], view: Any
                        ) -> AsyncIterator[tuple[dict[str, Any], range] | Choice]:
    """The deltas of one choice as the engine makes its tokens, then the finished ``Choice``. ``stream.pace``: tokens
    per chunk after the first delta (``Pace``): what that many tokens make is sent as one delta (fewer chunks for the
    server to send and the client to parse, at the cost of smoothness)."""
    pace = stream.pace
    result: GenerationResult | None = None
    # The engine wakes this loop at the pace too, except while stop strings are watched (a match ends the request)
    every = None if stream.strings else pace.tokens
    tokens = stream_generation(stream.gen.engine, prompt, stream.params, stream.group, every)
    pending: list[tuple[dict[str, Any], range]] = []
    held, sent = 0, False  # tokens since the last delta sent; whether one was
    pace.streaming += 1
    try:
        async for item in tokens:
            if isinstance(item, GenerationResult):
                result = item
                break
            pending.extend(stream.feed(item))
            held += len(item.token_ids)
            if pending and (not sent or held >= pace.tokens()):
                for pair in coalesced(pending):
                    yield pair
                pending, held, sent = [], 0, True
            if stream.stopped:
                break
    finally:
        pace.streaming -= 1
        await tokens.aclose()  # aborts the engine request if it is still running
    choice, rest = stream.finish(result, view)
    for pair in coalesced(pending + rest):
        yield pair
    yield choice


def coalesced(pairs: list[tuple[dict[str, Any], range]]) -> list[tuple[dict[str, Any], range]]:
    """Adjacent content deltas as one, and adjacent argument deltas of one tool call as one (their logprob entries
    joined)."""
    out: list[tuple[dict[str, Any], range]] = []
    for delta, which in pairs:
        if out:
            last, last_which = out[-1]
            joined = _joined(last, delta)
            if joined is not None:
                start = last_which.start if last_which else which.start
                out[-1] = (joined, range(start, which.stop if which else last_which.stop) if last_which or which
                           else range(0))
                continue
        out.append((delta, which))
    return out


def _joined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    if set(a) == set(b) == {"content"}:
        return {"content": a["content"] + b["content"]}
    if set(a) == set(b) == {"tool_calls"}:
        (x,), (y,) = a["tool_calls"], b["tool_calls"]
        if x["index"] == y["index"] and "id" not in y and "arguments" in x["function"]:
            function = {**x["function"], "arguments": x["function"]["arguments"] + y["function"]["arguments"]}
            return {"tool_calls": [{**x, "function": function}]}
    return None
