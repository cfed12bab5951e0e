import pytest

from tether.algo import cluster_ids, diversity_bonus, strategy_signature
from tether.algo.diversity import answer_facts, canonical_arguments
from tether.types import Trajectory


# Messages as tether/agent/loop.py records them: an assistant turn with tool calls carries
# {"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": dict}}]}; plain text is said to the user.
def calls(*pairs, content=""):
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(pairs)]}


def say(text):
    return {"role": "assistant", "content": text}


def convo(*assistant):
    out = [{"role": "system", "content": "sys"}, {"role": "user", "content": "My order O-1042 arrived damaged."}]
    for m in assistant:
        out += [m, {"role": "tool", "tool_call_id": "c0", "content": "{}"}]
    return out


def test_signature_of_a_refund_conversation():
    sig = strategy_signature(convo(calls(("check_refund_policy", {"order_id": "O-1042", "reason_code": "DAMAGED"})),
                                   say("Your refund of $12.50 for O-1042 is approved.")))
    assert sig == ('check_refund_policy({"order_id":"o-1042","reason_code":"damaged"})', "respond_to_user",
                   "answer:12.5 o-1042")


def test_number_formatting_wording_and_key_order_do_not_matter():
    a = strategy_signature(convo(calls(("issue_refund", {"amount": 12.50, "order_id": "O-1042"})),
                                 say("Refunded $12.50 for order O-1042. Anything else?")))
    b = strategy_signature(convo(calls(("issue_refund", {"order_id": " O-1042", "amount": "12.5"})),
                                 calls(("respond_to_user", {"message": "Done: 12.5 dollars back on o-1042!"}))))
    assert a == b  # 12.50 = "12.5"; text vs a respond_to_user call; wording is not a strategy
    assert canonical_arguments({"qty": 3.0}) == canonical_arguments('{"qty": 3}') == '{"qty":3}'
    assert canonical_arguments({"n": "1,000.0", "sku": "SKU-007"}) == '{"n":1000,"sku":"sku-7"}'
    assert canonical_arguments("not json, 42.0") == '"42"' and canonical_arguments({"ok": True}) == '{"ok":true}'
    # a prose argument (an escalation summary) is reduced to its facts
    assert canonical_arguments({"summary": "Order O-7 damaged, refund 40.00"}) == '{"summary":"40 o-7"}'
    assert answer_facts("Out of stock.") == "" and answer_facts("SKU-12 has 3 in stock") == "3 sku-12"


def test_different_paths_differ():
    direct = convo(calls(("check_refund_policy", {"order_id": "O-1", "reason_code": "LATE"})), say("Refund 5.00"))
    ask_first = convo(say("What is your order ID?"), *direct[2:])
    other_order = convo(calls(("check_refund_policy", {"reason_code": "LATE", "order_id": "O-2"})), say("Refund 5"))
    sigs = [strategy_signature(m) for m in (direct, ask_first, other_order)]
    assert len(set(sigs)) == 3
    assert sigs[1][0] == "respond_to_user"  # asking the user first is its own step
    traj = Trajectory(task_id="t", prompt_ids=[1], messages=direct)
    assert strategy_signature(traj.messages) == sigs[0]
    assert strategy_signature([]) == ("answer:",)  # no assistant turn at all


def test_cluster_ids_by_first_appearance():
    assert cluster_ids(["b", "a", "b", "c", "a"]) == [0, 1, 0, 2, 1]


def test_diversity_bonus_hand_computed():
    A, B, C, D = ("a",), ("b",), ("c",), ("d",)
    groups = [[A, A, B, C, A], [A], [D, D, D, D]]
    wins = [[True, True, True, False, False], [False], [True, True, True, True]]
    bonuses, m = diversity_bonus(groups, wins, coef=0.05)
    # group 0: A has 2 successes → 0.05/2 each; B one success → 0.05; C and the third A failed → 0
    # group 1: a failed singleton → 0;  group 2: four successes, one strategy → 0.05/4 each
    assert bonuses == [[0.025, 0.025, 0.05, 0.0, 0.0], [0.0], [0.0125] * 4]
    assert sum(bonuses[0]) == pytest.approx(0.05 * 2)  # coef × distinct successful strategies
    assert m["semantic_cluster_count"] == pytest.approx((3 + 1 + 1) / 3)
    assert m["successful_cluster_count"] == pytest.approx((2 + 0 + 1) / 3)
    assert m["diversity_bonus_mean"] == pytest.approx((0.1 + 0.0 + 0.05) / 10)  # over the 10 trajectories


def test_diversity_bonus_edge_cases():
    bonuses, m = diversity_bonus([[("x",)] * 3], [[False] * 3], coef=0.05)  # identical failures
    assert bonuses == [[0.0] * 3] and m["semantic_cluster_count"] == 1
    assert diversity_bonus([], [], coef=0.05) == ([], {"semantic_cluster_count": 0.0,
                                                     "successful_cluster_count": 0.0, "diversity_bonus_mean": 0.0})
    with pytest.raises(ValueError, match="same groups and group sizes"):
        diversity_bonus([[("x",)]], [[True, False]], coef=0.05)
    with pytest.raises(ValueError, match="coef"):
        diversity_bonus([[("x",)]], [[True]], coef=-1.0)
