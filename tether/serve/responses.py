"""Finished choices → OpenAI response bodies and server-sent-event streams.

Streaming follows OpenAI's chunk format (``chat.completion.chunk`` / ``text_completion`` objects as ``data:`` lines,
a ``data: [DONE]`` line last, the usage in a last chunk with no choices when ``stream_options.include_usage``).
``chat_stream_live`` and ``completion_stream_live`` send each decode step's text as the engine makes it
(``tether.serve.streaming``); ``chat_stream`` and ``completion_stream`` send a choice's text when it is done
(token by token, each token with its logprobs), choices in the order they finish: for top_logprobs, which come from
a forward pass over the finished choice, and for tool-call formats other than hermes. A failure after the stream
has started is sent as one ``data: {"error": ...}`` line before
``[DONE]``, as vLLM does.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from tether.serve.generation import APIError, Choice, Generator
from tether.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCallOut,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from tether.serve.streaming import ChoiceStream, choice_deltas

Coros = list[Coroutine[Any, Any, Choice]]


async def gather(runs: list[Coros]) -> list[list[Choice]]:
    """Await every choice of every prompt together; on a failure the others are cancelled."""
    tasks = [[asyncio.ensure_future(c) for c in run] for run in runs]
    flat = [t for run in tasks for t in run]
    try:
        await asyncio.gather(*flat)
    except BaseException:
        for t in flat:
            t.cancel()
        raise
    return [[t.result() for t in run] for run in tasks]


def _usage(prompt_tokens: int, choices: list[Choice]) -> Usage:
    completion = sum(len(c.token_ids) for c in choices)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def _batch_usage(prompts: list[list[int]], completion_tokens: int) -> Usage:
    prompt_tokens = sum(map(len, prompts))
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _chunker(ident: str, kind: str, created: int, model: str) -> Callable[..., str]:
    """The SSE line of one chunk of a stream: ``chunk(choices, **extra)``."""
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return _sse({"id": ident, "object": kind, "created": created, "model": model, "choices": choices, **extra})
    return chunk


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_event(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        error = {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    else:
        error = {"message": f"internal error: {type(exc).__name__}: {exc}", "type": "server_error", "param": None,
                 "code": None}
    return _sse({"error": error})


async def _as_finished(runs: list[Coros]) -> AsyncIterator[tuple[int, int, Choice]]:
    """(prompt index, choice index, choice) in the order the choices finish; the rest cancelled on exit."""

    async def indexed(p: int, i: int, coro: Coroutine[Any, Any, Choice]) -> tuple[int, int, Choice]:
        return p, i, await coro

    tasks = [asyncio.ensure_future(indexed(p, i, c)) for p, run in enumerate(runs) for i, c in enumerate(run)]
    try:
        for next_done in asyncio.as_completed(tasks):
            yield await next_done
    finally:
        for t in tasks:
            t.cancel()


# ------------------------------------------------------------------------------------------------------ chat


@dataclass
class ChatView:
    """How a chat choice is shown: tool calls parsed or not, logprobs or not."""

    gen: Generator
    parse_tools: bool
    first_call_only: bool  # parallel_tool_calls: false
    logprobs: bool
    skip: bool = False  # skip_special_tokens: the text was decoded without special tokens

    def message(self, c: Choice) -> tuple[AssistantMessage, str]:
        """The assistant message and finish reason. Text with no valid tool call (a malformed one included) is
        returned as the model wrote it."""
        if self.parse_tools:
            turn = self.gen.parse(c.text)
            calls = turn.calls[:1] if self.first_call_only else turn.calls
            if calls:
                out = [ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}",
                                   function=FunctionCallOut(name=call.name,
                                                            arguments=json.dumps(call.arguments, ensure_ascii=False)))
                       for call in calls]
                return AssistantMessage(content=turn.content or None, tool_calls=out), "tool_calls"
        return AssistantMessage(content=c.text), c.finish_reason

    def entries(self, c: Choice, start: int = 0, stop: int | None = None) -> list[TokenLogprob]:
        """Logprob entries of the shown tokens ``start:stop`` (the final stop id is not shown)."""
        return self.token_entries(c.text_ids, c.logprobs, range(start, len(c.text_ids) if stop is None else stop),
                                  c.top)

    def token_entries(self, ids: list[int], logprobs: list[float], which: range,
                      top: list[list[tuple[int, float]]] | None = None) -> list[TokenLogprob]:
        out = []
        for j in which:
            alternatives = [TopLogprob(token=self.gen.token_text(i), logprob=v, bytes=self.gen.token_bytes(i))
                            for i, v in (top[j] if top else [])]
            out.append(TokenLogprob(token=self.gen.token_text(ids[j]), logprob=logprobs[j],
                                    bytes=self.gen.token_bytes(ids[j]), top_logprobs=alternatives))
        return out

    def deltas(self, c: Choice) -> Iterator[tuple[dict[str, Any], list[TokenLogprob]]]:
        """(delta, logprob entries) chunks of one finished choice: text token by token, or content then calls."""
        msg, _ = self.message(c)
        if msg.tool_calls:
            if msg.content:
                yield {"content": msg.content}, []
            calls = [{"index": k, **call.model_dump()} for k, call in enumerate(msg.tool_calls)]
            yield {"tool_calls": calls}, self.entries(c) if self.logprobs else []
            return
        text, shown, start = c.text, "", 0
        for j, piece in enumerate(self.gen.pieces(c.text_ids, skip=self.skip)):
            if not piece:
                continue
            if not text.startswith(shown + piece):  # a stop string cut the text inside this piece
                break
            shown += piece
            yield {"content": piece}, self.entries(c, start, j + 1) if self.logprobs else []
            start = j + 1
        if len(shown) < len(text) or (self.logprobs and start < len(c.text_ids)):
            yield {"content": text[len(shown):]}, self.entries(c, start) if self.logprobs else []


def _chat_choice(view: ChatView, i: int, c: Choice, return_token_ids: bool) -> ChatChoice:
    msg, reason = view.message(c)
    return ChatChoice(index=i, message=msg, finish_reason=reason, stop_reason=c.stop_reason,
                      logprobs=ChoiceLogprobs(content=view.entries(c)) if view.logprobs else None,
                      token_ids=c.token_ids if return_token_ids else None, weight_versions=c.versions,
                      num_preempted=c.num_preempted)


def chat_response(view: ChatView, choices: list[Choice], *, ident: str, created: int, model: str,
                  prompt: list[int], return_token_ids: bool) -> ChatCompletionResponse:
    return ChatCompletionResponse(
        id=ident, created=created, model=model, usage=_usage(len(prompt), choices),
        choices=[_chat_choice(view, i, c, return_token_ids) for i, c in enumerate(choices)],
        prompt_token_ids=prompt if return_token_ids else None)


def chat_stream(view: ChatView, run: Coros, *, ident: str, created: int, model: str, prompt: list[int],
                      include_usage: bool, return_token_ids: bool) -> AsyncIterator[str]:
    async def events() -> AsyncIterator[tuple[int, Any]]:
        async for _, i, c in _as_finished([run]):
            for delta, entries in view.deltas(c):
                yield i, (delta, entries)
            yield i, c

    return _chat_events(view, events(), len(run), ident=ident, created=created, model=model, prompt=prompt,
                        include_usage=include_usage, return_token_ids=return_token_ids)


async def _chat_events(view: ChatView, events: AsyncIterator[tuple[int, Any]], n: int, *, ident: str, created: int,
                       model: str, prompt: list[int], include_usage: bool,
                       return_token_ids: bool) -> AsyncIterator[str]:
    """The SSE lines of a chat stream from (choice index, (delta, logprob entries) or the finished Choice) events."""
    chunk = _chunker(ident, "chat.completion.chunk", created, model)

    done: list[Choice] = []
    try:
        for i in range(n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for i, item in events:
            if isinstance(item, Choice):
                done.append(item)
                final = _chat_choice(view, i, item, return_token_ids)
                yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": final.finish_reason,
                              "stop_reason": item.stop_reason, "token_ids": final.token_ids,
                              "weight_versions": item.versions, "num_preempted": item.num_preempted}])
                continue
            delta, entries = item
            logprobs = {"content": [e.model_dump() for e in entries]} if view.logprobs else None
            yield chunk([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
        if include_usage:
            yield chunk([], usage=_usage(len(prompt), done).model_dump(),
                        **({"prompt_token_ids": prompt} if return_token_ids else {}))
    except Exception as e:  # noqa: BLE001 — the status line is sent: the error goes in the stream
        yield _error_event(e)
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # (a client that left: its engine requests end now)
    yield "data: [DONE]\n\n"


async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) from all ``streams`` as their items come; the streams are closed on exit."""
    if len(streams) == 1:  # (the common case, without a task and a queue)
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(i: int, items: AsyncIterator[Any]) -> None:
        try:
            async for item in items:
                await queue.put((i, item))
            await queue.put((i, end))
        except Exception as e:  # noqa: BLE001 — handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each closes its engine request


def chat_stream_live(view: ChatView, streams: list[ChoiceStream], *, ident: str, created: int, model: str,
                     prompt: list[int], include_usage: bool, return_token_ids: bool) -> AsyncIterator[str]:
    """``chat_stream`` as the tokens are made (``tether.serve.streaming``)."""
    async def events() -> AsyncIterator[tuple[int, Any]]:
        async for i, item in _merged([choice_deltas(s, prompt, view) for s in streams]):
            if isinstance(item, Choice):
                yield i, item
            else:
                delta, which = item
                s = streams[i]
                yield i, (delta, view.token_entries(s.tokens, s.logprobs, which) if view.logprobs else [])

    return _chat_events(view, events(), len(streams), ident=ident, created=created, model=model, prompt=prompt,
                        include_usage=include_usage, return_token_ids=return_token_ids)


# ----------------------------------------------------------------------------------------------- completions


def _completion_logprobs(gen: Generator, c: Choice, k: int) -> CompletionLogprobs:
    tokens = [gen.token_text(t) for t in c.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(min(at, len(c.text)))
        at += len(t)
    top = None
    if k and c.top is not None:
        top = []
        for alternatives in c.top:
            row: dict[str, float] = {}
            for i, v in alternatives:  # two ids can decode to one string: keep the likelier
                row[gen.token_text(i)] = max(v, row.get(gen.token_text(i), float("-inf")))
            top.append(row)
    return CompletionLogprobs(tokens=tokens, token_logprobs=c.logprobs, top_logprobs=top, text_offset=offsets)


def _completion_choice(gen: Generator, index: int, c: Choice, prompt: list[int], logprobs: int | None,
                       return_token_ids: bool) -> CompletionChoice:
    return CompletionChoice(
        index=index, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        logprobs=None if logprobs is None else _completion_logprobs(gen, c, logprobs),
        prompt_token_ids=prompt if return_token_ids else None, token_ids=c.token_ids if return_token_ids else None,
        weight_versions=c.versions, num_preempted=c.num_preempted)


def completion_response(gen: Generator, choices: list[list[Choice]], prompts: list[list[int]], *, ident: str,
                        created: int, model: str, logprobs: int | None,
                        return_token_ids: bool) -> CompletionResponse:
    """Choice ``p * n + i`` is the i-th of prompt p, as OpenAI numbers a batch."""
    out = [_completion_choice(gen, p * len(run) + i, c, prompts[p], logprobs, return_token_ids)
           for p, run in enumerate(choices) for i, c in enumerate(run)]
    usage = _batch_usage(prompts, sum(len(c.token_ids) for run in choices for c in run))
    return CompletionResponse(id=ident, created=created, model=model, choices=out, usage=usage)


async def completion_stream(gen: Generator, runs: list[Coros], prompts: list[list[int]], *, n: int, ident: str,
                            created: int, model: str, logprobs: int | None, return_token_ids: bool,
                            include_usage: bool) -> AsyncIterator[str]:
    chunk = _chunker(ident, "text_completion", created, model)

    completion = 0
    try:
        async for p, i, c in _as_finished(runs):
            completion += len(c.token_ids)
            yield chunk([_completion_choice(gen, p * n + i, c, prompts[p], logprobs, return_token_ids).model_dump()])
        if include_usage:
            yield chunk([], usage=_batch_usage(prompts, completion).model_dump())
    except Exception as e:  # noqa: BLE001 — the status line is sent: the error goes in the stream
        yield _error_event(e)
    yield "data: [DONE]\n\n"


async def completion_stream_live(gen: Generator, streams: list[ChoiceStream], prompts: list[list[int]], *, n: int,
                                 ident: str, created: int, model: str, logprobs: bool, return_token_ids: bool,
                                 include_usage: bool) -> AsyncIterator[str]:
    """``completion_stream`` as the tokens are made: stream ``p * n + i`` is choice i of prompt p."""
    chunk = _chunker(ident, "text_completion", created, model)

    completion, offsets = 0, [0] * len(streams)
    try:
        items = _merged([choice_deltas(s, prompts[j // n], None) for j, s in enumerate(streams)])
        async for j, item in items:
            if isinstance(item, Choice):
                completion += len(item.token_ids)
                yield chunk([{"index": j, "text": "", "logprobs": None, "finish_reason": item.finish_reason,
                              "stop_reason": item.stop_reason, "weight_versions": item.versions,
                              "num_preempted": item.num_preempted,
                              **({"prompt_token_ids": prompts[j // n], "token_ids": item.token_ids}
                                 if return_token_ids else {})}])
                continue
            delta, which = item
            s, text = streams[j], delta.get("content", "")
            lp = None
            if logprobs:
                tokens = [gen.token_text(s.tokens[k]) for k in which]
                at = offsets[j]
                lp = {"tokens": tokens, "token_logprobs": [s.logprobs[k] for k in which], "top_logprobs": None,
                      "text_offset": [at + sum(map(len, tokens[:m])) for m in range(len(tokens))]}
            offsets[j] += len(text)
            yield chunk([{"index": j, "text": text, "logprobs": lp, "finish_reason": None}])
        if include_usage:
            yield chunk([], usage=_batch_usage(prompts, completion).model_dump())
    except Exception as e:  # noqa: BLE001 — the status line is sent: the error goes in the stream
        yield _error_event(e)
    yield "data: [DONE]\n\n"
