"""Incremental streaming: the engine's token stream and `tether serve`'s deltas as the tokens are made.

Streamed and unstreamed answers of the same seeded request are compared field by field (text, logprobs, finish and
stop reasons, token ids), with stop strings, min_tokens and include_stop_str_in_output; arrival times show the text
coming while the choice is still being generated; a scripted engine that yields one token at a time shows a tool
call's id and name arriving before its arguments end.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time

import pytest

from test_serve import ASK, TOOLS, client, serving, streamed_calls
from tether.engine.base import GenerationResult, SamplingParams, TokenDelta, stream_generation
from tether.engine.local import LocalEngine
from tether.engine.scripted import ScriptedEngine
from tether.learner.model import load_model_and_tokenizer
from tether.serve.streaming import Pace


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model_and_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def server(loaded):
    model, tokenizer = loaded
    with LocalEngine(copy.deepcopy(model)) as engine, serving(engine, tokenizer) as s:
        s.engine = engine
        yield s


def test_the_engine_tells_each_steps_tokens_and_ends_with_generates_result(loaded):
    model, _ = loaded
    params = SamplingParams(temperature=1.0, max_tokens=400, seed=3)

    async def main(engine):
        whole = await engine.generate([5, 6, 7, 8], params)
        items = [item async for item in engine.stream([5, 6, 7, 8], params)]
        # closing the stream early aborts the request: the engine runs nothing afterwards
        stream = engine.stream([5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=400, seed=1))
        first = await stream.__anext__()
        await stream.aclose()
        return whole, items, first

    with LocalEngine(copy.deepcopy(model)) as engine:
        whole, items, first = asyncio.run(main(engine))
        time.sleep(0.2)
        assert not engine._slots.running and not engine._queue
    deltas, result = items[:-1], items[-1]
    assert isinstance(result, GenerationResult) and all(isinstance(d, TokenDelta) for d in deltas)
    # one per decode step, or a few steps' tokens together when the caller is slower than the engine (a busy host)
    assert len(deltas) >= 5 and len(deltas[0].token_ids) < 100
    assert [t for d in deltas for t in d.token_ids] == result.token_ids == whole.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == result.logprobs == whole.logprobs
    assert isinstance(first, TokenDelta) and 1 <= len(first.token_ids) < 400


def test_a_paced_stream_wakes_its_caller_every_k_tokens_with_the_same_tokens(loaded):
    """``every``: the engine wakes the caller at the first token, then once ``every()`` tokens are new, then at the
    end; the tokens and logprobs are generate's."""
    model, _ = loaded
    params = SamplingParams(temperature=1.0, max_tokens=60, seed=5)

    async def main(engine):
        whole = await engine.generate([5, 6, 7, 8], params)
        items = [item async for item in stream_generation(engine, [5, 6, 7, 8], params, every=lambda: 4)]
        return whole, items

    with LocalEngine(copy.deepcopy(model)) as engine:
        whole, items = asyncio.run(main(engine))
    deltas, result = items[:-1], items[-1]
    # woken at token 1 (its step's decode may add token 2 before the wake), then at tokens 5, 9, ..., 57, and at the
    # end: at most 16 deltas where an unpaced stream has one a step (59 on an idle host)
    assert 2 <= len(deltas) <= 16, [len(d.token_ids) for d in deltas]
    assert [t for d in deltas for t in d.token_ids] == result.token_ids == whole.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == whole.logprobs


def test_text_arrives_while_the_choice_is_being_generated(server):
    kw = dict(model="tiny", messages=ASK, max_tokens=300, temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    start, arrivals, text = time.perf_counter(), [], ""
    for ch in client(server).chat.completions.create(**kw, stream=True):
        if ch.choices and ch.choices[0].delta.content:
            arrivals.append(time.perf_counter() - start)
            text += ch.choices[0].delta.content
    total = time.perf_counter() - start
    print(f"\n300 tokens: first content at {arrivals[0]:.3f} s of {total:.3f} s, {len(arrivals)} content chunks")
    assert len(arrivals) >= 20  # not the whole text at the end (steps come together on a busy host)
    assert arrivals[0] < 0.5 * total and arrivals[len(arrivals) // 2] < 0.85 * total  # spread over the generation
    assert text == client(server).chat.completions.create(**kw).choices[0].message.content


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_streamed_equals_unstreamed_with_stops_min_tokens_and_include_stop(server, seed):
    c = client(server)
    base = c.completions.create(model="tiny", prompt="Where is my order", max_tokens=40, temperature=1.0,
                                seed=seed).choices[0].text
    stops = [base[len(base) // 3:][:2], base[2 * len(base) // 3:][:3]]  # strings the choice contains
    for extra in ({}, {"include_stop_str_in_output": True}, {"min_tokens": 12}, {"skip_special_tokens": False}):
        kw = dict(model="tiny", prompt="Where is my order", max_tokens=40, temperature=1.0, seed=seed,
                  stop=stops, logprobs=0, extra_body={"return_token_ids": True, **extra})
        full = c.completions.create(**kw).choices[0]
        chunks = [ch for ch in c.completions.create(**kw, stream=True) if ch.choices]
        assert "".join(ch.choices[0].text for ch in chunks) == full.text, extra
        streamed_lps = [lp for ch in chunks if ch.choices[0].logprobs for lp in ch.choices[0].logprobs.token_logprobs]
        assert streamed_lps == pytest.approx(full.logprobs.token_logprobs[:len(streamed_lps)], abs=0)
        last = chunks[-1].choices[0]
        assert (last.finish_reason, last.model_extra["stop_reason"]) == (full.finish_reason,
                                                                         full.model_extra["stop_reason"])
        assert last.model_extra["token_ids"] == full.model_extra["token_ids"]


def test_a_stop_string_ends_the_engine_request_at_once(server):
    c = client(server)
    kw = dict(model="tiny", prompt="Where is my order", max_tokens=200, temperature=1.0, seed=9,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    base = c.completions.create(**kw).choices[0]
    stop = base.text[10:13]
    before = server.engine.stats["generated_tokens"]
    chunks = [ch for ch in c.completions.create(**kw, stop=[stop], stream=True) if ch.choices]
    generated = server.engine.stats["generated_tokens"] - before
    assert "".join(ch.choices[0].text for ch in chunks) == base.text[:base.text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert generated < 60  # the unstreamed request generates all 200 and cuts the text afterwards


class TricklingEngine(ScriptedEngine):
    """A ScriptedEngine that tells its tokens one at a time, ``pause`` seconds apart."""

    pause = 0.02

    async def stream(self, prompt_ids, params):
        result = await self.generate(prompt_ids, params)
        for k in range(len(result.token_ids)):
            await asyncio.sleep(self.pause)
            yield TokenDelta(result.token_ids[k:k + 1], result.logprobs[k:k + 1], result.versions[k:k + 1])
        yield result


CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_order_status", "arguments": {"order_id": "O-1234"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_order_status", "arguments": {"order_id": "O-99"}}\n</tool_call>')


def test_tool_calls_are_streamed_name_first_then_their_arguments(loaded):
    _, tokenizer = loaded
    engine = TricklingEngine(tokenizer, [CALLS, CALLS], logprob=-0.5, version=2)
    with serving(engine, tokenizer) as s:
        c = client(s)
        full = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, logprobs=True).choices[0]
        start, timeline = time.perf_counter(), []
        chunks = []
        for ch in c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True, logprobs=True):
            chunks.append(ch)
            timeline.append(time.perf_counter() - start)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == full.message.content == "Let me check both."
    calls = streamed_calls(chunks)
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == [
        (call.function.name, json.loads(call.function.arguments)) for call in full.message.tool_calls]
    argument_deltas = [(t, tc.index) for t, ch in zip(timeline, chunks) if ch.choices
                       for tc in ch.choices[0].delta.tool_calls or [] if tc.id is None]
    named = [t for t, ch in zip(timeline, chunks) if ch.choices
             for tc in ch.choices[0].delta.tool_calls or [] if tc.id]
    assert len([1 for _, k in argument_deltas if k == 0]) >= 3  # the arguments grow over several deltas
    assert named[0] < argument_deltas[0][0] and named[1] > argument_deltas[0][0]  # call 1 told before call 2 exists
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed_lps = [e.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                    for e in ch.choices[0].logprobs.content]
    assert streamed_lps == [e.logprob for e in full.logprobs.content] == [-0.5] * (len(full.logprobs.content))


@pytest.mark.parametrize("interval", [4, 16])
def test_stream_interval_sends_fewer_chunks_with_the_same_text_and_logprobs(loaded, interval):
    _, tokenizer = loaded
    text = "Your order O-1234 shipped on Monday and should arrive by Friday; the tracking number is in your email."
    n = len(tokenizer.encode(text, add_special_tokens=False)) + 1  # + the end-of-turn id
    runs = []
    for every in (1, interval):
        engine = TricklingEngine(tokenizer, [text], logprob=-0.25)
        engine.pause = 0.002
        with serving(engine, tokenizer, stream_interval=every) as s:
            chunks = [ch for ch in client(s).chat.completions.create(model="tiny", messages=ASK, stream=True,
                                                                      logprobs=True) if ch.choices]
        runs.append(([ch.choices[0].delta.content for ch in chunks if ch.choices[0].delta.content],
                     [e.logprob for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]))
    (fine, fine_lps), (few, few_lps) = runs
    assert "".join(fine) == "".join(few) == text
    assert fine_lps == few_lps == [-0.25] * (n - 1)  # the end-of-turn id is not shown
    # the first delta at once, then one per `interval` tokens
    assert len(fine) == n - 1 and len(few) <= 2 + (n - 1) // interval


@pytest.mark.parametrize("interval, streaming, expected", [
    (None, 0, 1), (None, 1, 1), (None, 16, 1), (None, 17, 2), (None, 64, 4), (None, 129, 8), (None, 1000, 8),
    (3, 1000, 3), (1, 64, 1)])
def test_the_pace_of_a_stream_follows_how_many_choices_stream(interval, streaming, expected):
    assert Pace(interval, streaming=streaming).tokens() == expected
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        Pace(0)


@pytest.mark.parametrize("stops", [[], ["Friday"]])
def test_the_engine_is_paced_unless_stop_strings_are_watched(loaded, monkeypatch, stops):
    """A stop string's match must end the engine request at once, so a choice that watches some is woken every step."""
    from tether.serve import streaming
    from tether.serve.generation import Generator

    _, tokenizer = loaded
    seen = []

    def fake(engine, prompt, params, group=None, every=None):
        seen.append(every)
        return stream_generation(engine, prompt, params)

    monkeypatch.setattr(streaming, "stream_generation", fake)
    pace = Pace(None, streaming=63)
    gen = Generator(TricklingEngine(tokenizer, ["Shipped, arrives Friday."]), tokenizer)
    stream = streaming.ChoiceStream(gen, SamplingParams(max_tokens=20), stops, False, False, pace=pace)

    async def main():
        return [item async for item in streaming.choice_deltas(stream, [5, 6], None)]

    asyncio.run(main())
    assert seen == ([None] if stops else [pace.tokens]) and pace.streaming == 63  # (this choice counted while it ran)
    assert pace.tokens() == 4  # 63 others streaming


def test_auto_pacing_tells_one_stream_every_token_and_many_streams_fewer_chunks(loaded):
    """auto (the default): one choice alone gets a chunk a token, as ``--stream-interval 1``; 40 choices streaming
    at once get ⌈40 / 16⌉ = 3 tokens a chunk after the first, with the same text."""
    _, tokenizer = loaded
    text = "Your order O-1234 shipped on Monday and should arrive by Friday; the tracking number is in your email."
    shown = len(tokenizer.encode(text, add_special_tokens=False))  # (+ the end-of-turn id, not shown)

    def chunks_per_choice(n: int, interval: int | None) -> list[list[str]]:
        engine = TricklingEngine(tokenizer, [text] * n)
        engine.pause = 0.002
        per: list[list[str]] = [[] for _ in range(n)]
        with serving(engine, tokenizer, stream_interval=interval) as s:
            for ch in client(s).chat.completions.create(model="tiny", messages=ASK, stream=True, n=n):
                for c in ch.choices:
                    if c.delta.content:
                        per[c.index].append(c.delta.content)
        return per

    (alone,) = chunks_per_choice(1, None)
    assert "".join(alone) == text and len(alone) == shown
    for interval, most in ((1, shown), (None, 2 + (shown - 1) // 3)):
        per = chunks_per_choice(40, interval)
        assert all("".join(p) == text for p in per)
        assert max(len(p) for p in per) <= most and (interval != 1 or min(len(p) for p in per) == shown)
