"""Deterministic task generation: the catalog, one order per order-based task, and the gold outcomes.

Five kinds, balanced in both splits (task ``i`` has kind ``KINDS[i % 5]``):

- ``refund_stated``   refund, order id in the opening message, policy approves → refund recorded;
- ``refund_ask_id``   the same without the order id: the agent must ask for it;
- ``inventory``       "how many SKU-123 do you have?" → the stock level;
- ``refund_escalate`` policy requires a human (fraud report, or a refund over the limit) → escalate;
- ``refund_refuse``   policy refuses (outside the window, not delivered yet, or a non-refundable reason).

Each task offers the tools of its intent (``Task.tools``, applied under ``agent_loop.tool_selection:
per_sample``): a stock question gets ``query_inventory`` and ``respond_to_user``; every refund kind gets
``check_refund_policy``, ``escalate_to_human`` and ``respond_to_user`` — the same three whatever the policy will
decide, so the tool list never gives the outcome away (the intent is in the opening message anyway).

The held-out split (``test_000`` …) is generated before the train split from its own random stream, so
it does not change when ``num_train_tasks`` does. No two tasks share an order, and no two inventory tasks
share a (customer, sku) pair, so the splits share no (customer, order, sku) scenario. Order ids are drawn
at random so that an id says nothing about the task's kind. The gold comes from the same ``decide``
function the tool uses.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from tether.env.customer_service.world import POLICIES, Decision, decide, new_base
from tether.types import Task

KINDS = ("refund_stated", "refund_ask_id", "inventory", "refund_escalate", "refund_refuse")
SPLITS = {"train": "train", "eval": "test"}  # split → id prefix
APPROVABLE = ("DAMAGED", "WRONG_ITEM", "LATE", "NOT_NEEDED")
PHRASES = {  # how the user states each reason; the agent maps it to the reason code
    "DAMAGED": "It arrived damaged.",
    "WRONG_ITEM": "I got the wrong item.",
    "LATE": "It arrived late.",
    "NOT_NEEDED": "I no longer need it.",
    "USED": "I used it and do not like it.",
    "FRAUD": "I never placed this order.",
}
# The minimal solution of each kind (tool names): the efficiency rubric's yardstick.
SOLUTIONS = {
    "refund_stated": ("check_refund_policy", "respond_to_user"),
    "refund_ask_id": ("respond_to_user", "check_refund_policy", "respond_to_user"),
    "inventory": ("query_inventory", "respond_to_user"),
    "refund_escalate": ("check_refund_policy", "escalate_to_human"),
    "refund_refuse": ("check_refund_policy", "respond_to_user"),
}

# The tools each intent offers (per-sample tool selection); a superset of its kinds' SOLUTIONS.
TOOLS = {
    "inventory": ("query_inventory", "respond_to_user"),
    "refund": ("check_refund_policy", "escalate_to_human", "respond_to_user"),
}

_FIRST = ("Ana", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena", "Max", "Nia",
          "Omar", "Pia", "Quin", "Rosa", "Sam", "Tara")
_LAST = ("Lee", "Diaz", "Kim", "Novak", "Shah", "Berg")
_COLORS = ("red", "blue", "green", "black", "white", "grey", "gold", "pink", "teal", "navy")
_ITEMS = ("kettle", "lamp", "mug", "chair", "desk", "fan", "clock", "rug", "jacket", "backpack")
N_CUSTOMERS, N_SKUS, FIRST_SKU = 60, 100, 100
EVAL_POOL = 64  # held-out tasks whose orders are always in the world: num_eval_tasks <= 64 takes a prefix of them


@dataclass(frozen=True)
class Bundle:
    """Everything generated from one (seed, num_train, num_eval): the base DB image and the tasks."""

    image: bytes
    train: tuple[Task, ...]
    eval: tuple[Task, ...]
    by_id: dict[str, Task]


def _catalog(seed: int) -> tuple[list[tuple], list[tuple]]:
    rng = random.Random(f"{seed}:catalog")
    customers = [(f"C-{i:03d}", f"{rng.choice(_FIRST)} {rng.choice(_LAST)}") for i in range(1, N_CUSTOMERS + 1)]
    skus = []
    for i in range(N_SKUS):
        band = rng.random()
        price = rng.randint(5, 60) if band < 0.5 else rng.randint(61, 150) if band < 0.85 else rng.randint(151, 400)
        stock = 0 if rng.random() < 0.15 else rng.randint(1, 40)
        skus.append((f"SKU-{FIRST_SKU + i}", f"{rng.choice(_COLORS)} {rng.choice(_ITEMS)}", float(price), stock))
    return customers, skus


def _scenario(rng: random.Random, kind: str, j: int, skus: list[tuple]) -> tuple[tuple, str]:
    """(sku row, qty, status, days, reason) for an order task, drawn until the policy gives ``kind``."""
    for _ in range(10_000):
        sku = rng.choice(skus)
        qty, status, reason = rng.randint(1, 2), "delivered", APPROVABLE[j % 4]
        days: int | None = None
        want = "approved"
        if kind == "refund_escalate":
            want = "escalate"
            if j % 2 == 0:
                reason, status = "FRAUD", rng.choice(("delivered", "shipped"))
            else:
                reason, qty = ("DAMAGED", "WRONG_ITEM")[(j // 2) % 2], 3
        elif kind == "refund_refuse":
            want, mode = "refused", j % 3
            if mode == 1:
                status = rng.choice(("shipped", "processing"))
            elif mode == 2:
                reason = "USED"
        policy = POLICIES[reason]
        if status == "delivered":
            window = max(policy.window_days, 1)
            too_late = kind == "refund_refuse" and j % 3 == 0
            days = rng.randint(window + 1, window + 40) if too_late else rng.randint(1, window)
        amount = round(sku[2] * qty, 2)
        d = decide(status, days, amount, policy, already_refunded=False)
        if d.kind == want:
            return (sku, qty, status, days, amount), reason
    raise RuntimeError(f"could not generate a {kind} scenario; the catalog has no fitting sku")


def _gold(kind: str, d: Decision | None, stock: int | None) -> dict[str, Any]:
    if kind == "inventory":
        return {"outcome": "stock", "answer_number": stock, "expected_refund": 0.0, "must_escalate": False,
                "priority": None, "refuse_reason": None}
    assert d is not None
    outcome = {"approved": "approved", "refused": "refused", "escalate": "escalated"}[d.kind]
    return {"outcome": outcome, "answer_number": d.amount if d.kind == "approved" else None,
            "expected_refund": d.amount, "must_escalate": d.kind == "escalate", "priority": d.priority,
            "refuse_reason": d.reason if d.kind == "refused" else None}


def _split(split: str, n: int, seed: int, customers: list[tuple], skus: list[tuple], orders: list[tuple],
           used_ids: set[int], used_pairs: set[tuple[str, str]]) -> list[Task]:
    rng = random.Random(f"{seed}:{split}")
    prefix = SPLITS[split]
    out = []
    for i in range(n):
        kind, j = KINDS[i % len(KINDS)], i // len(KINDS)
        customer = rng.choice(customers)
        data: dict[str, Any] = {"kind": kind, "customer_id": customer[0], "customer_name": customer[1]}
        if kind == "inventory":
            sku = rng.choice(skus)
            while (customer[0], sku[0]) in used_pairs:
                customer, sku = rng.choice(customers), rng.choice(skus)
            used_pairs.add((customer[0], sku[0]))
            data.update(customer_id=customer[0], customer_name=customer[1], intent="inventory", order_id=None,
                        order_stated=False, sku_id=sku[0], reason_code=None,
                        opening=f"Hi, how many {sku[0]} do you have in stock?", **_gold(kind, None, sku[3]))
        else:
            (sku, qty, status, days, amount), reason = _scenario(rng, kind, j, skus)
            num = rng.randrange(1000, 1000 + max(9000, 4 * len(orders) + 100))
            while num in used_ids:
                num = rng.randrange(1000, 1000 + max(9000, 4 * len(orders) + 100))
            used_ids.add(num)
            oid = f"O-{num}"
            orders.append((oid, customer[0], sku[0], qty, amount, status, days))
            d = decide(status, days, amount, POLICIES[reason], already_refunded=False)
            stated = kind != "refund_ask_id"
            where = f" for order {oid}" if stated else ""
            data.update(intent="refund", order_id=oid, order_stated=stated, sku_id=sku[0], reason_code=reason,
                        opening=f"Hi, I want a refund{where}. {PHRASES[reason]}", **_gold(kind, d, None))
        data["solution"] = list(SOLUTIONS[kind])
        out.append(Task(id=f"{prefix}_{i:03d}", split=split, kind=kind, data=data, tools=TOOLS[data["intent"]]))
    return out


@functools.lru_cache(maxsize=8)
def generate(seed: int = 0, num_train: int = 256, num_eval: int = 64) -> Bundle:
    """The world image and both task splits; cached, so every env of a run shares one base world.

    The world holds the orders of ``max(num_eval, EVAL_POOL)`` held-out tasks and the held-out split is the first
    ``num_eval`` of them, so evaluating on fewer tasks changes neither the world nor the train split (nor the
    ``tiny-sft`` preset built on them)."""
    customers, skus = _catalog(seed)
    orders: list[tuple] = []
    used_ids: set[int] = set()
    used_pairs: set[tuple[str, str]] = set()
    pool = _split("eval", world_eval_tasks(num_eval), seed, customers, skus, orders, used_ids, used_pairs)
    eval_tasks = pool[:num_eval]
    train_tasks = _split("train", num_train, seed, customers, skus, orders, used_ids, used_pairs)
    image = new_base(customers, skus, orders)
    by_id = {t.id: t for t in (*train_tasks, *eval_tasks)}
    return Bundle(image, tuple(train_tasks), tuple(eval_tasks), by_id)


def world_eval_tasks(num_eval: int) -> int:
    """How many held-out tasks' orders the world of ``num_eval`` held-out tasks holds (``generate``)."""
    return max(num_eval, EVAL_POOL)


def scenario_key(task: Task) -> tuple[str, str | None, str]:
    """The (customer, order, sku) a task is about; no two tasks share one."""
    return task.data["customer_id"], task.data["order_id"], task.data["sku_id"]
