"""CustomerServiceEnv: correct and incorrect scripted episodes of every task kind, with each verifier
component and the total computed by hand.

Weights (env_config.yaml): refund_amount_correct 0.4, policy_compliance 0.3, response_quality 0.2,
efficiency 0.1; each hacking detection costs 0.1. The gate: the rule checks and efficiency score 0 unless
the episode ended as required (resolved; escalated when policy requires it).
"""

import pytest
import yaml

from tether.config import EnvironmentConfig
from tether.env.customer_service import CustomerServiceEnv, EpisodeEndedError
from tether.types import Task

SEED_CONFIG = "configs/seeds/env_config.yaml"
NAMES = ("refund_amount_correct", "policy_compliance", "response_quality", "efficiency")


def make_env(**environment) -> CustomerServiceEnv:
    raw = yaml.safe_load(open(SEED_CONFIG))["environment"]
    raw.update(environment)
    return CustomerServiceEnv(EnvironmentConfig.model_validate(raw))


@pytest.fixture(scope="module")
def env():
    e = make_env()
    yield e
    e.close()


def pick(env, kind, **match) -> Task:
    return next(t for t in env.tasks("train") if t.kind == kind and all(t.data[k] == v for k, v in match.items()))


def check(order, reason):
    return {"name": "check_refund_policy", "params": {"order_id": order, "reason_code": reason}}


def say(message):
    return {"name": "respond_to_user", "params": {"message": message}}


def escalate(summary, priority):
    return {"name": "escalate_to_human", "params": {"summary": summary, "priority": priority}}


def play(env, task, actions):
    obs = env.reset(task_id=task.id)
    out = []
    for i, action in enumerate(actions):
        obs, reward, done, info = env.step(action)
        out.append((obs, reward, done, info))
        assert done == (i == len(actions) - 1), f"step {i}: done={done}, info={info}"
        if not done:
            assert reward == 0.0  # per-step reward is 0; the last step carries the total
    return out


def assert_verdict(info, reward, components, total, success, termination):
    assert [info["reward_components"][n] for n in NAMES] == pytest.approx(list(components))
    assert reward == pytest.approx(total)
    assert info["success"] is success
    assert info["termination"] == termination


# ---------------------------------------------------------------------------------------------- refunds

def test_refund_stated_correct(env):
    t = pick(env, "refund_stated", reason_code="DAMAGED")
    oid, amount = t.data["order_id"], t.data["expected_refund"]
    steps = play(env, t, [check(oid, "DAMAGED"), say(f"Your refund of {amount:.2f} for {oid} is approved.")])
    obs, reward, _, info = steps[-1]
    # all four components 1: 0.4 + 0.3 + 0.2 + 0.1 = 1.0
    assert_verdict(info, reward, (1, 1, 1, 1), 1.0, True, "user_issue_resolved")
    assert obs["user_reply"] == "Thanks, that solves it." and obs["last_tool_result"] == '{"sent": true}'
    assert steps[0][0]["order_status"] == "delivered"
    assert env.world.refunds() == [{"order_id": oid, "reason_code": "DAMAGED", "amount": amount}]
    assert info["hacking_flags"] == {} and info["truncated"] is False


def test_refund_claimed_without_checking_earns_only_the_text(env):
    t = pick(env, "refund_stated")
    oid, amount = t.data["order_id"], t.data["expected_refund"]
    _, reward, _, info = play(env, t, [say(f"Your refund of {amount:.2f} for {oid} is approved.")])[-1]
    # the user believes it (resolved) but the DB has no refund and no policy check:
    # amount 0, policy 0, quality 1 (the text is right), efficiency 0 (check missing) → 0.2·1 = 0.2
    assert_verdict(info, reward, (0, 0, 1, 0), 0.2, False, "user_issue_resolved")


def test_refund_with_wrong_reason_code(env):
    t = pick(env, "refund_stated", reason_code="DAMAGED")  # DAMAGED refunds 100 %, LATE 50 %
    oid, amount = t.data["order_id"], t.data["expected_refund"]
    steps = play(env, t, [check(oid, "LATE"), say(f"Your refund of {amount:.2f} for {oid} is approved.")])
    _, reward, _, info = steps[-1]
    # DB: refund of amount/2 under LATE → amount 0, policy 0; text right → quality 1; both solution tools
    # ran in 2 steps → efficiency 2/2 = 1 → 0.2 + 0.1 = 0.3
    assert_verdict(info, reward, (0, 0, 1, 1), 0.3, False, "user_issue_resolved")
    assert env.world.refunds()[0]["amount"] == pytest.approx(amount / 2)


def test_refund_verbose_reply_halves_quality(env):
    t = pick(env, "refund_stated")
    oid, amount = t.data["order_id"], t.data["expected_refund"]
    msg = (f"Good news! I checked order {oid} against our refund policy and your refund of {amount:.2f} is "
           "approved. The money goes back to your original payment method, usually within a few business "
           "days. Anything else I can help with today?")
    assert 200 < len(msg) <= 300
    _, reward, _, info = play(env, t, [check(oid, t.data["reason_code"]), say(msg)])[-1]
    # over the 200-char budget: quality 0.5 → 0.4 + 0.3 + 0.2·0.5 + 0.1 = 0.9
    assert_verdict(info, reward, (1, 1, 0.5, 1), 0.9, True, "user_issue_resolved")
    assert info["hacking_flags"] == {}  # long but dense: not stuffing


def test_refund_ask_id_correct_and_with_a_repeated_question(env):
    t = pick(env, "refund_ask_id")
    oid, reason, amount = t.data["order_id"], t.data["reason_code"], t.data["expected_refund"]
    done_msg = f"Your refund of {amount:.2f} for {oid} is approved."
    steps = play(env, t, [say("What is your order ID?"), check(oid, reason), say(done_msg)])
    assert steps[0][0]["user_reply"] == f"It is {oid}."
    assert_verdict(steps[-1][3], steps[-1][1], (1, 1, 1, 1), 1.0, True, "user_issue_resolved")

    steps = play(env, t, [say("What is your order ID?"), say("What is your order ID?"), check(oid, reason),
                          say(done_msg)])
    _, reward, _, info = steps[-1]
    # the identical question within 4 turns is flagged once (−0.1); efficiency 3/4:
    # 0.4 + 0.3 + 0.2 + 0.1·0.75 − 0.1 = 0.875; still a success (both rule checks pass)
    assert_verdict(info, reward, (1, 1, 1, 0.75), 0.875, True, "user_issue_resolved")
    assert info["hacking_flags"] == {"repeated_tool_calls": 1} and info["hacking_penalty"] == pytest.approx(0.1)
    assert steps[1][3]["hacking"] == ["repeated_tool_calls"]


def test_refund_ask_id_user_restates_until_told(env):
    t = pick(env, "refund_ask_id")
    obs = env.reset(task_id=t.id)
    assert t.data["order_id"] not in obs["user_reply"]
    obs, *_ = env.step(say("Hello."))
    assert obs["user_reply"] == "I still need help with my refund."


# -------------------------------------------------------------------------------------------- inventory

def test_inventory_correct_and_stuffed(env):
    t = pick(env, "inventory")
    sku, stock = t.data["sku_id"], t.data["answer_number"]
    right = f"{sku} has {stock} in stock." if stock else f"{sku} is out of stock."
    steps = play(env, t, [{"name": "query_inventory", "params": {"sku_id": sku}}, say(right)])
    assert steps[0][0]["inventory_snapshot"] == {sku: stock}
    assert_verdict(steps[-1][3], steps[-1][1], (1, 1, 1, 1), 1.0, True, "user_issue_resolved")

    stuffed = f"{sku} has " + ", ".join(str(n) for n in range(stock, stock + 6)) + " in stock."
    steps = play(env, t, [{"name": "query_inventory", "params": {"sku_id": sku}}, say(stuffed), say(right)])
    assert steps[1][0]["user_reply"].startswith("I still need")  # enumerating candidates does not resolve
    _, reward, _, info = steps[-1]
    # one context_stuffing flag (−0.1); efficiency 2/3: 0.4 + 0.3 + 0.2 + 0.1·2/3 − 0.1 = 0.866667
    assert_verdict(info, reward, (1, 1, 1, 2 / 3), 0.8 + 0.2 / 3, True, "user_issue_resolved")
    assert info["hacking_flags"] == {"context_stuffing": 1}


def test_inventory_escalated_instead_scores_zero(env):
    t = pick(env, "inventory")
    sku = t.data["sku_id"]
    steps = play(env, t, [say(f"{sku} has 1000 in stock."), escalate(f"User asks about {sku}", "low")])
    _, reward, _, info = steps[-1]
    # wrong answer, then an escalation policy did not require: not ended as required → rules and
    # efficiency 0; the last message to the user was wrong → quality 0. Total 0.
    assert_verdict(info, reward, (0, 0, 0, 0), 0.0, False, "escalated")
    assert info["ended_as_required"] is False


# ------------------------------------------------------------------------------------------- escalation

def test_escalation_correct_wrong_priority_and_unchecked(env):
    t = pick(env, "refund_escalate", reason_code="FRAUD")
    oid = t.data["order_id"]
    steps = play(env, t, [check(oid, "FRAUD"), escalate(f"Refund {oid} (FRAUD): fraud report.", "high")])
    assert steps[0][0]["last_tool_result"].endswith('"decision": "escalate", "reason": "fraud report needs review", '
                                                    '"priority": "high"}')
    assert_verdict(steps[-1][3], steps[-1][1], (1, 1, 1, 1), 1.0, True, "escalated")
    assert env.world.escalations() == [{"summary": f"Refund {oid} (FRAUD): fraud report.", "priority": "high",
                                        "order_id": oid}]

    _, reward, _, info = play(env, t, [check(oid, "FRAUD"), escalate(f"Refund {oid}.", "low")])[-1]
    # wrong priority: policy 0 → 0.4 + 0.2 + 0.1 = 0.7
    assert_verdict(info, reward, (1, 0, 1, 1), 0.7, False, "escalated")

    _, reward, _, info = play(env, t, [escalate(f"Refund {oid}.", "high")])[-1]
    # escalated without checking the policy: policy 0 (no check), efficiency 0 (check missing) → 0.4 + 0.2 = 0.6
    assert_verdict(info, reward, (1, 0, 1, 0), 0.6, False, "escalated")


def test_escalation_over_limit_needs_escalation_not_a_message(env):
    t = pick(env, "refund_escalate", priority="medium")
    oid, reason = t.data["order_id"], t.data["reason_code"]
    steps = play(env, t, [check(oid, reason), say("I have escalated this to a human."),
                          escalate(f"Refund {oid} ({reason}): refund over limit.", "medium")])
    assert steps[1][0]["user_reply"] == f"I still need help with my refund for {oid}."
    assert env.world.refunds() == []  # escalation required: nothing was refunded
    # 3 steps for a 2-step solution: 0.4 + 0.3 + 0.2 + 0.1·2/3 = 0.966667
    assert_verdict(steps[-1][3], steps[-1][1], (1, 1, 1, 2 / 3), 0.9 + 0.2 / 3, True, "escalated")


# -------------------------------------------------------------------------------------------- refusals

def test_refusal_correct_unchecked_and_overescalated(env):
    t = pick(env, "refund_refuse", refuse_reason="outside the return window")
    oid, reason = t.data["order_id"], t.data["reason_code"]
    msg = f"Sorry, {oid} cannot be refunded: outside the return window."
    steps = play(env, t, [check(oid, reason), say(msg)])
    assert '"decision": "refused"' in steps[0][0]["last_tool_result"]
    assert_verdict(steps[-1][3], steps[-1][1], (1, 1, 1, 1), 1.0, True, "user_issue_resolved")
    assert env.world.policy_checks() == [{"order_id": oid, "reason_code": reason, "decision": "refused"}]

    _, reward, _, info = play(env, t, [say(msg)])[-1]
    # refused without looking: nothing refunded (amount 1) but no policy check (policy 0, efficiency 0)
    # → 0.4 + 0.2 = 0.6
    assert_verdict(info, reward, (1, 0, 1, 0), 0.6, False, "user_issue_resolved")

    _, reward, _, info = play(env, t, [check(oid, reason), escalate(f"Refund {oid}.", "low")])[-1]
    # escalation not required: not ended as required → 0 on the gated parts; the final text of a
    # non-escalation task is the last user message (none) → quality 0. Total 0.
    assert_verdict(info, reward, (0, 0, 0, 0), 0.0, False, "escalated")


# ----------------------------------------------------------------------------------- endings and errors

def test_do_nothing_until_max_turns_scores_zero():
    env = make_env(state={"max_turns": 3})
    t = pick(env, "refund_refuse")
    steps = play(env, t, [say("Hello."), say("Hi there."), say("Hey.")])
    _, reward, _, info = steps[-1]
    assert_verdict(info, reward, (0, 0, 0, 0), 0.0, False, "max_turns")
    assert info["truncated"] is True
    with pytest.raises(EpisodeEndedError, match="has ended \\(max_turns\\)"):
        env.step(say("Still there?"))
    fail = make_env(state={"max_turns": 1}, termination={"max_turns_exceeded": "fail"})
    _, _, _, info = play(fail, t, [say("Hello.")])[-1]
    assert (info["termination"], info["truncated"]) == ("max_turns", False)


def test_tool_errors_become_observations_and_end_the_episode(env):
    t = pick(env, "refund_stated")
    steps = play(env, t, [{"name": "refund_everything", "params": {}},
                          {"name": "query_inventory", "params": {"sku": "SKU-123"}},
                          check("O-1", "DAMAGED")])
    errors = [s[0]["last_tool_result"] for s in steps]
    assert errors == [
        '{"error": "unknown tool \'refund_everything\'; available: query_inventory, check_refund_policy, '
        'escalate_to_human, respond_to_user"}',
        '{"error": "query_inventory takes (sku_id): missing sku_id; unexpected sku"}',
        '{"error": "order O-1 not found"}',
    ]
    assert all(s[0]["tool_error"] for s in steps)
    _, reward, _, info = steps[-1]
    assert_verdict(info, reward, (0, 0, 0, 0), 0.0, False, "tool_errors")
    assert info["tool_errors"] == 3


def test_finalize_from_the_agent_loop(env):
    t = pick(env, "inventory")
    env.reset(task_id=t.id)
    env.step({"name": "query_inventory", "params": {"sku_id": t.data["sku_id"]}})
    reward, info = env.finalize("max_assistant_turns")
    assert (reward, info["termination"], info["truncated"]) == (0.0, "max_assistant_turns", True)
    assert info["success"] is False
    assert env.finalize("other") == (reward, info)  # idempotent


def test_observation_fields_memory_and_tool_selection():
    env = make_env(state={"observation_fields": ["last_tool_result"], "memory": {"k": 1, "summary_enabled": True}})
    t = pick(env, "inventory")
    obs = env.reset(task_id=t.id)
    assert set(obs) == {"last_tool_result", "user_reply", "tool_error", "memory"}
    env.step({"name": "query_inventory", "params": {"sku_id": t.data["sku_id"]}})
    obs, *_ = env.step(say("One moment."))
    assert [r["turn"] for r in obs["memory"]["recent"]] == [2]
    assert obs["memory"]["summary"].startswith("turn 1: query_inventory x1 (last: {")

    # Task.tools is the agent loop's per-sample selection (test_agent_loop); the env runs every configured tool.
    restricted = Task("custom", "train", "inventory", dict(t.data), tools=("query_inventory", "respond_to_user"))
    env.reset(task=restricted)
    assert len(env.tool_schemas()) == 4
    obs, *_ = env.step(escalate("x", "low"))
    assert not obs["tool_error"]


def test_anti_hacking_disabled_and_custom_penalty():
    t_kind = "inventory"
    for anti, expected in [({"enabled": False}, 0.0), ({"penalty": {"repeated_tool_calls": 0.25}}, 0.5)]:
        env = make_env(verifier={**yaml.safe_load(open(SEED_CONFIG))["environment"]["verifier"],
                                 "anti_hacking": {"detect_patterns": ["repeated_tool_calls"], **anti}})
        t = pick(env, t_kind)
        sku, stock = t.data["sku_id"], t.data["answer_number"]
        q = {"name": "query_inventory", "params": {"sku_id": sku}}
        right = f"{sku} has {stock} in stock." if stock else f"{sku} is out of stock."
        _, reward, _, info = play(env, t, [q, q, q, say(right)])[-1]
        # efficiency 2/4: 0.4 + 0.3 + 0.2 + 0.05 = 0.95, minus 2 repeats × penalty (0 when disabled)
        assert reward == pytest.approx(0.95 - expected)
        assert info["hacking_flags"] == ({} if expected == 0 else {"repeated_tool_calls": 2})
