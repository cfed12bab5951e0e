"""The LLM user simulator (``environment.user_simulator: llm``) against a stub OpenAI-compatible server: the hidden
goal in its system prompt, the roles flipped, ``###STOP###`` resolving the issue, failures visible, the config's
rules, and an episode of the agent loop driven through it in a real training run."""

from __future__ import annotations

import pytest

from tether.config import ConfigError, load_config
from tether.env.customer_service import CustomerServiceEnv
from tether.metrics import MetricsRecorder, set_recorder
from tether.reward.stub import StubChatServer

ACTION_SPACE = ("environment.action_space=[{name: query_inventory, params: [sku_id], timeout_ms: 3000}, "
                "{name: check_refund_policy, params: [order_id, reason_code], timeout_ms: 2000}, "
                "{name: escalate_to_human, params: [summary, priority], timeout_ms: 500}, "
                "{name: respond_to_user, params: [message], timeout_ms: 5000}]")


def llm_user(base_url: str) -> list[str]:
    return ["environment.user_simulator=llm", f"environment.user_llm.client.base_url={base_url}",
            "environment.user_llm.client.model=customer", "environment.user_llm.client.timeout_s=5",
            "environment.user_llm.client.max_retries=0", "environment.user_llm.temperature=0.3",
            "environment.user_llm.max_tokens=32", ACTION_SPACE]


def test_the_llm_user_knows_the_hidden_goal_sees_flipped_roles_and_resolves_on_stop():
    replies = iter(["It is the one I told you.", "Great, thank you! ###STOP###"])
    with StubChatServer(lambda body: next(replies)) as stub:
        env = CustomerServiceEnv(load_config([], llm_user(stub.base_url)))
        task = next(t for t in env.tasks("train") if t.kind == "refund_ask_id")
        obs = env.reset(task.id)
        assert obs["user_reply"] == task.data["opening"]  # the task's own opening, not the model's
        obs, _, done, _ = env.step({"name": "respond_to_user", "params": {"message": "Which order?"}})
        assert obs["user_reply"] == "It is the one I told you." and not done
        obs, reward, done, info = env.step({"name": "respond_to_user", "params": {"message": "Refund approved."}})
    assert obs["user_reply"] == "Great, thank you!" and done and info["termination"] == "user_issue_resolved"
    first, second = stub.bodies
    system = first["messages"][0]["content"]
    d = task.data
    assert first["messages"][0]["role"] == "system" and d["order_id"] in system and d["sku_id"] in system
    assert "give it only when the agent asks" in system and "###STOP###" in system
    assert str(d["answer_number"]) not in system  # the customer is not told what it is owed
    assert first["temperature"] == 0.3 and first["max_tokens"] == 32 and first["model"] == "customer"
    # roles flipped: the customer's own words are the assistant turns, the agent's the user turns
    assert second["messages"][1:] == [{"role": "assistant", "content": d["opening"]},
                                      {"role": "user", "content": "Which order?"},
                                      {"role": "assistant", "content": "It is the one I told you."},
                                      {"role": "user", "content": "Refund approved."}]
    # the rule checks still decide the reward: no policy check was made, so nothing of them is earned
    assert info["reward_components"]["refund_amount_correct"] == 0.0 and reward < 0.7


def test_a_failing_llm_user_is_an_error_observation_and_is_counted():
    recorder = MetricsRecorder([])
    prev = set_recorder(recorder)
    try:
        with StubChatServer(lambda body: (500, '{"error": {"message": "down"}}')) as stub:
            env = CustomerServiceEnv(load_config([], llm_user(stub.base_url)))
            env.reset("train_000")
            obs, _, done, info = env.step({"name": "respond_to_user", "params": {"message": "Hello"}})
    finally:
        set_recorder(prev)
    assert obs["tool_error"] and "HTTP 500" in obs["last_tool_result"] and obs["user_reply"] is None
    assert recorder.flush(1)["env/user_sim_failures"] == 1


def test_user_llm_config_rules():
    with pytest.raises(ConfigError, match="give it exactly when user_simulator is llm"):
        load_config([], ["environment.user_simulator=llm"])
    with pytest.raises(ConfigError, match="give it exactly when user_simulator is llm"):
        load_config([], ["environment.user_llm.client.base_url=http://127.0.0.1:9/v1"])
    # the seed's respond_to_user timeout (100 ms) cannot hold a model's answer
    with pytest.raises(ConfigError, match=r"raise action_space\[3\]\.timeout_ms to at least 5000"):
        load_config([], [o for o in llm_user("http://127.0.0.1:9/v1") if o != ACTION_SPACE])


def test_the_llm_user_drives_episodes_of_a_training_run(small_run):
    with StubChatServer(lambda body: "Thanks, that is all. ###STOP###") as stub:
        llm, _, _ = small_run("llm_user", *llm_user(stub.base_url), "trainer.total_steps=1", "trainer.save_every=1")
    scripted, _, _ = small_run("scripted", ACTION_SPACE, "trainer.total_steps=1", "trainer.save_every=1")
    assert stub.bodies, "the agent loop never reached the LLM user"
    systems = {b["messages"][0]["content"] for b in stub.bodies}
    tasks = CustomerServiceEnv(load_config([], ["environment.num_train_tasks=20", "environment.num_eval_tasks=4"]))
    names = {t.data["customer_name"] for split in ("train", "eval") for t in tasks.tasks(split)}
    assert all(any(n in s for n in names) for s in systems)  # each request carried its own task's customer
    # the LLM customer is satisfied by the first message it gets, the scripted one restates its request until told
    # the right outcome: the flip changes how long episodes run
    assert llm[1]["agent/num_turns"] < scripted[1]["agent/num_turns"]
