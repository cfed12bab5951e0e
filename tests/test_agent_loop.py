"""The tool_agent state machine driven by a scripted engine against the real customer-service env."""

import asyncio
import json

import pytest

from tether.agent.chat import render_ids
from tether.agent.loop import LoopLimits, make_agent_loop, transcript
from tether.config import EnvironmentConfig, LatencySpec
from tether.engine.base import SamplingParams
from tether.engine.scripted import ScriptedEngine as _Scripted
from tether.env.customer_service import CustomerServiceEnv, example_texts, tasks
from tether.learner.model import build_tiny, load_model_and_tokenizer
from tether.types import Task


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), corpus=example_texts(200), num_hidden_layers=1,
                      hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return load_model_and_tokenizer(path)[1]


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


class ScriptedEngine(_Scripted):
    """Replies with the given assistant texts in order (then "..."); every token gets logprob -0.5."""

    def __init__(self, tokenizer, texts, version=3):
        super().__init__(tokenizer, list(texts) + ["..."] * 20, logprob=-0.5, version=version)


def run(tokenizer, texts, task_id, *, env_cfg=None, task=None, limits=LoopLimits(), max_tokens=64):
    engine = ScriptedEngine(tokenizer, texts)
    loop = make_agent_loop("tool_agent", engine=engine, tokenizer=tokenizer,
                           sampling=SamplingParams(max_tokens=max_tokens), limits=limits)
    env = CustomerServiceEnv(env_cfg or EnvironmentConfig())
    if task is not None:
        env.get_task = lambda _id: task  # noqa: E731 — run a narrowed task through the public reset path
    traj = asyncio.run(loop.run(task or env.get_task(task_id), env, seed=0))
    return traj, engine


def test_expert_solves_through_the_loop_and_tokens_equal_the_template(tokenizer):
    task = tasks("eval")[1]  # refund without the order id: ask, check the policy, answer
    assert task.kind == "refund_ask_id"
    order, reason, amount = task.data["order_id"], task.data["reason_code"], task.data["expected_refund"]
    texts = ["What is your order ID?",
             call("check_refund_policy", order_id=order, reason_code=reason),
             f"Your refund of {amount:.2f} for {order} is approved."]
    traj, engine = run(tokenizer, texts, task.id)
    assert traj.success and traj.reward == pytest.approx(1.0), transcript(traj)
    assert traj.termination == "user_issue_resolved"
    assert (traj.num_assistant_turns, traj.num_user_turns, traj.num_tool_calls) == (3, 2, 1)
    assert traj.metrics.num_turns == 3 + 2 + 1
    # Token-in/token-out equals one rendering of the conversation (minus the final reply after "done").
    rendered = render_ids(tokenizer, traj.messages[:-1], None, add_generation_prompt=False)
    tools = [s for s in CustomerServiceEnv(EnvironmentConfig()).tool_schemas() if s["function"]["name"] in task.tools]
    rendered = render_ids(tokenizer, traj.messages[:-1], tools, add_generation_prompt=False)
    im_end_nl = tokenizer.encode("\n", add_special_tokens=False)
    assert traj.prompt_ids + traj.response_ids + im_end_nl == rendered
    # mask 1 exactly on the three generated turns, each ending with <|im_end|>, logprob -0.5, version 3
    model_tokens = [t for t, m in zip(traj.response_ids, traj.response_mask) if m]
    assert tokenizer.decode(model_tokens) == "<|im_end|>".join(texts) + "<|im_end|>"
    assert {lp for lp, m in zip(traj.logprobs, traj.response_mask) if m} == {-0.5}
    assert {v for v, m in zip(traj.versions, traj.response_mask) if m} == {3}
    assert {(lp, v) for lp, v, m in zip(traj.logprobs, traj.versions, traj.response_mask) if not m} == {(0.0, -1)}
    context = tokenizer.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if not m])
    assert f"It is {order}." in context and "<tool_response>" in context and '"approved"' in context
    # every prompt the engine saw is a prefix of the final sequence (append-only)
    full = traj.prompt_ids + traj.response_ids
    assert all(full[: len(p)] == p for p in engine.prompts)


def test_malformed_call_is_an_error_observation_and_the_episode_goes_on(tokenizer):
    task = tasks("eval")[2]
    assert task.kind == "inventory"
    sku, stock = task.data["sku_id"], task.data["answer_number"]
    texts = ['<tool_call>{"name": "query_inventory", "arguments": {</tool_call>',
             call("query_inventory", sku_id=sku), f"{sku} has {stock} in stock."]
    traj, _ = run(tokenizer, texts, task.id)
    assert traj.success, transcript(traj)
    assert any("malformed tool call: invalid JSON" in e for e in traj.errors)
    assert "could not parse tool call" in traj.messages[3]["content"]


def test_parallel_calls_run_concurrently_and_extra_calls_are_refused(tokenizer):
    slow = LatencySpec(median=300.0)
    cfg = EnvironmentConfig()
    cfg.action_space[0].latency_ms = slow  # query_inventory: 300 ms each
    task = tasks("eval")[2]
    sku = task.data["sku_id"]
    texts = [call("query_inventory", sku_id=sku) * 3, "done"]
    traj, _ = run(tokenizer, texts, task.id, env_cfg=cfg, limits=LoopLimits(max_parallel_calls=2), max_tokens=256)
    tool_msgs = [m for m in traj.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 3
    assert '"stock"' in tool_msgs[0]["content"] and '"stock"' in tool_msgs[1]["content"]
    assert "at most 2 tool calls per turn" in tool_msgs[2]["content"]
    assert traj.num_tool_calls == 2
    assert 0.29 < traj.metrics.tool_calls < 0.55  # two 300 ms calls overlapped, not 600 ms
    assert traj.hacking_flags["repeated_tool_calls"] >= 1  # the two identical parallel calls


def test_max_assistant_turns_truncates_and_scores_through_finalize(tokenizer):
    task = tasks("eval")[0]
    traj, _ = run(tokenizer, [f"Let me see ({i})." for i in range(10)], task.id,
                  limits=LoopLimits(max_assistant_turns=2, max_user_turns=9))
    assert traj.num_assistant_turns == 2 and traj.termination == "max_assistant_turns" and traj.truncated
    assert traj.reward == 0.0 and not traj.success
    assert set(traj.reward_components) == {"refund_amount_correct", "policy_compliance", "response_quality",
                                           "efficiency"}


def test_max_user_turns(tokenizer):
    task = tasks("eval")[0]
    traj, _ = run(tokenizer, ["Hello?"] * 10, task.id, limits=LoopLimits(max_user_turns=2))
    assert traj.num_user_turns == 2 and traj.termination == "max_user_turns"


def test_turn_cut_by_max_tokens_is_closed_with_mask_zero_end_of_turn(tokenizer):
    task = tasks("eval")[0]
    traj, _ = run(tokenizer, ["word " * 50, "word " * 50], task.id, max_tokens=8,
                  limits=LoopLimits(max_assistant_turns=1))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert traj.response_mask[:9] == [1] * 8 + [0] and traj.response_ids[8] == im_end


def test_per_sample_tool_selection(tokenizer):
    base = tasks("eval")[2]
    narrowed = Task(base.id, base.split, base.kind, base.data, tools=("query_inventory", "respond_to_user"))
    texts = [call("check_refund_policy", order_id="O-1", reason_code="DAMAGED"), "bye"]
    traj, engine = run(tokenizer, texts, base.id, task=narrowed)
    tool_block = tokenizer.decode(engine.prompts[0]).split("<tools>")[1].split("</tools>")[0]
    assert "query_inventory" in tool_block and "check_refund_policy" not in tool_block
    assert "tool 'check_refund_policy' is not available" in traj.messages[3]["content"]


def test_stop_ids_outside_the_vocabulary_are_rejected(tokenizer):
    with pytest.raises(ValueError, match=r"stop_token_ids \[128009\] are outside"):
        make_agent_loop("tool_agent", engine=None, tokenizer=tokenizer, sampling=SamplingParams(),
                        stop_token_ids=(128009,))
    with pytest.raises(KeyError, match="tool_agent"):
        make_agent_loop("nope")
