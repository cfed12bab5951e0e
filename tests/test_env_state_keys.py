"""environment.state.observation_fields, environment.termination.max_turns_exceeded and
agent_loop.tool_selection, each flipped through the wiring ``tether train`` uses (``runtime.env_factory`` +
``runtime.agent_loop`` from a RunConfig) with a scripted engine, and the run compared."""

import asyncio
import json
import random
from pathlib import Path

import pytest

from tether.agent.replay import demonstrate
from tether.config import load_config
from tether.engine.scripted import ScriptedEngine
from tether.env.customer_service import ScriptedExpert, example_texts, tasks
from tether.env.termination import max_turns_reachable
from tether.learner.model import build_tiny, load_model_and_tokenizer
from tether.metrics import MetricsRecorder, set_recorder
from tether.pipeline.rollouter import record_rollout_metrics
from tether.runtime import agent_loop, env_factory

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), corpus=example_texts(200), num_hidden_layers=1,
                      hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return load_model_and_tokenizer(path)[1]


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def run(tok, texts, task, *sets):
    cfg = load_config([], list(sets))
    engine = ScriptedEngine(tok, list(texts) + ["..."] * 10, logprob=-0.5)
    make_env, _ = env_factory(cfg)
    traj = asyncio.run(agent_loop(cfg, engine, tok).run(task, make_env(), seed=0))
    return traj, engine


def pick(kind, split="eval"):
    return next(t for t in tasks(split) if t.kind == kind)


def context(tok, traj) -> str:
    return tok.decode([t for s in traj.segments for t, m in zip(s.response_ids, s.response_mask) if not m])


# ------------------------------------------------------------------------------------- observation_fields


@pytest.mark.parametrize("field, shown", [("user_intent", '"user_intent": "refund"'),
                                          ("order_status", '"order_status": "delivered"'),
                                          ("inventory_snapshot", '"inventory_snapshot": {"SKU-')])
def test_each_observation_field_changes_the_observation_tokens(tok, field, shown):
    task = pick("refund_stated")
    d = task.data
    texts = [call("query_inventory", sku_id=d["sku_id"]),
             call("check_refund_policy", order_id=d["order_id"], reason_code=d["reason_code"]),
             f"Your refund of {d['expected_refund']:.2f} for {d['order_id']} is approved."]
    sets = ["agent_loop.tool_selection=all"]  # a refund task's own tools do not include query_inventory
    base, _ = run(tok, texts, task, *sets, "environment.state.observation_fields=[last_tool_result]")
    more, _ = run(tok, texts, task, *sets, f"environment.state.observation_fields=[last_tool_result,{field}]")
    assert base.success and more.success
    base_ctx, more_ctx = context(tok, base), context(tok, more)
    assert "state:" not in base_ctx and f'"{field}"' not in base_ctx
    assert shown in more_ctx
    assert base.response_ids != more.response_ids
    # only context tokens differ: the model's tokens are the same scripted turns
    assert [t for t, m in zip(base.response_ids, base.response_mask) if m] == \
           [t for t, m in zip(more.response_ids, more.response_mask) if m]


def test_observation_without_last_tool_result_shows_only_the_state(tok):
    task = pick("inventory")
    texts = [call("query_inventory", sku_id=task.data["sku_id"]), "Hmm."]
    traj, _ = run(tok, texts, task, "environment.state.observation_fields=[inventory_snapshot]",
                  "agent_loop.max_user_turns=1")
    tool_msg = next(m for m in traj.messages if m["role"] == "tool")
    stock = task.data["answer_number"]
    assert tool_msg["content"] == f'state: {{"inventory_snapshot": {{"{task.data["sku_id"]}": {stock}}}}}'


# ------------------------------------------------------------------------------------- max_turns_exceeded


def test_fail_and_truncate_score_an_episode_that_hits_max_turns_differently(tok):
    task = pick("refund_stated")
    d = task.data
    texts = [call("check_refund_policy", order_id=d["order_id"], reason_code=d["reason_code"]), "One moment."]
    out = {}
    for mode in ("truncate", "fail"):
        traj, _ = run(tok, texts, task, "environment.state.max_turns=2",
                      f"environment.termination.max_turns_exceeded={mode}")
        rec = MetricsRecorder()
        previous = set_recorder(rec)
        try:
            record_rollout_metrics([traj], None)
        finally:
            set_recorder(previous)
        out[mode] = (traj, rec.flush(0))
    (trunc, m_trunc), (fail, m_fail) = out["truncate"], out["fail"]
    assert trunc.termination == fail.termination == "max_turns"
    # truncate: scored on what was done — the refund was checked and recorded: 0.4 + 0.3, nothing told the user
    assert trunc.reward == pytest.approx(0.7) and trunc.truncated and not trunc.max_turns_failed
    assert trunc.reward_components == pytest.approx({"refund_amount_correct": 1.0, "policy_compliance": 1.0,
                                                     "response_quality": 0.0, "efficiency": 0.0})
    # fail: a failure, every component 0
    assert fail.reward == 0.0 and fail.max_turns_failed and not fail.truncated and not fail.success
    assert set(fail.reward_components.values()) == {0.0}
    assert (m_trunc["rollout/truncated_ratio"], m_trunc["rollout/max_turns_failed"]) == (1.0, 0.0)
    assert (m_fail["rollout/truncated_ratio"], m_fail["rollout/max_turns_failed"]) == (0.0, 1.0)


def test_truncation_pays_nothing_for_doing_nothing(tok):
    task = pick("inventory")  # no refund is expected, so "no wrong refund" checks would pass for free
    traj, _ = run(tok, ["Hello.", "Hello again."], task, "environment.state.max_turns=2",
                  "environment.termination.max_turns_exceeded=truncate")
    assert traj.termination == "max_turns" and traj.truncated and traj.reward == 0.0


def test_max_turns_reachable_under_the_loop_limits():
    seed = load_config([REPO / "configs/seeds/env_config.yaml"],  # with agent_loop_config.yaml's limits
                       ["agent_loop.max_assistant_turns=5", "agent_loop.max_parallel_calls=2"])
    assert not max_turns_reachable(seed)  # 20 env steps > 5 assistant turns × 2 calls
    assert max_turns_reachable(load_config([], ["environment.state.max_turns=10"]))
    assert not max_turns_reachable(load_config([], ["environment.state.max_turns=11"]))
    assert max_turns_reachable(load_config([], ["environment.state.max_turns=11", "agent_loop.max_assistant_turns=6"]))


# ------------------------------------------------------------------------------------- tool_selection


def tool_block(tok, prompt_ids) -> str:
    return tok.decode(prompt_ids).split("<tools>")[1].split("</tools>")[0]


@pytest.mark.parametrize("kind, hidden", [("inventory", ("check_refund_policy", "escalate_to_human")),
                                          ("refund_refuse", ("query_inventory",))])
def test_per_sample_and_all_give_different_prompts(tok, kind, hidden):
    task = pick(kind, "train")
    per_sample, e1 = run(tok, ["Hello."], task, "agent_loop.tool_selection=per_sample", "agent_loop.max_user_turns=1")
    every, e2 = run(tok, ["Hello."], task, "agent_loop.tool_selection=all", "agent_loop.max_user_turns=1")
    assert per_sample.prompt_ids != every.prompt_ids and e1.prompts[0] == per_sample.prompt_ids
    for name in hidden:
        assert name not in tool_block(tok, per_sample.prompt_ids) and name in tool_block(tok, every.prompt_ids)
    for name in task.tools:
        assert name in tool_block(tok, per_sample.prompt_ids)
    print(f"{kind}: prompt {len(per_sample.prompt_ids)} tokens per_sample, {len(every.prompt_ids)} with all tools")


def test_refund_kinds_share_one_tool_list_so_it_never_gives_the_outcome_away():
    by_kind = {t.kind: t.tools for t in tasks("train")}
    assert by_kind["inventory"] == ("query_inventory", "respond_to_user")
    refunds = {by_kind[k] for k in ("refund_stated", "refund_ask_id", "refund_escalate", "refund_refuse")}
    assert refunds == {("check_refund_policy", "escalate_to_human", "respond_to_user")}


def test_the_expert_solves_every_kind_with_its_tasks_tools(tok):
    """The demo's warm start replays the expert through the loop under per_sample: it must still succeed."""
    cfg = load_config([], [])
    make_env, list_tasks = env_factory(cfg)
    from tether.agent.loop import LoopLimits

    limits = LoopLimits.from_config(cfg.agent_loop, cfg.environment.state.context_window)
    chosen = list_tasks("train")[:10]  # two of each kind

    async def go():
        return await asyncio.gather(*(demonstrate(t, make_env, ScriptedExpert(0.0, random.Random(0)).act, tok,
                                                  limits=limits) for t in chosen))

    demos = asyncio.run(go())
    assert all(d.success for d in demos), [(t.kind, d.termination) for t, d in zip(chosen, demos)]
    assert not any("is not available" in e for d in demos for e in d.errors)
