"""Issue 12's speed-ups change no result: each fast path against the slow one it replaced, on the same inputs.

- the learner forms logits only at the loss positions (``token_logits``) — vs the full [b, T, V] logits;
- π_prox of the first mini-batch comes from its own first forward — vs a separate scoring pass;
- chat-template renderings are cached per tokenizer — vs rendering every time.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from conftest import make_learner
from test_learner import advantages, make_cfg, make_trajectories
from tether.agent import chat
from tether.config import RunConfig
from tether.learner import logits as logits_module
from tether.learner.logits import token_logits
from tether.types import Group, Task, Trajectory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):  # test_learner's model
    from tether.learner import build_tiny, load_model_and_tokenizer

    path = build_tiny(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2, hidden_size=64,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return load_model_and_tokenizer(path)[0]


def stale_behaviour(trajs, shift=0.15, seed=0):
    """Behaviour logprobs that differ from the learner's (as after a weight sync lag), so that the correction's
    weights and the clip act."""
    g = torch.Generator().manual_seed(seed)
    for t in trajs:
        t.logprobs = [lp + shift * float(torch.randn((), generator=g)) if m else 0.0
                      for lp, m in zip(t.logprobs, t.response_mask)]
    return trajs


def one_step(model, cfg, trajs, **attrs):
    learner = make_learner(copy.deepcopy(model), cfg)
    for k, v in attrs.items():
        setattr(learner, k, v)
    metrics = learner.train_step(copy.deepcopy(trajs), advantages(len(trajs)))
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}, metrics


def assert_same(a, b, atol=1e-6):
    params_a, metrics_a = a
    params_b, metrics_b = b
    for name in params_a:
        torch.testing.assert_close(params_a[name], params_b[name], atol=atol, rtol=0, msg=name)
    for key in ("optim/loss", "optim/entropy", "optim/kl_divergence", "optim/is_ratio_mean",
                "optim/is_masked_fraction", "optim/clip_ratio_low", "optim/clip_ratio_high"):
        if key in metrics_a:
            assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-6), key


def test_token_logits_are_the_full_logits_at_the_selected_positions(base_model):
    ids = torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    sel = torch.zeros(3, 10, dtype=torch.bool)
    sel[0, 2:6] = sel[1, 5:7] = sel[2, 9] = True  # 7 positions
    fast = token_logits(base_model, ids, mask, sel)
    full = base_model(input_ids=ids, attention_mask=mask).logits[:, :-1][sel]
    assert fast.shape == (7, 512)
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)


def full_logits(model, input_ids, attention_mask, sel):  # the path before issue 12: every position's logits
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1][sel]


@pytest.mark.parametrize("correction", ["none", "double_sided_importance_sampling"])
def test_learner_step_equals_the_full_logits_step(base_model, monkeypatch, correction):
    trajs = stale_behaviour(make_trajectories(8, seed=3))
    cfg = make_cfg(accum=2, correction=correction, tis=True, entropy_coef=0.01)
    fast = one_step(base_model, cfg, trajs)
    monkeypatch.setattr(logits_module, "token_logits", full_logits)
    slow = one_step(base_model, cfg, trajs)
    assert_same(fast, slow)
    assert fast[1]["optim/kl_divergence"] == 0.0  # policy = reference before the update


def with_shared_prompt(trajs, n=24, seed=7):
    """Every trajectory's prompt starts with the same ``n`` tokens (a system prompt and tool list)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(0, 512, (n,), generator=g).tolist()
    for t in trajs:
        t.prompt_ids = common + t.prompt_ids
    return trajs


def test_shared_prefix_forward_has_the_plain_logits_and_gradients(base_model):
    g = torch.Generator().manual_seed(1)
    common = torch.randint(0, 512, (30,), generator=g)
    ids = torch.cat([common.expand(4, -1), torch.randint(0, 512, (4, 12), generator=g)], dim=1)  # [4, 42]
    mask = torch.ones(4, 42, dtype=torch.long)
    mask[1, 36:] = mask[3, 33:] = 0  # right padding
    sel = torch.zeros(4, 41, dtype=torch.bool)
    sel[:, 28:] = True  # the last two prefix positions too: their logits predict the rows' own tokens
    sel &= mask[:, 1:].bool()
    assert logits_module.shared_prefix(ids, mask) == 30
    grads = []
    for fn in (token_logits, full_logits):
        model = copy.deepcopy(base_model)
        logits = fn(model, ids, mask, sel)
        logits.logsumexp(-1).sum().backward()
        grads.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=0)
    for name, grad in grads[1][1].items():
        torch.testing.assert_close(grads[0][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prefix_length():
    ids = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 9, 0], [1, 2, 3, 4, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    assert logits_module.shared_prefix(ids, mask) == 3
    assert logits_module.shared_prefix(ids[[0, 2]], mask[[0, 2]]) == 3  # row 2 keeps one token of its own
    assert logits_module.shared_prefix(ids[:1], mask[:1]) == 0  # one row: nothing to share


@pytest.mark.parametrize("correction", ["none", "double_sided_importance_sampling"])
def test_learner_step_with_a_shared_prompt_equals_the_plain_step(base_model, monkeypatch, correction):
    # The gradients are compared, not the weights after Adam: its first step is ≈ lr · sign(g), and a weight whose
    # gradient is ~1e-9 flips sign with float rounding (a different summation order in the prefix's backward).
    trajs = stale_behaviour(with_shared_prompt(make_trajectories(8, seed=5)))
    cfg = make_cfg(accum=2, correction=correction, tis=True, entropy_coef=0.01)
    runs = []
    for patch in (False, True):
        if patch:
            monkeypatch.setattr(logits_module, "token_logits", full_logits)
        learner = make_learner(copy.deepcopy(base_model), cfg)
        seen, update = [], learner.optimizer.update

        def spy(update=update, seen=seen, learner=learner, **kwargs):
            seen.append({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})
            return update(**kwargs)

        learner.optimizer.update = spy
        runs.append((learner.train_step(copy.deepcopy(trajs), advantages(8)), seen[0]))
    (m_fast, g_fast), (m_slow, g_slow) = runs
    assert g_fast.keys() == g_slow.keys() and any(g.abs().max() > 1e-3 for g in g_slow.values())
    for name in g_slow:
        torch.testing.assert_close(g_fast[name], g_slow[name], atol=1e-6, rtol=1e-4)
    for key in ("optim/loss", "optim/entropy", "optim/kl_divergence", "optim/is_ratio_mean", "optim/grad_norm"):
        assert m_fast[key] == pytest.approx(m_slow[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("mini", [8, 4])
def test_prox_from_the_first_forward_equals_a_scoring_pass(base_model, mini):
    # mini = 8: one update, no scoring pass at all; mini = 4: the second mini-batch is still scored
    trajs = stale_behaviour(make_trajectories(8, seed=4), shift=0.3)
    cfg = make_cfg(mini=mini, accum=2, correction="double_sided_importance_sampling", tis=True)
    scored = []
    fast = one_step(base_model, cfg, trajs)
    learner = make_learner(copy.deepcopy(base_model), cfg)
    learner.prox_from_forward = False
    score = learner.score
    learner.score = lambda batch, device, skip=0: scored.append(skip) or score(batch, device, skip)
    metrics = learner.train_step(copy.deepcopy(trajs), advantages(8))
    slow = ({n: p.detach().clone() for n, p in learner.model.named_parameters()}, metrics)
    assert scored == [0]  # the slow path scored every row
    assert_same(fast, slow)
    assert fast[1]["optim/is_masked_fraction"] > 0  # the stale behaviour made the band act


def test_prox_pass_is_skipped_only_when_it_is_redundant(base_model):
    skips = {}
    cases = {"one update": dict(mini=8), "two updates": dict(mini=4), "two epochs": dict(epochs=2)}
    for label, kwargs in cases.items():
        learner = make_learner(copy.deepcopy(base_model),
                               make_cfg(correction="double_sided_importance_sampling", tis=True, **kwargs))
        score, seen = learner.score, []
        learner.score = lambda batch, device, skip=0, score=score, seen=seen: seen.append(skip) or score(
            batch, device, skip)
        learner.train_step(make_trajectories(8), advantages(8))
        skips[label] = seen
    # one update: the first mini-batch's rows (all 8) come from its forward; two updates: the second mini-batch
    # (rows 4:8) is scored; two epochs: the second pass needs π_prox of the start, so every row is scored
    assert skips == {"one update": [8], "two updates": [4], "two epochs": [0]}


def test_render_cache_returns_what_the_template_renders(tmp_path):
    from tether.learner import build_tiny, load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(build_tiny(tmp_path / "tiny", num_hidden_layers=1, hidden_size=32,
                                                 intermediate_size=64, num_attention_heads=2,
                                                 num_key_value_heads=1, vocab_size=512))
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find",
                                               "parameters": {"properties": {"q": {"type": "string"}}}}}]
    convs = [[{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}],
             [{"role": "system", "content": "s"}, {"role": "user", "content": "hello!"}],
             [{"role": "tool", "content": "42"}, {"role": "user", "content": "ok"}]]
    calls = []
    apply = tok.apply_chat_template

    def counting(*args, **kwargs):
        calls.append(1)
        return apply(*args, **kwargs)

    tok.apply_chat_template = counting
    for messages in convs:
        for agp in (True, False):
            first = chat.render_ids(tok, messages, tools, add_generation_prompt=agp)
            n = len(calls)
            again = chat.render_ids(tok, messages, tools, add_generation_prompt=agp)
            assert len(calls) == n  # the second rendering came from the cache
            expected = list(apply(messages, tools=tools, add_generation_prompt=agp, tokenize=True, return_dict=False))
            assert first == again == expected
            again.append(-1)  # a caller's copy: the cache is not changed through it
            assert chat.render_ids(tok, messages, tools, add_generation_prompt=agp) == expected
    assert len(calls) == 6  # one rendering per distinct (messages, tools, flag)
    assert chat.render_ids(tok, convs[0], None, add_generation_prompt=True) != chat.render_ids(
        tok, convs[0], tools, add_generation_prompt=True)  # tools are part of the key


class SlowScriptedRollouter:
    """Rewards per (task, seed) from a script; each group takes a moment, so that attempts started together
    overlap. Records the seeds started and the groups that were cancelled."""

    def __init__(self, script, slow=()):
        self.script, self.slow, self.started, self.cancelled, self.events = script, set(slow), [], [], []

    async def group(self, task, n, seed):
        self.started.append(seed)
        self.events.append(("start", seed))
        try:
            await asyncio.sleep(0.3 if seed in self.slow else 0.05)
        except asyncio.CancelledError:
            self.cancelled.append(seed)
            raise
        self.events.append(("end", seed))
        return Group(task.id, [Trajectory("t", [1], reward=r, success=r > 0.5) for r in self.script[task.id][seed]])


def test_resample_attempts_started_together_keep_the_serial_result(metrics):
    from conftest import group_producer
    from tether.pipeline.shaping import record_production_metrics, step_seed

    cfg = RunConfig.model_validate({"policy_optimization": {"advantage": {
        "group_size": 4, "degenerate_group_filter": {"min_reward_std": 0.1, "resample_attempts": 2}}}})
    probe = group_producer(cfg, SlowScriptedRollouter({}))
    assert probe.concurrent_resamples  # sync mode, no judge, no teacher

    first, again = step_seed(cfg.trainer.seed, 1), probe._resample_seed

    def script():
        return {"A": {first: [1] * 4, again(1, 0, 1): [1, 0, 1, 1], again(1, 0, 2): [0, 1, 0, 0]},  # 1st resample ok
                "B": {first: [0, 1, 0, 1]},  # informative at once: no resample
                "C": {first: [0] * 4, again(1, 2, 1): [0] * 4, again(1, 2, 2): [1] * 4}}  # dropped after both

    tasks = [Task(k, "train", "refund") for k in "ABC"]
    results = {}
    for concurrent in (False, True):
        rollouter = SlowScriptedRollouter(script(), slow=[again(1, 0, 2)])  # A's 2nd resample is still running
        producer = group_producer(cfg, rollouter)
        producer.concurrent_resamples = concurrent

        async def run(producer=producer):
            return await asyncio.gather(*(producer.produce(t, 4, 1, k) for k, t in enumerate(tasks)))

        results[concurrent] = (asyncio.run(run()), rollouter)
    serial, concurrent = results[False][0], results[True][0]
    for a, b in zip(serial, concurrent, strict=True):  # the same groups, attempts and outcome
        assert (a.group.rewards, a.resampled, a.resampled_trajectories, a.dropped, a.any_success) == (
            b.group.rewards, b.resampled, b.resampled_trajectories, b.dropped, b.any_success)
    assert [p.dropped for p in concurrent] == [False, False, True]
    assert [p.speculative_trajectories for p in concurrent] == [4, 0, 0]  # A's 2nd attempt was not needed
    assert results[True][1].cancelled == [probe._resample_seed(1, 0, 2)] and not results[False][1].cancelled
    assert len(results[False][1].started) == 6 and len(results[True][1].started) == 7
    # serial: C's 2nd resample starts after its 1st has finished; together: before
    c1, c2 = again(1, 2, 1), again(1, 2, 2)
    serial_log, together_log = results[False][1].events, results[True][1].events
    assert serial_log.index(("start", c2)) > serial_log.index(("end", c1))
    assert together_log.index(("start", c2)) < together_log.index(("end", c1))
    record_production_metrics(concurrent)
    row = metrics.flush(1)
    assert row["rollout/speculative_trajectories"] == 4 and row["rollout/resampled_trajectories"] == 12
