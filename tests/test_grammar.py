"""Grammar-constrained decoding in the LocalEngine (tether.engine.grammar): the mask, the stop, the logprobs."""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import threading

import pytest
import torch

from tether.agent.parsers import get_parser
from tether.engine import SamplingParams
from tether.engine.grammar import GrammarError, Grammars, ToolSpec
from tether.engine.local import LocalEngine
from tether.learner import load_model_and_tokenizer

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^O-[0-9]{4}$"},
                                           "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["order_id", "quantity"]}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return load_model_and_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def grammars(tiny):
    model, tok = tiny
    return Grammars(tok, model.get_output_embeddings().weight.shape[0])


@pytest.fixture(scope="module", params=["fast", "hf"])
def engine(request, tiny):
    with LocalEngine(tiny[0], fast_path=request.param == "fast") as eng:
        yield eng


def run(engine, prompts, params):
    async def main():
        return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(prompts, params)])
    return asyncio.run(main())


def logits_after(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()  # [V]


def allowed_after(grammar, stop, tokens):
    """The token ids the grammar allows after ``tokens`` (a fresh matcher advanced through them)."""
    m = grammar.matcher(stop)
    for t in tokens:
        m.accept(t)
    row = torch.zeros(1, grammar.vocab_size)
    m.mask(row)
    return set((row[0] == 0).nonzero().squeeze(1).tolist())


def test_greedy_constrained_decoding_is_the_argmax_over_the_allowed_tokens(tiny, grammars, engine):
    model, tok = tiny
    stop = (tok.convert_tokens_to_ids("<|im_end|>"),)
    g = grammars.json_schema(SCHEMA, strict=True)
    prompt = tok.encode("Where is my order O-1234? Reply in JSON.")
    free = run(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=stop)])[0]
    out = run(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=stop,
                                                constraint=g)])[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop[0]
    value = json.loads(tok.decode(out.token_ids[:-1]))
    assert set(value) == {"order_id", "quantity"} and 1 <= value["quantity"] <= 9
    assert len(value["order_id"]) == 6 and value["order_id"].startswith("O-")
    assert free.token_ids[:3] != out.token_ids[:3]  # unconstrained, the tiny model writes no JSON
    # By hand, step 0: the compact grammar allows only the tokens that open an object ('{' and '{"')
    first = allowed_after(g, stop, [])
    assert first and {tok.decode([i]) for i in first} <= {"{", '{"'}
    # ...and the next steps: properties in the schema's order, json.dumps' separators, the pattern's "O-"
    head = '{"order_id": "O-'
    for k in range(1, 4):
        text = tok.decode(out.token_ids[:k])
        assert head.startswith(text)
        for i in allowed_after(g, stop, out.token_ids[:k]):
            more = text + tok.decode([i])
            assert head.startswith(more) or more.startswith(head), (k, more)
    for t in range(len(out.token_ids)):  # every step: the argmax of the model's logits over what the grammar allows
        allowed = sorted(allowed_after(g, stop, out.token_ids[:t]))
        logits = logits_after(model, prompt + out.token_ids[:t])
        assert out.token_ids[t] == allowed[int(logits[allowed].argmax())], t
    # the recorded logprob is the unmasked model's (tether.engine.base): below 0 where the mask left one token
    with torch.no_grad():
        full = model(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].float()
    model_lp = torch.log_softmax(full, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert (model_lp - torch.tensor(out.logprobs)).abs().max() < 1e-4
    assert max(out.logprobs) < -0.5  # not the masked distribution's (1.0 where a single token was allowed)


def test_sampled_constrained_outputs_follow_the_schema_and_share_a_batch_with_free_rows(tiny, grammars, engine):
    model, tok = tiny
    stop = (tok.convert_tokens_to_ids("<|im_end|>"),)
    g = grammars.json_schema(SCHEMA, strict=True)
    prompt = tok.encode("Order status, please.")
    free = [SamplingParams(temperature=1.0, max_tokens=30, seed=i, stop_token_ids=stop) for i in range(4)]
    alone = run(engine, [prompt] * 4, free)
    mixed = run(engine, [prompt] * 12, free + [SamplingParams(temperature=1.0, max_tokens=60, seed=i,
                                                              stop_token_ids=stop, constraint=g) for i in range(8)])
    assert [r.token_ids for r in mixed[:4]] == [r.token_ids for r in alone]  # the free rows draw as they do alone
    values = [json.loads(tok.decode(r.token_ids[:-1])) for r in mixed[4:]]
    assert all(r.finish_reason == "stop" for r in mixed[4:])
    assert all(set(v) == {"order_id", "quantity"} and 1 <= v["quantity"] <= 9 for v in values)
    assert len({json.dumps(v) for v in values}) > 1  # sampled, not one greedy answer


def test_a_tool_call_grammar_writes_hermes_blocks_of_the_given_tools(tiny, grammars, engine):
    _, tok = tiny
    stop = (tok.convert_tokens_to_ids("<|im_end|>"),)
    tools = [ToolSpec("get_order_status", SCHEMA), ToolSpec("cancel", {"type": "object", "properties": {
        "reason": {"type": "string", "enum": ["late", "wrong"]}}, "required": ["reason"]})]
    g = grammars.tool_calls(tools, required=True, parallel=False)
    outs = run(engine, [tok.encode("Help!")] * 6,
               [SamplingParams(temperature=1.0, max_tokens=80, seed=i, stop_token_ids=stop, constraint=g)
                for i in range(6)])
    for r in outs:
        turn = get_parser("hermes")(tok.decode(r.token_ids[:-1]))
        assert not turn.errors and len(turn.calls) == 1 and turn.content == ""
        call = turn.calls[0]
        assert call.name in {"get_order_status", "cancel"}
        assert call.arguments.get("reason") in {"late", "wrong"} or 1 <= call.arguments["quantity"] <= 9


def test_bad_requests_are_refused_naming_the_problem(tiny, grammars, engine):
    _, tok = tiny
    g = grammars.json_object()
    with pytest.raises(ValueError, match="stop_token_ids"):
        run(engine, [[1, 2]], [SamplingParams(constraint=g)])
    with pytest.raises(ValueError, match="min_tokens"):
        run(engine, [[1, 2]], [SamplingParams(constraint=g, stop_token_ids=(2,), min_tokens=3)])
    with pytest.raises(GrammarError, match="strin"):
        grammars.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}, strict=True)
    with pytest.raises(GrammarError, match="parameters of tool 'x'"):
        grammars.tool_calls([ToolSpec("x", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})],
                            required=True, parallel=False)


def test_without_xgrammar_a_constrained_request_names_the_extra(tiny, monkeypatch):
    model, tok = tiny
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(RuntimeError, match=r"tether\[grammar\]"):
        Grammars(tok, 2048).json_object()


def test_a_constrained_request_interrupted_by_fair_admission_resumes_in_its_grammar(tiny, grammars):
    model, tok = tiny
    stop = (tok.convert_tokens_to_ids("<|im_end|>"),)
    g = grammars.tool_calls([ToolSpec("get_order_status", SCHEMA)], required=True, parallel=True)
    heavy = [SamplingParams(temperature=1.0, max_tokens=150, seed=i, stop_token_ids=stop, constraint=g)
             for i in range(8)]
    small = SamplingParams(temperature=1.0, max_tokens=8, seed=99)
    prompt, other = tok.encode("Where is my order O-1234?"), tok.encode("Hello")

    full = threading.Event()  # the heavy group holds every slot (its requests may be admitted over several steps)
    gate = threading.Event()  # the worker waits there until the small one is queued

    async def contended(engine):
        tasks = [asyncio.ensure_future(engine.generate(prompt, p, group="heavy")) for p in heavy]
        while not full.is_set():
            await asyncio.sleep(0.001)
        small_task = asyncio.ensure_future(engine.generate(other, small, group="small"))
        await asyncio.sleep(0)  # it is queued before any heavy call can end (on a loaded machine too)
        gate.set()
        await small_task
        return await asyncio.gather(*tasks)

    with LocalEngine(copy.deepcopy(model), max_batch=8) as engine:
        step = engine._step

        def gated_step():
            step()
            if len(engine._slots.running) == 8:  # (a slot left free would take the small one without interrupting)
                full.set()
                assert gate.wait(30)

        engine._step = gated_step
        got = asyncio.run(contended(engine))
        interruptions = engine.stats["fair_interruptions"]
    with LocalEngine(copy.deepcopy(model), max_batch=8) as engine:
        want = run(engine, [prompt] * 8, heavy)
    assert interruptions >= 1 and sum(r.num_preempted for r in got) == interruptions
    assert [r.token_ids for r in got] == [r.token_ids for r in want]  # the same draws, in the same grammar
    for r in got:  # every token one the grammar allowed where it was drawn
        m = g.matcher(stop)
        for t in r.token_ids:
            m.accept(t)
