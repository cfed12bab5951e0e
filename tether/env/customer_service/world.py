"""The customer-service world: a small SQLite database and the tool functions that read and write it.

Tables: ``customers``, ``skus`` (``SKU-123``: name, price, stock), ``orders`` (``O-1042``: customer, sku,
qty, amount, status, days_since_delivery), ``refund_policies`` (per reason code), and the three tables the
tools write: ``refunds``, ``escalations`` and ``policy_checks`` (an audit log of policy decisions, so that
the verifier can tell "refused after checking" from "refused without looking").

The base world is built once per (seed, task counts) and kept as bytes (``Connection.serialize``); every
episode gets its own ``:memory:`` copy (``World.from_image``), so no episode ever sees another's writes,
however many run at once in threads or on one event loop.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from dataclasses import dataclass
from typing import Any

from tether.env.tools import ToolError

SCHEMA = """
CREATE TABLE customers (customer_id TEXT PRIMARY KEY, name TEXT NOT NULL);
CREATE TABLE skus (sku_id TEXT PRIMARY KEY, name TEXT NOT NULL, price REAL NOT NULL, stock INTEGER NOT NULL);
CREATE TABLE orders (order_id TEXT PRIMARY KEY, customer_id TEXT NOT NULL, sku_id TEXT NOT NULL,
                     qty INTEGER NOT NULL, amount REAL NOT NULL, status TEXT NOT NULL,
                     days_since_delivery INTEGER);
CREATE TABLE refund_policies (reason_code TEXT PRIMARY KEY, fraction REAL NOT NULL, window_days INTEGER NOT NULL,
                              escalate_over REAL, always_escalate INTEGER NOT NULL, priority TEXT NOT NULL);
CREATE TABLE refunds (id INTEGER PRIMARY KEY, order_id TEXT NOT NULL, reason_code TEXT NOT NULL,
                      amount REAL NOT NULL);
CREATE TABLE escalations (id INTEGER PRIMARY KEY, summary TEXT NOT NULL, priority TEXT NOT NULL, order_id TEXT);
CREATE TABLE policy_checks (id INTEGER PRIMARY KEY, order_id TEXT NOT NULL, reason_code TEXT NOT NULL,
                            decision TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Policy:
    code: str
    fraction: float  # share of the order amount refunded; 0 = not refundable
    window_days: int  # refundable up to this many days after delivery
    escalate_over: float | None  # a refund above this amount needs a human
    always_escalate: bool  # e.g. fraud: always a human
    priority: str  # escalation priority


# The user's words for each reason (in opening messages) and the policy behind it.
POLICIES = {
    "DAMAGED": Policy("DAMAGED", 1.0, 30, 300.0, False, "medium"),
    "WRONG_ITEM": Policy("WRONG_ITEM", 1.0, 30, 300.0, False, "medium"),
    "LATE": Policy("LATE", 0.5, 30, 300.0, False, "medium"),
    "NOT_NEEDED": Policy("NOT_NEEDED", 0.8, 14, 300.0, False, "medium"),
    "USED": Policy("USED", 0.0, 30, None, False, "low"),
    "FRAUD": Policy("FRAUD", 0.0, 0, None, True, "high"),
}
REASON_CODES = tuple(POLICIES)
PRIORITIES = ("low", "medium", "high")

# Refusal reasons, worded without numbers so that a message repeating them stays a clean refusal.
NOT_DELIVERED = "order not delivered yet"
OUTSIDE_WINDOW = "outside the return window"
NOT_REFUNDABLE = "reason not refundable"
ALREADY_REFUNDED = "order already refunded"
FRAUD_REVIEW = "fraud report needs review"
OVER_LIMIT = "refund over limit"

ORDER_ID = re.compile(r"\bO-\d+\b", re.IGNORECASE)


@dataclass(frozen=True)
class Decision:
    kind: str  # "approved" | "refused" | "escalate"
    amount: float = 0.0  # refund when approved
    reason: str = ""  # why refused / escalated
    priority: str | None = None  # when escalated


def decide(status: str, days: int | None, amount: float, policy: Policy, already_refunded: bool) -> Decision:
    """The refund policy as a pure function — the tool and the task generator's gold both use it."""
    if already_refunded:
        return Decision("refused", reason=ALREADY_REFUNDED)
    if policy.always_escalate:
        return Decision("escalate", reason=FRAUD_REVIEW, priority=policy.priority)
    if status != "delivered":
        return Decision("refused", reason=NOT_DELIVERED)
    if days is not None and days > policy.window_days:
        return Decision("refused", reason=OUTSIDE_WINDOW)
    if policy.fraction <= 0:
        return Decision("refused", reason=NOT_REFUNDABLE)
    refund = round(amount * policy.fraction, 2)
    if policy.escalate_over is not None and refund > policy.escalate_over:
        return Decision("escalate", reason=OVER_LIMIT, priority=policy.priority)
    return Decision("approved", amount=refund)


def new_base(customers: list[tuple], skus: list[tuple], orders: list[tuple]) -> bytes:
    """Create the base database from rows and return its image (bytes)."""
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO customers VALUES (?, ?)", customers)
    conn.executemany("INSERT INTO skus VALUES (?, ?, ?, ?)", skus)
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?, ?)", orders)
    conn.executemany("INSERT INTO refund_policies VALUES (?, ?, ?, ?, ?, ?)",
                     [(p.code, p.fraction, p.window_days, p.escalate_over, int(p.always_escalate), p.priority)
                      for p in POLICIES.values()])
    conn.commit()
    image = conn.serialize()
    conn.close()
    return image


class World:
    """One episode's private database and the tool functions over it (all return short dicts)."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn
        self.conn.row_factory = sqlite3.Row
        self._lock = threading.Lock()  # an episode may be stepped from several threads

    @classmethod
    def from_image(cls, image: bytes) -> World:
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        conn.deserialize(image)
        return cls(conn)

    def close(self) -> None:
        self.conn.close()

    def _one(self, sql: str, *args: Any) -> sqlite3.Row | None:
        with self._lock:
            return self.conn.execute(sql, args).fetchone()

    def _all(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self.conn.execute(sql, args).fetchall()]

    # -- tools -----------------------------------------------------------------------------------------
    def query_inventory(self, sku_id: str) -> dict[str, Any]:
        sku = sku_id.strip().upper()
        row = self._one("SELECT sku_id, name, stock FROM skus WHERE sku_id = ?", sku)
        if row is None:
            raise ToolError(f"sku {sku_id} not found")
        return {"sku_id": row["sku_id"], "name": row["name"], "stock": row["stock"]}

    def check_refund_policy(self, order_id: str, reason_code: str) -> dict[str, Any]:
        oid, code = order_id.strip().upper(), reason_code.strip().upper()
        if code not in POLICIES:
            raise ToolError(f"unknown reason_code {reason_code}; use one of {', '.join(REASON_CODES)}")
        with self._lock, self.conn:  # one transaction: read, decide, write
            order = self.conn.execute("SELECT * FROM orders WHERE order_id = ?", (oid,)).fetchone()
            if order is None:
                raise ToolError(f"order {order_id} not found")
            refunded = self.conn.execute("SELECT 1 FROM refunds WHERE order_id = ?", (oid,)).fetchone()
            d = decide(order["status"], order["days_since_delivery"], order["amount"], POLICIES[code],
                       refunded is not None)
            self.conn.execute("INSERT INTO policy_checks (order_id, reason_code, decision) VALUES (?, ?, ?)",
                              (oid, code, d.kind))
            if d.kind == "approved":
                self.conn.execute("INSERT INTO refunds (order_id, reason_code, amount) VALUES (?, ?, ?)",
                                  (oid, code, d.amount))
        out: dict[str, Any] = {"order_id": oid, "status": order["status"], "decision": d.kind}
        if d.kind == "approved":
            out["refund"] = f"{d.amount:.2f}"
        else:
            out["reason"] = d.reason
        if d.kind == "escalate":
            out["priority"] = d.priority
        return out

    def escalate_to_human(self, summary: str, priority: str) -> dict[str, Any]:
        prio = priority.strip().lower()
        if prio not in PRIORITIES:
            raise ToolError(f"priority must be one of {', '.join(PRIORITIES)}")
        match = ORDER_ID.search(summary)
        with self._lock, self.conn:
            cur = self.conn.execute("INSERT INTO escalations (summary, priority, order_id) VALUES (?, ?, ?)",
                                    (summary, prio, match.group(0).upper() if match else None))
        return {"escalated": True, "ticket": f"T-{cur.lastrowid}"}

    # -- reads for the verifier and tests -------------------------------------------------------------
    def order(self, order_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT * FROM orders WHERE order_id = ?", order_id)
        return dict(row) if row is not None else None

    def sku(self, sku_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT * FROM skus WHERE sku_id = ?", sku_id)
        return dict(row) if row is not None else None

    def refunds(self) -> list[dict[str, Any]]:
        return self._all("SELECT order_id, reason_code, amount FROM refunds ORDER BY id")

    def escalations(self) -> list[dict[str, Any]]:
        return self._all("SELECT summary, priority, order_id FROM escalations ORDER BY id")

    def policy_checks(self) -> list[dict[str, Any]]:
        return self._all("SELECT order_id, reason_code, decision FROM policy_checks ORDER BY id")
