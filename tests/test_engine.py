"""LocalEngine: equal to HF generate / teacher forcing, sampling semantics, weight swaps, concurrency."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tether.engine import GenerationResult, InferenceEngine, SamplingParams
from tether.engine.forward import LlamaFamilyRunner
from tether.engine.local import LocalEngine
from tether.engine.prefix_cache import PrefixIndex, SlotTable, shared_prompt
from tether.engine.sampling import sample
from tether.learner import build_tiny, load_model_and_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
TEXTS = ["Hi", "Where is my order ORD-1234? It is late.",
         '{"name": "query_inventory", "arguments": {"sku_id": "SKU-77"}}', "refund " * 30,
         "<|im_start|>user\nIs SKU-1 in stock?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tok = load_model_and_tokenizer(build_tiny(tmp_path_factory.mktemp("tiny"), seed=0))
    return model, tok


@pytest.fixture
def engine(tiny):
    with LocalEngine(tiny[0]) as eng:
        yield eng


def run(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)

    async def main():
        return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(prompts, params)])
    return asyncio.run(main())


def hf_greedy(model, prompt, max_new, eos=None):
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), generation_config=cfg)[0, len(prompt):].tolist()


def teacher_forced_logprobs(model, prompt, tokens, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


# --- the hand-written forward -------------------------------------------------------------------------

def _small(kind):
    """Random 2-layer models of each supported family: Qwen2 (qkv bias, tied), Llama (all biases),
    Qwen3 (q/k norms, head_dim != hidden / heads)."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        if kind == "qwen2":
            return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()
        if kind == "llama":
            return LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True)).eval()
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32)).eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_fast_forward_matches_hf(kind):
    model = _small(kind)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 30, 17)]
    with torch.no_grad():
        ref = [model(torch.tensor([s + [5, 6]])).logits[0] for s in seqs]  # [len + 2, V]
    runner = LlamaFamilyRunner(model)
    with torch.inference_mode():
        # fresh prefill of prefixes into scattered slots, then extend to the full sequences
        runner.prefill([s[:-4] for s in seqs], [3, 4, 5])
        # extended by 4, 10 and 11 new tokens (packed), into slots out of order (the gathered-keys path)
        for src, dst, n in ((3, 0, 5), (4, 2, 20), (5, 1, 6)):
            runner.copy_prefix(src, dst, n)
        out = runner.prefill(seqs, [0, 2, 1], [5, 20, 6])
        assert max((out[i] - ref[i][len(s) - 1]).abs().max().item() for i, s in enumerate(seqs)) < 1e-5
        out = runner.decode([5, 5, 5])  # slots 0, 1, 2 hold seqs 0, 2, 1
        assert max((out[slot] - ref[i][len(seqs[i])]).abs().max().item() for slot, i in enumerate((0, 2, 1))) < 1e-5
        for src, dst in ((0, 3), (2, 0), (3, 2)):  # through free slot 3: slot 0 now holds seqs[1], slot 2 seqs[0]
            runner.move(src, dst)
        out = runner.decode([6, 6, 6])
        assert (out[0] - ref[1][-1]).abs().max().item() < 1e-5
        assert (out[2] - ref[0][-1]).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_decode_with_a_shared_prompt_matches_hf(kind):
    """Cascade attention: the common first 40 tokens' keys read once, from the first slot, for every query (the
    other slots' copies are overwritten with garbage to prove they are not read); the logits are HF's."""
    model = _small(kind)
    g = torch.Generator().manual_seed(2)
    common = torch.randint(0, 128, (40,), generator=g).tolist()
    seqs = [common + torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 20, 11, 1)]
    with torch.no_grad():
        ref = [model(torch.tensor([s + [7]])).logits[0, -1] for s in seqs]  # [V]
    runner = LlamaFamilyRunner(model)
    with torch.inference_mode():
        runner.prefill(seqs, [0, 1, 2, 3])
        for layer in (*runner.cache.k, *runner.cache.v):
            layer[1:4, :, :40] = 1e4  # slots 1-3's copies of the shared keys and values: never read
        out = runner.decode([7, 7, 7, 7], shared=40)
    assert max((out[i] - ref[i]).abs().max().item() for i in range(4)) < 1e-4


def test_decode_of_a_prompts_last_token_with_the_whole_prompt_shared():
    """A group's samples whose prompt is cached but its last token (fed by decode, no prefill): the prompts are all
    alike, so ``shared`` is their whole length, which reaches the token being decoded; decode reads at most the
    positions before it as shared (each slot's own part keeps the new token)."""
    model = _small("qwen2")
    prompt = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1]
    runner = LlamaFamilyRunner(model)
    with torch.inference_mode():
        runner.prefill([prompt[:-1]], [0])
        for dst in (1, 2):
            runner.copy_prefix(0, dst, len(prompt) - 1)
        out = runner.decode([prompt[-1]] * 3, shared=len(prompt))
    assert torch.isfinite(out).all() and (out - ref).abs().max().item() < 1e-4


def test_shared_prompt_is_the_common_prefix_of_the_running_prompts():
    def reqs(*prompts):
        return [SimpleNamespace(prompt=p) for p in prompts]

    base = list(range(100))
    assert shared_prompt(reqs(base + [1, 2], base + [3], base)) == 100
    assert shared_prompt(reqs(base, base[:70] + [0] * 30)) == 70  # bisected to the first difference
    assert shared_prompt(reqs(base, base[:20])) == 0  # below MIN_SHARED_PROMPT
    assert shared_prompt(reqs(base)) == 0  # one request: nothing to share


# --- LocalEngine vs HF ---------------------------------------------------------------------------------

def test_engine_implements_the_protocol(engine):
    assert isinstance(engine, InferenceEngine) and engine.version == 0


def test_greedy_equals_generate_concurrently(tiny, engine):
    model, tok = tiny
    eos = tok.eos_token_id
    prompts = [tok.encode(t) for t in TEXTS]
    results = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(eos,)))
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(model, p, 24, eos)
        assert r.finish_reason == ("stop" if r.token_ids[-1] == eos else "length")
        assert r.versions == [0] * len(r.token_ids) and r.num_preempted == 0


def test_logprobs_equal_teacher_forcing(tiny, engine):
    model, tok = tiny
    prompts = [tok.encode(t) for t in TEXTS[1:]]
    params = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, seed=1),
              SamplingParams(temperature=1.3, max_tokens=20, seed=2), SamplingParams(temperature=0.0, max_tokens=25),
              SamplingParams(temperature=1.0, top_p=0.5, max_tokens=15)]
    for p, sp, r in zip(prompts, params, run(engine, prompts, params)):
        assert len(r.token_ids) == len(r.logprobs) == sp.max_tokens
        ref = teacher_forced_logprobs(model, p, r.token_ids, sp.temperature or 1.0)
        assert (ref - torch.tensor(r.logprobs)).abs().max().item() < 1e-4


def test_stop_ids_and_max_tokens(tiny, engine):
    _, tok = tiny
    prompt = tok.encode(TEXTS[1])
    seeded = dict(temperature=1.0, seed=7)  # the random model's greedy text repeats one token
    free = run(engine, [prompt], SamplingParams(max_tokens=40, **seeded))[0].token_ids
    k = next(i for i in range(3, 40) if free[i] not in free[:i])  # first time this id appears
    stopped, capped, empty = run(engine, [prompt] * 3, [
        SamplingParams(max_tokens=40, stop_token_ids=(free[k], 99999), **seeded),
        SamplingParams(max_tokens=7, **seeded), SamplingParams(max_tokens=0)])
    assert stopped.token_ids == free[: k + 1] and stopped.finish_reason == "stop"
    assert capped.token_ids == free[:7] and capped.finish_reason == "length"
    assert empty.token_ids == [] and empty.finish_reason == "length"


def test_same_seed_same_tokens_whatever_the_batch(tiny, engine):
    _, tok = tiny
    me = (tok.encode(TEXTS[2]), SamplingParams(temperature=1.0, top_p=0.95, max_tokens=30, seed=123))
    alone = run(engine, [me[0]], [me[1]])[0]
    others = [(tok.encode(t), SamplingParams(temperature=t_, max_tokens=10 + 7 * i, seed=i))
              for i, (t, t_) in enumerate(zip(TEXTS * 2, [0.0, 1.0, 0.5, 2.0, 1.0] * 2))]
    crowd = run(engine, [p for p, _ in others] + [me[0]], [s for _, s in others] + [me[1]])[-1]
    assert crowd.token_ids == alone.token_ids
    reseeded = run(engine, [me[0]], [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=30, seed=124)])[0]
    assert reseeded.token_ids != alone.token_ids


def test_deterministic_results_are_bit_identical_whatever_the_batch_and_the_cache(tiny):
    """``deterministic=True``: a request's logprobs (not only its tokens) are the same bits alone, in a crowd
    arriving at staggered times (other step compositions, queueing beyond max_batch) and as the next turn of
    a cached conversation, because every request is computed on its own and nothing is reused."""
    model, tok = tiny
    me = (tok.encode(TEXTS[4] + TEXTS[1]), SamplingParams(temperature=1.0, top_p=0.95, max_tokens=30, seed=123))
    others = [(tok.encode(t), SamplingParams(temperature=t_, max_tokens=10 + 7 * i, seed=i))
              for i, (t, t_) in enumerate(zip(TEXTS * 2, [0.0, 1.0, 0.5, 2.0, 1.0] * 2))]

    async def staggered(engine):
        async def one(i, prompt, params):
            await asyncio.sleep(0.003 * (i % 4))
            return await engine.generate(prompt, params)
        jobs = [*others[:5], me, *others[5:]]
        return (await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(jobs))))[5]

    with LocalEngine(model, deterministic=True) as engine:
        alone = run(engine, [me[0]], [me[1]])[0]
    with LocalEngine(model, deterministic=True, max_batch=4) as engine:
        crowd = asyncio.run(staggered(engine))
        turn2 = me[0] + crowd.token_ids + tok.encode("<tool_response>\nok\n</tool_response>")
        second = run(engine, [turn2], [me[1]])[0]  # the default engine would extend the parked first turn
        assert engine.stats["cached_prompt_tokens"] == 0
    with LocalEngine(model, deterministic=True) as engine:
        second_alone = run(engine, [turn2], [me[1]])[0]
    assert (crowd.token_ids, crowd.logprobs) == (alone.token_ids, alone.logprobs)
    assert (second.token_ids, second.logprobs) == (second_alone.token_ids, second_alone.logprobs)


def test_tiny_top_p_is_greedy(tiny, engine):
    _, tok = tiny
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    greedy = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=15))
    nucleus = run(engine, prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=15, seed=5))
    assert [r.token_ids for r in greedy] == [r.token_ids for r in nucleus]


def test_sample_function_statistics():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(20000)
    tokens, logprobs = sample(logits, 2.0 * ones, ones, torch.rand(20000, generator=g))
    expected = torch.softmax(logits[0] / 2.0, -1)
    assert (torch.bincount(tokens, minlength=4) / 20000 - expected).abs().max() < 0.02
    assert torch.allclose(logprobs, expected.log()[tokens])
    # probs (T=1) are [.64, .24, .09, .03]: a top-p of 0.7 keeps tokens 0 and 1
    tokens, logprobs = sample(logits, ones, 0.7 * ones, torch.rand(20000, generator=g))
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(logprobs, torch.log_softmax(logits[0], -1)[tokens])  # before truncation
    tokens, _ = sample(logits[:3], torch.zeros(3), torch.ones(3), torch.rand(3, generator=g))  # greedy
    assert tokens.tolist() == [0, 0, 0]


def test_a_rows_sample_does_not_depend_on_the_other_rows():
    """Beside nucleus (top-p < 1) and greedy rows, a plain row draws what it draws alone (its cumulated weights in
    vocabulary order, not sorted because another row needed sorting)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(60, 50, generator=g) * 2
    temperature = torch.tensor([0.0, 0.7, 1.0] * 20)
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.5] * 15)
    uniform = torch.rand(60, generator=g)
    tokens, logprobs = sample(logits, temperature, top_p, uniform)
    for i in range(60):
        one = slice(i, i + 1)
        alone = sample(logits[one], temperature[one], top_p[one], uniform[one])
        assert int(alone[0]) == int(tokens[i]) and abs(float(alone[1]) - float(logprobs[i])) < 1e-6


# --- weights, concurrency, lifecycle --------------------------------------------------------------------

def _other_weights(model, seed=1):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        other = type(model)(model.config).eval()
    return other


def test_update_weights_between_requests(tiny):
    model, tok = tiny
    other = _other_weights(model, seed=1)
    prompt = tok.encode(TEXTS[1])
    with LocalEngine(_other_weights(model, seed=0)) as engine:  # updates load into its model
        before = run(engine, [prompt], GREEDY)[0]
        engine.update_weights(other.state_dict(), version=1)
        after = run(engine, [prompt], GREEDY)[0]
        assert engine.version == 1 and after.versions == [1] * 24
        assert after.token_ids == hf_greedy(other, prompt, 24) != before.token_ids
        with pytest.raises(KeyError, match="not in the model"):
            engine.update_weights({"no.such.weight": torch.zeros(1)}, version=2)
        assert engine.version == 1
        engine.update_weights(_other_weights(model, seed=0).state_dict(), version=2)  # back again
        assert run(engine, [prompt], GREEDY)[0].token_ids == before.token_ids


@pytest.mark.parametrize("recompute", [True, False])
def test_update_weights_mid_flight(tiny, recompute):
    model, tok = tiny
    old, new = _other_weights(model, seed=0), _other_weights(model, seed=1)
    prompt = tok.encode(TEXTS[4])
    engine = LocalEngine(_other_weights(model, seed=0), recompute_on_update=recompute)
    with engine:  # updates load into the engine's own model
        decode, calls = engine._runner.decode, [0]

        def decode_then_update(tokens, **kw):  # after 10 steps, another thread pushes new weights
            calls[0] += 1
            if calls[0] == 10:
                threading.Thread(target=engine.update_weights, args=(new.state_dict(), 7)).start()
            return decode(tokens, **kw)
        engine._runner.decode = decode_then_update
        r = run(engine, [prompt], SamplingParams(temperature=1.0, max_tokens=150, seed=3))[0]
    switch = r.versions.index(7)
    assert 10 <= switch < 150 and r.versions == [0] * switch + [7] * (150 - switch)
    assert r.num_preempted == int(recompute)
    if not recompute:  # the new weights continue from the old weights' cache: nothing to compare with
        return
    # tokens before the switch came from the old weights, the rest from the new ones over the full prefix
    lp = torch.tensor(r.logprobs)
    assert (teacher_forced_logprobs(old, prompt, r.token_ids) - lp)[:switch].abs().max() < 1e-4
    assert (teacher_forced_logprobs(new, prompt, r.token_ids) - lp)[switch:].abs().max() < 1e-4


def _push_during_decode(engine, pushes):
    """Wrap the engine's decode so that, at decode call k, another thread pushes weights (state_dict, version)."""
    decode, calls, threads = engine._runner.decode, [0], []

    def decode_and_push(tokens, **kw):
        calls[0] += 1
        for k, (state, version) in pushes.items():
            if calls[0] == k:
                threads.append(threading.Thread(target=engine.update_weights, args=(state, version)))
                threads[-1].start()
        return decode(tokens, **kw)
    engine._runner.decode = decode_and_push
    return threads


def test_without_partial_rollout_an_update_waits_for_the_running_generations(tiny):
    model, tok = tiny
    new = _other_weights(model, seed=1)
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    params = [SamplingParams(temperature=1.0, max_tokens=n, seed=i) for i, n in enumerate((40, 60, 80))]
    with LocalEngine(_other_weights(model, seed=0), partial_rollout=False) as engine:
        threads = _push_during_decode(engine, {5: (new.state_dict(), 1)})

        async def main():
            first = [asyncio.ensure_future(engine.generate(p, sp)) for p, sp in zip(prompts, params)]
            while not threads:  # the update is pending: a request arriving now waits for it
                await asyncio.sleep(0.001)
            late = await engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8))
            return await asyncio.gather(*first), late
        results, late = asyncio.run(main())
        threads[0].join()
    for r in results:  # each generation under the weights it started with, none interrupted
        assert r.versions == [0] * len(r.token_ids) and r.num_preempted == 0
    assert late.versions == [1] * 8 and late.token_ids == hf_greedy(new, prompts[0], 8)


@pytest.mark.parametrize("segment_length", [1, 6])
def test_segment_length_spaces_the_interruption_points(tiny, segment_length):
    model, tok = tiny
    v1, v2 = _other_weights(model, seed=1), _other_weights(model, seed=2)
    prompt = tok.encode(TEXTS[4])
    with LocalEngine(_other_weights(model, seed=0), segment_length=segment_length) as engine:
        # two pushes one decode step apart: the second waits for segment_length steps under version 1
        threads = _push_during_decode(engine, {10: (v1.state_dict(), 1), 11: (v2.state_dict(), 2)})
        r = run(engine, [prompt], SamplingParams(temperature=1.0, max_tokens=60, seed=3))[0]
        for t in threads:
            t.join()
    runs = [(v, r.versions.count(v)) for v in dict.fromkeys(r.versions)]
    assert [v for v, _ in runs] == [0, 1, 2] and r.num_preempted == 2
    assert r.versions == sorted(r.versions)  # one segment per version, in order
    assert dict(runs)[1] >= segment_length
    if segment_length > 1:
        assert dict(runs)[1] <= segment_length + 2  # applied at the first interruption point


def test_64_concurrent_requests_complete(tiny):
    model, tok = tiny
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 80, (72,), generator=g).tolist()
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(temperature=[0.0, 1.0][i % 2], max_tokens=5 + i % 31, seed=i) for i in range(72)]
    with LocalEngine(model, max_batch=48, max_prefill_tokens=512) as engine:
        results = run(engine, prompts, params)
        assert engine.stats["generated_tokens"] == sum(sp.max_tokens for sp in params)
    assert all(isinstance(r, GenerationResult) for r in results)
    assert [len(r.token_ids) for r in results] == [sp.max_tokens for sp in params]
    for i in (0, 2, 40):  # greedy ones still equal generate under queueing and batching
        assert results[i].token_ids == hf_greedy(model, prompts[i], params[i].max_tokens)


def test_prefix_cache_reuses_previous_turn_and_shared_prompts(tiny, engine):
    model, tok = tiny
    turn1 = tok.encode(TEXTS[4] + TEXTS[3])
    r1 = run(engine, [turn1], GREEDY)[0]
    turn2 = turn1 + r1.token_ids + tok.encode("<tool_response>\nok\n</tool_response>")
    before = engine.stats["cached_prompt_tokens"]
    r2 = run(engine, [turn2], GREEDY)[0]
    assert engine.stats["cached_prompt_tokens"] - before == len(turn1) + len(r1.token_ids) - 1  # all but new
    assert r2.token_ids == hf_greedy(model, turn2, 24)
    # siblings sharing a long prompt (a GRPO group) reuse each other's prompt cache
    group = [turn1 + tok.encode(f" sample {i}") for i in range(4)]
    before = engine.stats["cached_prompt_tokens"]
    results = run(engine, group, GREEDY)
    assert engine.stats["cached_prompt_tokens"] - before >= 4 * len(turn1)
    assert all(r.token_ids == hf_greedy(model, p, 24) for p, r in zip(group, results))
    # the same prompts again: cached but their last tokens, which are their first decode step's inputs (no prefill)
    steps, prefills = engine.stats["steps"], _count_prefills(engine)
    again = run(engine, group, GREEDY)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]
    assert _count_prefills(engine) == prefills and engine.stats["steps"] > steps


def _count_prefills(engine) -> int:
    """Prefill calls of the engine's runner so far (counted from the first call on)."""
    runner = engine._runner
    if not hasattr(runner, "prefill_calls"):
        runner.prefill_calls, prefill = 0, runner.prefill

        def counted(*args, **kwargs):
            runner.prefill_calls += 1
            return prefill(*args, **kwargs)

        runner.prefill = counted
    return runner.prefill_calls


def test_prefix_index_finds_longest_prefix():
    index = PrefixIndex()
    a, b = list(range(40)), list(range(35)) + [99] * 10
    index.add("a", a)
    index.add("b", b)
    assert index.best(list(range(50))) == ("a", 40)
    assert index.best(list(range(36)) + [7]) == ("a", 36)
    assert index.best(list(range(35)) + [99, 99, 5]) == ("b", 37)
    assert index.best([1, 2, 3]) == (None, 0)
    index.remove("a")
    assert index.best(list(range(50))) == ("b", 35)


def test_hf_fallback_matches_generate(tiny):
    model, tok = tiny
    prompts = [tok.encode(t) for t in TEXTS[:3]]
    with LocalEngine(model, fast_path=False) as engine:
        results = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=12))
        sampled = run(engine, prompts[:1], SamplingParams(temperature=1.0, max_tokens=12, seed=4))[0]
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 12) for p in prompts]
    ref = teacher_forced_logprobs(model, prompts[0], sampled.token_ids)
    assert (ref - torch.tensor(sampled.logprobs)).abs().max() < 1e-4


def test_a_step_that_fails_while_admitting_fails_those_requests_not_the_engine(tiny, monkeypatch):
    """A request taken from the queue whose placement raises gets the error (it never hangs), and the engine goes on."""
    model, tok = tiny
    prompt = tok.encode(TEXTS[1])
    engine = LocalEngine(model)
    place = SlotTable.place
    calls = []

    def place_once_broken(self, req, entry, n):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("placement broke")
        return place(self, req, entry, n)

    monkeypatch.setattr(SlotTable, "place", place_once_broken)

    async def two():
        with pytest.raises(RuntimeError, match="placement broke"):
            await asyncio.wait_for(engine.generate(prompt, GREEDY), timeout=30)
        return await asyncio.wait_for(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4)), 30)
    try:
        assert len(asyncio.run(two()).token_ids) == 4
    finally:
        engine.close()


def test_cancel_close_and_errors(tiny):
    model, tok = tiny
    prompt = tok.encode(TEXTS[1])
    engine = LocalEngine(model)

    async def cancel_one():
        slow = asyncio.create_task(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3000)))
        await asyncio.sleep(0.05)
        slow.cancel()
        quick = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5))
        with pytest.raises(asyncio.CancelledError):
            await slow
        return quick
    assert len(asyncio.run(cancel_one()).token_ids) == 5
    with pytest.raises(ValueError, match="empty"):
        run(engine, [[]], GREEDY)
    with pytest.raises(ValueError, match="positions"):
        run(engine, [[1] * 5000], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        run(engine, [prompt], SamplingParams(top_p=0.0))

    async def close_while_running():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3000)))
        generated = engine.stats["generated_tokens"]
        while engine.stats["generated_tokens"] == generated:  # wait until it is running
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engine.close)
        return await task
    aborted = asyncio.run(close_while_running())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 3000
    with pytest.raises(RuntimeError, match="closed"):
        run(engine, [prompt], GREEDY)


def test_slot_copies_skip_the_tokens_the_destination_holds_and_leave_the_same_cache():
    """A KV copy skips the positions whose tokens the destination slot's memory already holds, under the same weights
    (a freed slot keeps what its last owner held). Driven through the same turns, parkings and compactions, a table
    that skips and one that copies everything hold the same keys and values to the bit and decode the same logits;
    the skipping one copies a fraction of the positions. After a weight change nothing is skipped from memory."""
    model = _small("qwen2")
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 128, (40,), generator=g).tolist()

    class FullCopies(SlotTable):
        def _common(self, src, dst, n):
            return 0

    copied = {"skip": 0, "full": 0}
    tables = {}
    for name, cls in (("skip", SlotTable), ("full", FullCopies)):
        runner = LlamaFamilyRunner(model)
        copy = runner.cache.copy_prefix

        def counted(src, dst, n, keep=0, copy=copy, name=name):
            copied[name] += n - keep
            return copy(src, dst, n, keep)

        runner.cache.copy_prefix = counted
        tables[name] = (cls(runner, max_parked=4), runner)

    class Request:  # as the engine's: its cache holds prompt + tokens[:-1]
        def __init__(self, prompt):
            self.prompt, self.tokens = prompt, []

    def admit(prompts):
        for table, runner in tables.values():
            new = [Request(p) for p in prompts]
            first = len(table.running)
            starts = [table.place(r, *table.lookup(r.prompt)) for r in new]
            logits = runner.prefill([r.prompt for r in new], list(range(first, first + len(new))), starts)
            for r, tok in zip(new, logits.argmax(-1).tolist()):
                r.tokens.append(tok)
                table.index(r)

    def decode(steps):
        out = {}
        for _ in range(steps):
            for name, (table, runner) in tables.items():
                feed = [r.tokens[-1] for r in table.running]
                out[name] = runner.decode(feed, shared=shared_prompt(table.running))
                for r, tok in zip(table.running, out[name].argmax(-1).tolist()):
                    r.tokens.append(tok)
            assert torch.equal(out["skip"], out["full"])

    def retire(which):
        for table, _ in tables.values():
            table.retire([i in which for i in range(len(table.running))], park=[True] * len(table.running))

    def same_cache():
        (ts, rs), (tf, rf) = tables["skip"], tables["full"]
        for a, b in zip(ts.running, tf.running):
            i, j = ts._slot[a], tf._slot[b]
            n = int(rs.cache.lengths[i])
            assert n == int(rf.cache.lengths[j]) and (a.prompt, a.tokens) == (b.prompt, b.tokens)
            assert torch.equal(rs.cache.store[:, i, :, :n], rf.cache.store[:, j, :, :n])

    with torch.inference_mode():
        tasks = [system + torch.randint(0, 128, (12 + 5 * t,), generator=g).tolist() for t in range(3)]
        admit([tasks[t % 3] for t in range(6)])  # two samples of each task
        decode(4)
        retire({0, 2, 3})  # holes filled from the tail, parked caches moved out of the way
        same_cache()
        turns = [p.tokens + [9, 9] for p in list(tables["skip"][0]._parked)][:2]  # next turns of parked conversations
        admit(turns + [tasks[0] + [1]])
        decode(3)
        same_cache()
        retire({1, 3})
        admit([tasks[2] + [4, 4], system + [8] * 20])
        decode(2)
        same_cache()
        assert copied["skip"] < 0.6 * copied["full"]
        # new weights: what the free slots' memory holds is from the old ones, so nothing is skipped from it
        for table, runner in tables.values():
            table.drop_prefixes(running_too=True)
            table.retire([True] * len(table.running), park=[False] * len(table.running))
            runner.reload()
        admit([tasks[0]])
        before = dict(copied)
        admit([tasks[0] + [3]])  # its prompt copied from slot 0 into slot 1, which held the system prompt and more
        assert copied["skip"] - before["skip"] == copied["full"] - before["full"] == len(tasks[0])
