"""CustomerServiceEnv episodes: the seed's test flow, config forms, task splits, the expert, per-episode
database isolation (sequential, asyncio, threads) and enforced tool timeouts."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from tether.config import EnvironmentConfig, RunConfig
from tether.env.anti_hacking import hacking_counts
from tether.env.base import Env
from tether.env.customer_service import CustomerServiceEnv, ScriptedExpert, example_texts, play, tasks
from tether.env.customer_service.tasks import KINDS, scenario_key

SEED_CONFIGS = ["configs/seeds/env_config.yaml"]


@pytest.mark.parametrize("path", SEED_CONFIGS)
def test_seed_env_flow_verbatim(path):
    with open(path) as f:
        config = yaml.safe_load(f)
    env = CustomerServiceEnv(config)
    obs = env.reset(task_id="test_001")
    for step in range(5):
        action = {"name": "query_inventory", "params": {"sku_id": "SKU-123"}}
        obs, reward, done, info = env.step(action)
        print(f"Step {step}: reward={reward}, done={done}")
        if done:
            break
    assert env.verifier is not None, "Verifier not initialized"
    assert obs["last_tool_result"].startswith('{"sku_id": "SKU-123"') and not obs["tool_error"]
    assert isinstance(env, Env)


def test_config_forms_agree(tmp_path):
    raw = yaml.safe_load(open(SEED_CONFIGS[0]))
    forms = [raw, raw["environment"], EnvironmentConfig.model_validate(raw["environment"]),
             RunConfig.model_validate(raw), SEED_CONFIGS[0], None]
    assert all(CustomerServiceEnv(f).config == CustomerServiceEnv(raw).config for f in forms)
    bad = {"environment": {**raw["environment"],
                           "action_space": [{"name": "query_inventory", "params": ["sku"], "timeout_ms": 5}]}}
    with pytest.raises(ValueError, match=r"action_space\[0\]: query_inventory takes params \['sku_id'\]"):
        CustomerServiceEnv(bad)


def test_tasks_balanced_disjoint_deterministic():
    train, held = tasks("train"), tasks("eval")
    assert (len(train), len(held)) == (256, 64)
    assert [t.id for t in held[:2]] == ["test_000", "test_001"] and train[-1].id == "train_255"
    for split in (train, held):
        counts = {k: sum(t.kind == k for t in split) for k in KINDS}
        assert max(counts.values()) - min(counts.values()) <= 1
    assert not {scenario_key(t) for t in train} & {scenario_key(t) for t in held}
    assert len({t.data["order_id"] for t in train + held if t.data["order_id"]}) == 256  # 4 of 5 kinds
    small = EnvironmentConfig(num_train_tasks=10)
    assert tasks("eval", small) == held  # the held-out set does not depend on the train size
    assert tasks("train", EnvironmentConfig(seed=1))[0] != train[0]
    env = CustomerServiceEnv()
    assert env.world is None and env.reset()["user_reply"] == train[0].data["opening"]  # None: next train task
    assert env.world.sku("SKU-123") is not None


def test_expert_solves_every_task():
    env = CustomerServiceEnv()
    for split in ("train", "eval"):
        for task in env.tasks(split):
            steps, reward, info = play(env, task.id)
            assert info["success"] and reward == pytest.approx(1.0), (task.id, info)
            assert len(steps) == len(task.data["solution"])


def test_imperfect_expert_makes_mistakes_and_loses_reward():
    env = CustomerServiceEnv()
    expert = ScriptedExpert(mistake_rate=1.0)
    task = next(t for t in env.tasks("train") if t.kind == "refund_stated")
    steps, reward, info = play(env, task.id, expert.act)
    assert expert.mistakes and reward < 1.0


def test_example_texts():
    texts = example_texts(60)
    assert len(texts) == 60 == len(set(texts))
    assert texts[0].startswith("You are a customer service agent.")
    assert "Thanks, that solves it." in texts and any(t.startswith("It is O-") for t in texts)


def _refund_task(env):
    return next(t for t in env.tasks("train") if t.kind == "refund_stated")


def _refund_action(task):
    return {"name": "check_refund_policy",
            "params": {"order_id": task.data["order_id"], "reason_code": task.data["reason_code"]}}


def test_two_episodes_of_one_task_do_not_share_writes():
    a, b = CustomerServiceEnv(), CustomerServiceEnv()
    task = _refund_task(a)
    a.reset(task_id=task.id)
    b.reset(task_id=task.id)
    a.step(_refund_action(task))
    assert len(a.world.refunds()) == 1 and b.world.refunds() == []
    obs, *_ = b.step(_refund_action(task))
    assert '"decision": "approved"' in obs["last_tool_result"]  # not "already refunded"
    a.reset(task_id=task.id)  # a new episode of the same env starts from the base world again
    assert a.world.refunds() == []


def test_32_concurrent_episodes_asyncio_and_threads():
    env0 = CustomerServiceEnv()
    refund_tasks = [t for t in env0.tasks("train") if t.kind == "refund_stated"][:16]

    def fresh():
        envs = [CustomerServiceEnv() for _ in range(32)]
        for i, env in enumerate(envs):
            env.reset(task_id=refund_tasks[i % 16].id)
        return envs

    async def all_at_once(envs):
        return await asyncio.gather(*(env.astep(_refund_action(env.task)) for env in envs))

    def expect_own_writes(envs):
        for env in envs:  # two episodes of each task: each sees exactly its own refund
            assert env.world.refunds() == [{"order_id": env.task.data["order_id"],
                                            "reason_code": env.task.data["reason_code"],
                                            "amount": env.task.data["expected_refund"]}]

    envs = fresh()
    outs = asyncio.run(all_at_once(envs))
    assert all('"decision": "approved"' in obs["last_tool_result"] for obs, *_ in outs)
    expect_own_writes(envs)

    envs = fresh()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda e: e.step(_refund_action(e.task)), envs))
    assert all('"decision": "approved"' in obs["last_tool_result"] for obs, *_ in outs)
    expect_own_writes(envs)


def test_step_works_inside_a_running_event_loop():
    env = CustomerServiceEnv()
    task = _refund_task(env)
    env.reset(task_id=task.id)

    async def main():
        return env.step(_refund_action(task))

    obs, *_ = asyncio.run(main())
    assert not obs["tool_error"]


def _slow_env(**anti):
    raw = yaml.safe_load(open(SEED_CONFIGS[0]))["environment"]
    raw["action_space"][0].update(timeout_ms=40, latency_ms={"median": 300.0, "sigma": 0.5, "max": 600.0})
    raw["verifier"]["anti_hacking"].update(anti)
    return CustomerServiceEnv(raw)


def test_tool_latency_above_timeout_is_an_error_and_three_end_the_episode():
    env = _slow_env()
    env.reset(task_id="test_002")
    outs = [env.step({"name": "query_inventory", "params": {"sku_id": f"SKU-{100 + i}"}}) for i in range(3)]
    for obs, _reward, _done, info in outs:
        assert obs["last_tool_result"] == '{"error": "tool query_inventory timed out after 40 ms"}'
        assert obs["tool_error"] and obs["inventory_snapshot"] == {}
        assert info["latency_ms"] > 40
    assert [o[2] for o in outs] == [False, False, True]
    obs, reward, done, info = outs[-1]
    assert (info["termination"], info["tool_errors"], reward) == ("tool_errors", 3, 0.0)


def test_parallel_calls_of_one_turn_under_latency():
    env = _slow_env()
    task = _refund_task(env)
    env.reset(task_id=task.id)

    async def turn():
        return await asyncio.gather(env.astep({"name": "query_inventory", "params": {"sku_id": "SKU-123"}}),
                                    env.astep(_refund_action(task)))

    (slow, *_), (fast, *_) = asyncio.run(turn())
    assert slow["tool_error"] and not fast["tool_error"]
    assert fast["order_status"] == "delivered"


def test_hacking_counter_counts_detections():
    before = hacking_counts().get("repeated_tool_calls", 0)
    env = CustomerServiceEnv()
    env.reset(task_id="test_002")
    for _ in range(3):
        env.step({"name": "query_inventory", "params": {"sku_id": "SKU-123"}})
    assert hacking_counts()["repeated_tool_calls"] - before == 2
