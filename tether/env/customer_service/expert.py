"""A scripted expert that solves every task from observations alone, and ``play`` to run a policy.

``ScriptedExpert`` reads the user's messages (order id, SKU, reason words) and the tool results, then:
inventory → ``query_inventory`` → tell the stock; refund → ask for the order id if it is missing →
``check_refund_policy`` → tell the amount / the refusal, or ``escalate_to_human`` with the given priority.
It is the minimal solution of each task kind, so it scores 1.0.

``mistake_rate`` (with its own ``rng``) makes it imperfect, for SFT demonstrations with realistic errors:
each action is, with that probability, replaced by one of ``MISTAKES``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from tether.env.base import Action, Observation

ORDER_ID = re.compile(r"\bO-\d+\b", re.IGNORECASE)
SKU_ID = re.compile(r"\bSKU-\d+\b", re.IGNORECASE)
REASON_WORDS = (("damaged", "DAMAGED"), ("wrong item", "WRONG_ITEM"), ("late", "LATE"),
                ("no longer need", "NOT_NEEDED"), ("used it", "USED"), ("never placed", "FRAUD"))
MISTAKES = ("wrong_reason", "repeat", "claim_without_check")


def respond(message: str) -> Action:
    return {"name": "respond_to_user", "params": {"message": message}}


class ScriptedExpert:
    def __init__(self, mistake_rate: float = 0.0, rng: random.Random | None = None):
        self.mistake_rate = mistake_rate
        self.rng = rng or random.Random(0)
        self.reset()

    def reset(self) -> None:
        self.intent: str | None = None
        self.order: str | None = None
        self.sku: str | None = None
        self.reason: str | None = None
        self.result: dict[str, Any] | None = None  # the last tool result that was not a user message
        self.last: Action | None = None
        self.mistakes: list[str] = []

    def _read(self, obs: Observation) -> None:
        text = obs.get("user_reply") or ""
        if self.intent is None:
            self.intent = obs.get("user_intent") or ("inventory" if "stock" in text.lower() else "refund")
        if (m := ORDER_ID.search(text)) and self.order is None:
            self.order = m.group(0).upper()
        if (m := SKU_ID.search(text)) and self.sku is None:
            self.sku = m.group(0).upper()
        for words, code in REASON_WORDS:
            if self.reason is None and words in text.lower():
                self.reason = code
        last = obs.get("last_tool_result")
        if last is None and obs.get("memory", {}).get("recent"):
            last = obs["memory"]["recent"][-1]["result"]
        if last and not obs.get("tool_error") and not (self.last and self.last["name"] == "respond_to_user"):
            try:
                self.result = json.loads(last)
            except json.JSONDecodeError:
                pass

    def _plan(self, obs: Observation) -> Action:
        if obs.get("tool_error") and self.last is not None:
            return self.last  # e.g. a timeout: try again
        r = self.result or {}
        if self.intent == "inventory":
            if "stock" not in r:
                return {"name": "query_inventory", "params": {"sku_id": self.sku or ""}}
            stock = r["stock"]
            return respond(f"{r['sku_id']} is out of stock." if stock == 0 else f"{r['sku_id']} has {stock} in stock.")
        if self.order is None:
            return respond("What is your order ID?")
        if "decision" not in r:
            return {"name": "check_refund_policy", "params": {"order_id": self.order, "reason_code": self.reason or ""}}
        if r["decision"] == "approved":
            return respond(f"Your refund of {r['refund']} for {self.order} is approved.")
        if r["decision"] == "refused":
            return respond(f"Sorry, {self.order} cannot be refunded: {r['reason']}.")
        return {"name": "escalate_to_human",
                "params": {"summary": f"Refund {self.order} ({self.reason}): {r['reason']}.",
                           "priority": r["priority"]}}

    def _mistake(self, action: Action) -> Action:
        kind = self.rng.choice(MISTAKES)
        self.mistakes.append(kind)
        if kind == "repeat" and self.last is not None:
            return self.last
        if action["name"] == "check_refund_policy":
            if kind == "wrong_reason":
                others = [c for _, c in REASON_WORDS if c != action["params"]["reason_code"]]
                return {"name": action["name"], "params": {**action["params"], "reason_code": self.rng.choice(others)}}
            return respond(f"Your refund for {self.order} is approved.")
        return action

    def act(self, obs: Observation) -> Action:
        self._read(obs)
        action = self._plan(obs)
        if self.mistake_rate > 0 and self.rng.random() < self.mistake_rate:
            action = self._mistake(action)
        self.last = action
        return action


def play(env: Any, task_id: str, policy: Callable[[Observation], Action] | None = None,
         max_steps: int = 50) -> tuple[list[tuple[Action, Observation]], float, dict[str, Any]]:
    """Run one episode of ``task_id`` with ``policy`` (default: a fresh ``ScriptedExpert``); returns the
    (action, observation) pairs, the final reward and the final info."""
    policy = policy or ScriptedExpert().act
    obs = env.reset(task_id=task_id)
    steps: list[tuple[Action, Observation]] = []
    reward, info = 0.0, {}
    for _ in range(max_steps):
        action = policy(obs)
        obs, reward, done, info = env.step(action)
        steps.append((action, obs))
        if done:
            return steps, reward, info
    reward, info = env.finalize("max_steps")
    return steps, reward, info
