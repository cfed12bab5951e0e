"""The customer-service verifier's parts: two rule checks on the database, two deterministic rubrics,
and the gate.

Rule checks read the episode's database, never the agent's words:
- ``refund_amount_correct``: the refunds recorded total the gold amount (0 when nothing may be refunded).
- ``policy_compliance``: the gold (order, reason) was checked against the policy (for order tasks), no
  refund was recorded for anything else, and there is an escalation — with the gold priority and the
  order id in its summary — exactly when policy requires one.

Rubrics (``DeterministicJudge``), judged on the transcript:
- ``response_quality``: the final text — the last message to the user, or the escalation summary when
  the task must be escalated — states the right outcome (``communicates``; for escalations: names the
  order); 1.0 within ``MESSAGE_BUDGET`` characters, 0.5 over it, 0 if it does not state it.
- ``efficiency``: minimal steps / steps taken (capped at 1), and 0 unless every tool of the minimal
  solution was called successfully — a short episode that skipped the policy check is not efficient,
  it is wrong.

Gate (``ended_as_required``): the episode ended resolved (or escalated, when policy requires it). The
rule checks and ``efficiency`` score 0 otherwise — except in an episode truncated at ``max_turns`` under
``max_turns_exceeded: truncate``, where the rule checks count when ``work_done``: the task's database work
happened (order tasks: the gold order and reason were checked against the policy; stock questions: the gold
SKU was queried). Doing nothing still earns nothing; telling the user (``response_quality``) would have
resolved the episode, so a truncated one is worth at most the rule weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from tether.env.customer_service.user_sim import communicates
from tether.env.customer_service.world import World
from tether.env.termination import ESCALATED, RESOLVED
from tether.env.verifier import Transcript
from tether.types import Task

MESSAGE_BUDGET = 200  # characters of a good final message
GATED = ("refund_amount_correct", "policy_compliance", "efficiency")


def ended_as_required(tr: Transcript, task: Task) -> bool:
    return tr.termination == (ESCALATED if task.data["must_escalate"] else RESOLVED)


def work_done(world: World, tr: Transcript, task: Task) -> bool:
    d = task.data
    if d["order_id"] is not None:
        return (d["order_id"], d["reason_code"]) in {(c["order_id"], c["reason_code"]) for c in world.policy_checks()}
    return any(isinstance(t.args, Mapping) and str(t.args.get("sku_id", "")).strip().upper() == d["sku_id"]
               for t in tr.calls("query_inventory", ok_only=True))


def refund_amount_correct(world: World, tr: Transcript, task: Task) -> float:
    total = sum(r["amount"] for r in world.refunds())
    return 1.0 if abs(total - task.data["expected_refund"]) < 0.005 else 0.0


def policy_compliance(world: World, tr: Transcript, task: Task) -> float:
    d = task.data
    gold = (d["order_id"], d["reason_code"])
    checks = {(c["order_id"], c["reason_code"]) for c in world.policy_checks()}
    if d["order_id"] is not None and gold not in checks:
        return 0.0
    if any((r["order_id"], r["reason_code"]) != gold for r in world.refunds()):
        return 0.0
    escalations = world.escalations()
    if d["must_escalate"]:
        ok = (len(escalations) == 1 and escalations[0]["priority"] == d["priority"]
              and escalations[0]["order_id"] == d["order_id"])
    else:
        ok = not escalations
    return 1.0 if ok else 0.0


def final_text(tr: Transcript, task: Task) -> str | None:
    if task.data["must_escalate"]:
        return tr.last_arg("escalate_to_human", "summary")
    return tr.last_arg("respond_to_user", "message")


def response_quality(tr: Transcript, task: Task) -> float:
    text = final_text(tr, task)
    if text is None:
        return 0.0
    if task.data["must_escalate"]:
        right = task.data["order_id"].lower() in text.lower()
    else:
        right = communicates(text, task.data)
    if not right:
        return 0.0
    return 1.0 if len(text) <= MESSAGE_BUDGET else 0.5


def efficiency(tr: Transcript, task: Task) -> float:
    needed = Counter(task.data["solution"])
    made = Counter(t.tool for t in tr.calls(ok_only=True))
    if any(made[tool] < n for tool, n in needed.items()) or not tr.turns:
        return 0.0
    return min(1.0, sum(needed.values()) / len(tr.turns))


RULES = {"refund_amount_correct": refund_amount_correct, "policy_compliance": policy_compliance}
RUBRICS = {"response_quality": response_quality, "efficiency": efficiency}
