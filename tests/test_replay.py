import asyncio

import pytest

from tether.agent.loop import LoopLimits
from tether.agent.replay import action_text, demonstrate
from tether.config import EnvironmentConfig
from tether.env.customer_service import CustomerServiceEnv, ScriptedExpert, example_texts, tasks
from tether.learner.model import build_tiny, load_model_and_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), corpus=example_texts(100), num_hidden_layers=1,
                      hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return load_model_and_tokenizer(path)[1]


def test_action_text():
    assert action_text({"name": "respond_to_user", "params": {"message": "Hi."}}) == "Hi."
    assert action_text({"name": "query_inventory", "params": {"sku_id": "SKU-1"}}) == (
        '<tool_call>\n{"name": "query_inventory", "arguments": {"sku_id": "SKU-1"}}\n</tool_call>')


def test_expert_demonstrations_replay_with_the_same_reward(tokenizer):
    make_env = lambda: CustomerServiceEnv(EnvironmentConfig())  # noqa: E731
    limits = LoopLimits(max_user_turns=3, max_assistant_turns=5)

    async def all_kinds():
        seen = {}
        for task in tasks("eval"):
            seen.setdefault(task.kind, task)
        return await asyncio.gather(*(demonstrate(t, make_env, ScriptedExpert().act, tokenizer, limits=limits)
                                      for t in seen.values()))

    trajs = asyncio.run(all_kinds())
    assert len(trajs) == 5 and all(t.success and t.reward == 1.0 for t in trajs)
    assert all(t.num_model_tokens > 0 and t.response_mask.count(0) > 0 for t in trajs)
