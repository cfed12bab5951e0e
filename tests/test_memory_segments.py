"""environment.state.memory: the policy's context is cut into segments once it holds more than k turns.

Built as ``tether train`` builds it (``runtime.env_factory`` + ``runtime.agent_loop`` from a RunConfig), with a
scripted engine for exact token layouts, then with the tiny model's LocalEngine: the behaviour logprobs of every
segment match a teacher-forced forward pass, and a learner step trains on segmented trajectories.
"""

import asyncio
import copy
import json

import pytest
import torch

from conftest import make_learner
from tether.agent.chat import render_ids
from tether.agent.loop import SUMMARY_PREFIX
from tether.algo import logprobs_from_logits
from tether.config import RunConfig, load_config
from tether.engine.local import LocalEngine
from tether.engine.scripted import ScriptedEngine
from tether.env.customer_service import CustomerServiceEnv, example_texts, tasks
from tether.learner.batch import TrainBatch
from tether.learner.model import build_tiny, load_model_and_tokenizer
from tether.runtime import agent_loop, env_factory
from tether.types import Segment, Trajectory

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), corpus=example_texts(200), num_hidden_layers=2,
                      hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    return load_model_and_tokenizer(path)


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def scripted(tok, texts, task, *sets):
    cfg = load_config([], list(sets))
    engine = ScriptedEngine(tok, list(texts) + ["..."] * 10, logprob=-0.5, version=3)
    make_env, _ = env_factory(cfg)
    traj = asyncio.run(agent_loop(cfg, engine, tok).run(task, make_env(), seed=0))
    return traj, engine


def ask_id_episode(tok, *sets):
    """refund_ask_id: ask for the id (user answers), check the policy (tool), tell the user (resolved)."""
    task = tasks("eval")[1]
    assert task.kind == "refund_ask_id"
    d = task.data
    texts = ["What is your order ID?",
             call("check_refund_policy", order_id=d["order_id"], reason_code=d["reason_code"]),
             f"Your refund of {d['expected_refund']:.2f} for {d['order_id']} is approved."]
    return (*scripted(tok, texts, task, *sets), texts)


def model_text(tok, traj):
    return tok.decode([t for s in traj.segments for t, m in zip(s.response_ids, s.response_mask) if m])


def test_k_bounds_the_context_and_changes_the_tokens(tiny):
    _, tok = tiny
    wide, _, texts = ask_id_episode(tok, "environment.state.memory.k=5")
    narrow, engine, _ = ask_id_episode(tok, "environment.state.memory.k=1")
    assert wide.success and narrow.success and wide.reward == narrow.reward == pytest.approx(1.0)
    # k=5: one segment. k=1: turn 2 completes with 2 turns in context > 1, so turn 3 is generated in a new segment.
    assert len(wide.segments) == 1 and len(narrow.segments) == 2
    assert [list(s.prompt_ids) + list(s.response_ids) for s in wide.segments] != \
           [list(s.prompt_ids) + list(s.response_ids) for s in narrow.segments]
    # Every generated token is in exactly one segment, with its logprob and version.
    assert model_text(tok, wide) == model_text(tok, narrow) == "<|im_end|>".join(texts) + "<|im_end|>"
    assert wide.num_model_tokens == narrow.num_model_tokens
    first, second = narrow.segments
    assert first.response_mask[-1] == 1  # segment 0 ends with turn 2's own end-of-turn token
    assert tok.decode([t for t, m in zip(second.response_ids, second.response_mask) if m]) == texts[2] + "<|im_end|>"
    for seg in narrow.segments:
        assert {(lp, v) for lp, v, m in zip(seg.logprobs, seg.versions, seg.response_mask) if m} == {(-0.5, 3)}
    # Token-in/token-out per segment: every prompt the engine saw is a prefix of its segment's sequence.
    full = [s.prompt_ids + s.response_ids for s in narrow.segments]
    assert [next(i for i, f in enumerate(full) if f[:len(p)] == p) for p in engine.prompts] == [0, 0, 1]
    assert engine.prompts[2] == second.prompt_ids
    # Segment 1's prompt: system + opening + summary of turn 1 + turn 2, as the chat template renders them.
    task = tasks("eval")[1]
    m = narrow.messages  # system, user, asst 1, user reply, asst 2 (call), tool result, asst 3, user "Thanks"
    summary = {"role": "system",
               "content": SUMMARY_PREFIX + f"turn 1: respond_to_user x1 (last: It is {task.data['order_id']}.)"}
    tools = [s for s in CustomerServiceEnv().tool_schemas() if s["function"]["name"] in task.tools]
    expected = render_ids(tok, [m[0], m[1], summary, m[4], m[5]], tools, add_generation_prompt=True)
    assert tok.decode(second.prompt_ids) == tok.decode(expected)

def test_summary_enabled_changes_the_segment_prompt(tiny):
    _, tok = tiny
    on, *_ = ask_id_episode(tok, "environment.state.memory.k=1", "environment.state.memory.summary_enabled=true")
    off, *_ = ask_id_episode(tok, "environment.state.memory.k=1", "environment.state.memory.summary_enabled=false")
    p_on, p_off = on.segments[1].prompt_ids, off.segments[1].prompt_ids
    assert p_on != p_off and len(p_on) > len(p_off)
    assert SUMMARY_PREFIX.strip() in tok.decode(p_on) and SUMMARY_PREFIX.strip() not in tok.decode(p_off)
    assert "respond_to_user x1" in tok.decode(p_on)
    assert on.segments[0].prompt_ids == off.segments[0].prompt_ids  # nothing had fallen out yet
    # the kept turn (turn 2 and its tool result) is the same tail in both
    tail = on.segments[1].prompt_ids[-40:]
    assert off.segments[1].prompt_ids[-40:] == tail


def test_train_batch_rows_are_segments_and_splits_keep_them_together():
    a = Trajectory("a", prompt_ids=[5, 6], response_ids=[10, 11], response_mask=[1, 1], logprobs=[-0.1, -0.2],
                   versions=[0, 0], continuations=[Segment([5, 7, 10], [12], [1], [-0.3], [1])])
    b = Trajectory("b", prompt_ids=[8], response_ids=[13, 22], response_mask=[1, 0], logprobs=[-0.5, 0.0],
                   versions=[0, -1])
    batch = TrainBatch.from_trajectories([a, b], [1.5, -0.5], pad_id=0)
    # rows: a.0 = 5 6 | 10 11;  a.1 = 5 7 10 | 12;  b = 8 | 13 22
    assert batch.input_ids.tolist() == [[5, 6, 10, 11], [5, 7, 10, 12], [8, 13, 22, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [0, 1, 0, 0]]
    assert batch.advantages.tolist() == [1.5, 1.5, -0.5] and batch.traj_index.tolist() == [0, 0, 1]
    assert (len(batch), batch.num_trajectories) == (3, 2)
    first, second = batch.split(2)
    assert len(first) == 2 and len(second) == 1 and second.advantages.tolist() == [-0.5]
    with pytest.raises(ValueError, match="2 trajectories into 3"):
        batch.split(3)


# ------------------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def rollouts(tiny):
    """The same 2 tasks × 4 seeds under k=1 and k=5; episodes of up to 4 plain-text turns."""
    model, tok = tiny
    out = {}
    for k in (1, 5):
        cfg = load_config([], [f"environment.state.memory.k={k}", "agent_loop.max_user_turns=4",
                               "agent_loop.max_assistant_turns=4", f"engine.temperature={TEMPERATURE}",
                               "engine.max_tokens=24"])
        engine = LocalEngine(copy.deepcopy(model).eval(), version=2, seed=0)
        make_env, _ = env_factory(cfg)
        loop = agent_loop(cfg, engine, tok)

        async def run_all():
            jobs = [loop.run(t, make_env(), seed=i)  # noqa: B023 — run_all runs within this iteration
                    for t in tasks("train")[:2] for i in range(4)]
            return await asyncio.gather(*jobs)

        try:
            out[k] = asyncio.run(run_all())
        finally:
            engine.close()
    return out


def test_k_changes_what_the_tiny_model_generates_from(rollouts):
    seqs = {k: [[s.prompt_ids + s.response_ids for s in t.segments] for t in trajs] for k, trajs in rollouts.items()}
    n_segments = {k: sum(len(t.segments) for t in trajs) for k, trajs in rollouts.items()}
    print(f"segments over 8 episodes: k=1 {n_segments[1]}, k=5 {n_segments[5]}")
    assert n_segments[5] == 8 and n_segments[1] > 8
    assert seqs[1] != seqs[5]
    for t in rollouts[1]:
        t.check()
        for seg in t.segments:  # each segment: model tokens carry version 2, context tokens -1
            assert {v for v, m in zip(seg.versions, seg.response_mask) if m} <= {2}


def test_behaviour_logprobs_match_a_forward_pass_per_segment(tiny, rollouts):
    model, _ = tiny
    worst, n = 0.0, 0
    with torch.inference_mode():
        for seg in (s for t in rollouts[1] for s in t.segments):
            ids = torch.tensor([seg.prompt_ids + seg.response_ids])
            logp = logprobs_from_logits(model(input_ids=ids).logits[:, :-1], ids[:, 1:], TEMPERATURE)
            logp = logp[0, len(seg.prompt_ids) - 1:]
            mask = torch.tensor(seg.response_mask, dtype=torch.bool)
            worst = max(worst, (logp[mask] - torch.tensor(seg.logprobs)[mask]).abs().max().item())
            n += 1
    print(f"max |engine logprob - forward logprob| over {n} segments: {worst:.2e}")
    assert n > 8 and worst < 1e-4


def test_a_learner_step_trains_on_segmented_trajectories(tiny, rollouts):
    model, _ = tiny
    cfg = RunConfig.model_validate({
        "engine": {"temperature": TEMPERATURE},
        "learner": {"batch_size": 8, "mini_batch_size": 4, "gradient_accumulation_steps": 2},
        "policy_optimization": {"advantage": {"group_size": 4}, "kl_control": {"type": "none"},
                                "optimizer": {"lr": 1e-3, "warmup_steps": 0}},
    })
    advantages = [1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.5, 0.5]
    for k, trajs in rollouts.items():
        learner = make_learner(copy.deepcopy(model), cfg)
        before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
        batch = TrainBatch.from_trajectories(trajs, advantages, pad_id=learner.pad_id)
        metrics = learner.train_step(trajs, advantages)
        moved = max((p.detach() - before[n]).abs().max().item() for n, p in learner.model.named_parameters())
        print(f"k={k}: {len(batch)} rows for 8 trajectories, loss {metrics['optim/loss']:.4f}, "
              f"max |Δθ| {moved:.2e}")
        assert len(batch) == sum(len(t.segments) for t in trajs)
        assert torch.isfinite(torch.tensor(metrics["optim/loss"])) and moved > 0
