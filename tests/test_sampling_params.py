"""The engine's sampling parameters (issue 29, item 5): top_k, min_p, repetition / presence / frequency penalties,
min_tokens and logit_bias — hand-computed distributions, their semantics in LocalEngine (fast and HF fallback
path), batching that leaves a row's tokens alone, the remote request body and the ``engine.*`` keys of a run."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from tether.engine import SamplingParams
from tether.engine.local import LocalEngine
from tether.engine.remote import shaping_fields
from tether.engine.sampling import sample, shape_logits
from tether.learner import load_model_and_tokenizer

# probabilities 0.5, 0.25, 0.15, 0.10
PROBS = torch.tensor([0.5, 0.25, 0.15, 0.10])
LOGITS = PROBS.log()
GRID = 20_000  # uniforms (i + 0.5) / GRID: the share of them that picks a token is its probability, to 1 / GRID


def drawn(logits: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
          min_p: float = 0.0, shaped: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution ``sample`` draws one row from (over a grid of uniforms) and the logprobs it records [V]."""
    n, v = GRID, logits.shape[0]
    rows = logits.expand(n, v)
    uniform = (torch.arange(n) + 0.5) / n
    extra: dict = {}
    if top_k or min_p:
        extra.update(top_k=torch.full((n,), top_k), min_p=torch.full((n,), min_p))
    if shaped is not None:
        extra["shaped"] = (torch.arange(n), shaped.expand(n, v))
    tokens, logprobs = sample(rows, torch.full((n,), temperature), torch.full((n,), top_p), uniform, **extra)
    recorded = torch.full((v,), float("nan"))
    recorded[tokens] = logprobs
    return torch.bincount(tokens, minlength=v).float() / n, recorded


def close(a: torch.Tensor, b: list[float], tol: float = 1e-3) -> bool:
    return bool((a - torch.tensor(b)).abs().max() < tol)


# ----------------------------------------------------------------------------- the sampler, by hand


def test_top_k_and_min_p_keep_the_hand_computed_tokens():
    assert close(drawn(LOGITS)[0], [0.5, 0.25, 0.15, 0.10])
    assert close(drawn(LOGITS, top_k=2)[0], [2 / 3, 1 / 3, 0, 0])  # 0.5 and 0.25, renormalised
    assert close(drawn(LOGITS, top_k=9)[0], [0.5, 0.25, 0.15, 0.10])  # k past the vocabulary: all kept
    # min_p 0.25: threshold 0.25 × 0.5 = 0.125 drops 0.10; min_p 0.4: threshold 0.2 drops 0.15 too
    assert close(drawn(LOGITS, min_p=0.25)[0], [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])
    assert close(drawn(LOGITS, min_p=0.4)[0], [2 / 3, 1 / 3, 0, 0])
    # top-p over the mass top-k kept (vLLM's order): top_k 3 keeps 0.9; of it, 0.5 + 0.25 = 0.833 >= 0.8 already
    assert close(drawn(LOGITS, top_k=3, top_p=0.8)[0], [2 / 3, 1 / 3, 0, 0])
    assert close(drawn(LOGITS, top_p=0.8)[0], [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0])  # alone: 0.75 < 0.8 before it
    # min-p compares probabilities after temperature: at T = 2 they are ∝ sqrt(p) = .707, .5, .387, .316, and
    # threshold 0.5 × .707 = .354 drops the last
    s = torch.tensor([0.5, 0.25, 0.15]).sqrt()
    assert close(drawn(LOGITS, temperature=2.0, min_p=0.5)[0], [*(s / s.sum()).tolist(), 0])


def test_truncation_leaves_the_recorded_logprob_the_whole_distributions():
    _, recorded = drawn(LOGITS, top_k=2, min_p=0.1)
    assert close(recorded[:2], [math.log(0.5), math.log(0.25)], 1e-6)  # not log(2/3), log(1/3)
    _, at_t2 = drawn(LOGITS, temperature=2.0, top_k=1)
    assert close(at_t2[:1], [math.log(0.5 ** 0.5 / PROBS.sqrt().sum().item())], 1e-6)  # log_softmax(logits / 2)


def test_shape_logits_by_hand():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0], [2.0, 1.0, -1.0, 0.0]])
    seen = torch.tensor([[True, False, True, False]])
    # repetition 2 on the seen tokens 0 (2 > 0: / 2) and 2 (-1 < 0: × 2); row 1 is not penalised
    out = shape_logits(logits, repetition=(torch.tensor([0]), torch.tensor([2.0]), seen))
    assert out.tolist() == [[1.0, 1.0, -2.0, 0.0], [2.0, 1.0, -1.0, 0.0]]
    # presence 0.5 and frequency 0.25 over output counts [3, 1, 0, 0]: − [0.25·3 + 0.5, 0.25 + 0.5, 0, 0]
    counts = (torch.tensor([1]), torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([[3.0, 1.0, 0.0, 0.0]]))
    assert shape_logits(logits, counts=counts).tolist() == [[2.0, 1.0, -1.0, 0.0], [0.75, 0.25, -1.0, 0.0]]
    # bias: token 1 + 1.5 and token 3 − 2 in row 0, token 2 + 100 in row 1; min_tokens bans token 0 of row 1
    bias = (torch.tensor([0, 0, 1]), torch.tensor([1, 3, 2]), torch.tensor([1.5, -2.0, 100.0]))
    out = shape_logits(logits, bias=bias, banned=(torch.tensor([1]), torch.tensor([0])))
    assert out.tolist() == [[2.0, 2.5, -1.0, -2.0], [float("-inf"), 1.0, 99.0, 0.0]]
    assert logits.tolist()[0] == [2.0, 1.0, -1.0, 0.0]  # a new tensor


def test_shaped_rows_draw_from_the_shaped_logits_and_record_the_models_logprob():
    shaped = LOGITS + torch.tensor([0.0, math.log(2.0), float("-inf"), 0.0])  # ∝ 0.5, 0.5, 0, 0.10
    probs, recorded = drawn(LOGITS, shaped=shaped)
    assert close(probs, [0.5 / 1.1, 0.5 / 1.1, 0, 0.1 / 1.1])
    assert close(recorded[[0, 1, 3]], [math.log(0.5), math.log(0.25), math.log(0.10)], 1e-6)
    # truncation then applies to the shaped distribution: top_k 2 keeps the two 0.5s
    assert close(drawn(LOGITS, shaped=shaped, top_k=2)[0], [0.5, 0.5, 0, 0])
    # greedy: the shaped argmax, recorded at T = 1
    tok, lp = sample(LOGITS[None], torch.zeros(1), torch.ones(1), torch.zeros(1),
                     shaped=(torch.tensor([0]), (LOGITS + torch.tensor([0.0, 1.0, 0.0, 0.0]))[None]))
    assert tok.tolist() == [1] and abs(lp.item() - math.log(0.25)) < 1e-6


def test_a_rows_draw_does_not_depend_on_the_other_rows_parameters():
    g = torch.Generator().manual_seed(0)
    b, v = 12, 300
    logits = torch.randn(b, v, generator=g) * 3
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3] * 3)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.6, 1.0, 0.95] * 2)
    top_k = torch.tensor([0, 5, 0, 40, 0, 0, 1, 0, 0, 7, 0, 0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0])
    uniform = torch.rand(b, generator=g)
    rows = torch.tensor([1, 4, 5, 9])
    shaped_logits = logits[rows] + torch.randn(4, v, generator=g)
    tokens, logprobs = sample(logits, temperature, top_p, uniform, top_k=top_k, min_p=min_p,
                              shaped=(rows, shaped_logits))
    for i in range(b):
        one = dict(top_k=top_k[i:i + 1], min_p=min_p[i:i + 1]) if top_k[i] or min_p[i] else {}
        if i in rows.tolist():
            one["shaped"] = (torch.tensor([0]), shaped_logits[rows.tolist().index(i)][None])
        t, lp = sample(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], uniform[i:i + 1], **one)
        assert (t.item(), lp.item()) == (tokens[i].item(), logprobs[i].item()), i


def test_check_names_the_field_out_of_range():
    for bad, name in [(dict(top_k=-1), "top_k"), (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0),
                      "repetition_penalty"), (dict(presence_penalty=3.0), "presence_penalty"),
                      (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(min_tokens=-1), "min_tokens")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad).check()
    with pytest.raises(ValueError, match="token id 50"):
        SamplingParams(logit_bias=((50, 1.0),)).check(vocab_size=50)
    SamplingParams(top_k=3, min_p=0.1, repetition_penalty=1.2, logit_bias=((49, -100.0),)).check(vocab_size=50)
    assert not SamplingParams(min_tokens=4).shapes_logits  # no stop ids: nothing to hold back
    assert hash(SamplingParams(logit_bias=((1, 2.0),)))  # frozen and hashable


def test_the_remote_body_sends_the_parameters_that_are_on_by_vllms_names():
    assert shaping_fields(SamplingParams(top_p=0.5, seed=3), 64) == {}
    fields = shaping_fields(SamplingParams(top_k=20, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                                           frequency_penalty=-0.5, min_tokens=100, logit_bias=((7, 5.0),)), 64)
    assert fields == {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                      "frequency_penalty": -0.5, "min_tokens": 64, "logit_bias": {"7": 5.0}}


# ----------------------------------------------------------------------------- LocalEngine


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return load_model_and_tokenizer(tiny_model)


@pytest.fixture(scope="module", params=["fast", "hf"])
def engine(request, tiny):
    with LocalEngine(tiny[0], fast_path=request.param == "fast") as eng:
        yield eng


def run(engine, prompts, params):
    async def main():
        return await asyncio.gather(*[engine.generate(p, sp) for p, sp in zip(prompts, params)])
    return asyncio.run(main())


def prompts_of(tok):
    return [tok.encode(t) for t in ["Where is my order ORD-1234?", "Is SKU-77 in stock?", "refund " * 12,
                                    "Can you help me with a refund?"]]


def model_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_top_k_1_is_greedy_token_for_token(tiny, engine):
    prompts = prompts_of(tiny[1])
    greedy = run(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=24)] * 4)
    top1 = run(engine, prompts, [SamplingParams(temperature=1.0, top_k=1, max_tokens=24, seed=i) for i in range(4)])
    for g, t in zip(greedy, top1):
        assert t.token_ids == g.token_ids and len(t.token_ids) == 24
        assert max(abs(a - b) for a, b in zip(t.logprobs, g.logprobs)) < 1e-5  # T = 1 both: the same logprobs


@pytest.mark.parametrize("change", [dict(top_k=3), dict(min_p=0.5), dict(repetition_penalty=3.0),
                                    dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
                                    dict(logit_bias=((5, 3.0),)), dict(min_tokens=6)])
def test_each_parameter_changes_the_tokens(tiny, engine, change):
    prompts = prompts_of(tiny[1])
    plain = [SamplingParams(temperature=1.0, max_tokens=16, seed=i) for i in range(4)]
    if "min_tokens" in change:  # ends a turn on most tokens: the stop ids are half of the vocabulary
        plain = [SamplingParams(temperature=1.0, max_tokens=16, seed=i, stop_token_ids=tuple(range(0, 200, 2)))
                 for i in range(4)]
    before = run(engine, prompts, plain)
    after = run(engine, prompts, [SamplingParams(**{**p.__dict__, **change}) for p in plain])
    assert [r.token_ids for r in before] != [r.token_ids for r in after]


def test_min_tokens_holds_back_the_stop_ids_until_reached(tiny, engine):
    model, tok = tiny
    prompt = prompts_of(tok)[0]
    first = run(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=12)])[0].token_ids
    stops = tuple(sorted(set(first)))  # every token greedy decoding emits here ends the turn
    assert run(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stops)])[0] \
        .token_ids == first[:1]
    for n in (1, 5, 12):
        r = run(engine, [prompt], [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stops,
                                                  min_tokens=n)])[0]
        assert not set(r.token_ids[:n]) & set(stops), n  # none before n tokens...
        assert r.finish_reason == "length" or (len(r.token_ids) > n and r.token_ids[-1] in stops)  # ...after, may
        # ...and the logprob recorded for each is the model's own, the stops' share included
        assert (model_logprobs(model, prompt, r.token_ids) - torch.tensor(r.logprobs)).abs().max() < 1e-4


def test_logit_bias_of_100_forces_a_token_and_records_the_models_logprob(tiny, engine):
    model, tok = tiny
    prompt = prompts_of(tok)[1]
    for temperature in (0.0, 1.0):
        r = run(engine, [prompt], [SamplingParams(temperature=temperature, max_tokens=10, seed=1,
                                                  logit_bias=((42, 100.0),))])[0]
        assert r.token_ids == [42] * 10
        assert (model_logprobs(model, prompt, r.token_ids) - torch.tensor(r.logprobs)).abs().max() < 1e-4
        assert max(r.logprobs) < -1  # not the forced token's probability 1


def test_penalties_make_repeats_rarer(tiny, engine):
    prompts = prompts_of(tiny[1])
    greedy = [SamplingParams(temperature=0.0, max_tokens=30)] * 4

    def distinct(params):
        return sum(len(set(r.token_ids)) for r in run(engine, prompts, params))

    base = distinct(greedy)
    for change in (dict(repetition_penalty=5.0), dict(presence_penalty=2.0), dict(frequency_penalty=2.0)):
        assert distinct([SamplingParams(**{**p.__dict__, **change}) for p in greedy]) > base, change


def test_rows_with_and_without_parameters_draw_as_they_do_alone(tiny, engine):
    prompts = prompts_of(tiny[1])
    params = [SamplingParams(temperature=1.0, max_tokens=20, seed=1),
              SamplingParams(temperature=1.0, max_tokens=14, seed=2, top_k=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=18, presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=22, seed=4, min_p=0.1, logit_bias=((3, 2.0),))]
    together = run(engine, prompts, params)
    for p, sp, r in zip(prompts, params, together):
        assert run(engine, [p], [sp])[0].token_ids == r.token_ids


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(tiny, engine):
    with pytest.raises(ValueError, match="not in the vocabulary"):
        run(engine, [prompts_of(tiny[1])[0]], [SamplingParams(logit_bias=((10 ** 6, 1.0),))])


# ----------------------------------------------------------------------------- the engine.* keys of a run


def test_the_engine_keys_reach_the_rollout_sampling_and_greedy_evaluation_leaves_them_out():
    from tether.config import load_config
    from tether.runtime import sampling_params

    cfg = load_config([], ["engine.top_k=5", "engine.min_p=0.1", "engine.repetition_penalty=1.3",
                           "engine.presence_penalty=0.5", "engine.frequency_penalty=-0.5", "engine.min_tokens=4"])
    p = sampling_params(cfg.engine)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_tokens) == \
        (5, 0.1, 1.3, 0.5, -0.5, 4)
    assert sampling_params(cfg.engine, greedy=True) == SamplingParams(temperature=0.0, max_tokens=cfg.engine.max_tokens)


@pytest.mark.parametrize("override", ["engine.top_k=-1", "engine.min_p=1.5", "engine.repetition_penalty=0",
                                      "engine.presence_penalty=2.5", "engine.frequency_penalty=-3",
                                      "engine.min_tokens=65"])
def test_engine_keys_out_of_range_are_refused_naming_them(override):
    from tether.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[1]):
        load_config([], [override])


FLIPS = ["engine.top_k=3", "engine.min_p=0.3", "engine.repetition_penalty=3.0", "engine.presence_penalty=2.0",
         "engine.frequency_penalty=2.0", "engine.min_tokens=10"]


OUTCOME = ("optim/loss", "optim/entropy", "optim/grad_norm", "rollout/response_tokens")  # of the trained rollouts


@pytest.fixture(scope="module")
def flip_runs(tiny_model, tmp_path_factory):
    """``flip_runs(override, name)``: one training step of SMALL_RUN (+ the override), the OUTCOME of that step and
    its mean |log ratio| (behaviour vs learner logprobs at equal weights)."""
    from tests.conftest import SMALL_RUN, read_rows
    from tether.config import load_config
    from tether.pipeline.trainer import train

    tmp = tmp_path_factory.mktemp("flips")
    (tmp / "run.yaml").write_text(SMALL_RUN)
    cache: dict[str, tuple[tuple, float]] = {}

    def outcome(override: str | None, name: str = "") -> tuple[tuple, float]:
        key = f"{override}{name}"
        if key not in cache:
            run_dir = tmp / (key.replace("=", "-"))
            # trainer.deterministic: a run repeats bit for bit (else the thread count, chosen by the machine's load,
            # and which requests share a step move the last bits), so any difference is the flip's
            cfg = load_config([tmp / "run.yaml"], [f"model.path={tiny_model}", "trainer.total_steps=1",
                                                    "trainer.save_every=0", "trainer.deterministic=true",
                                                    *([override] if override else [])])
            train(cfg, run_dir, show_progress=False)
            row = read_rows(run_dir)[-1]
            cache[key] = tuple(row[k] for k in OUTCOME), row["optim/is_log_ratio_abs"]
        return cache[key]
    return outcome


def test_the_flip_runs_repeat_without_a_flip(flip_runs):
    assert flip_runs(None) == flip_runs(None, "again")


@pytest.mark.parametrize("override", FLIPS)
def test_each_engine_key_changes_the_runs_rollouts(flip_runs, override):
    (base, _), (flipped, log_ratio) = flip_runs(None), flip_runs(override)
    assert flipped != base
    # the behaviour logprobs stay the model's own: the learner's ratio is 1 at equal weights, penalties or not
    assert log_ratio < 1e-5
