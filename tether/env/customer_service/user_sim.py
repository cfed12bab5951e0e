"""A scripted, deterministic user: short templated messages a tiny model can learn.

- Opens with the task's message (the request; the order id only when the task states it).
- Asked for the order id/number → gives it.
- A message that communicates the right outcome → "Thanks, that solves it." and the issue is resolved.
- Anything else → restates the request.

"The right outcome" (``communicates``) is judged on the words and numbers of the message: the approved
amount, a refusal, or the stock level; a message that enumerates several candidate numbers does not
count. An escalation is never settled by a message — only by the ``escalate_to_human`` tool — so saying
"I escalated it" without doing it leaves the user waiting.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tether.env.anti_hacking import numbers
from tether.types import Task

REFUSAL = re.compile(r"\b(cannot|can't|can not|unable|not eligible|ineligible|denied|declined|not refundable|"
                     r"no refund)\b", re.IGNORECASE)
APPROVAL = re.compile(r"\bapproved\b", re.IGNORECASE)
ASKS_ORDER = re.compile(r"\border\s*(id|number|no\b|#)|\bwhich order\b", re.IGNORECASE)
RESOLVED_REPLY = "Thanks, that solves it."
MAX_NUMBERS = 2  # a right answer names its number and at most one other


def communicates(message: str, gold: Mapping[str, Any]) -> bool:
    """Does ``message`` tell the user the task's gold outcome?"""
    outcome = gold["outcome"]
    nums = set(numbers(message))
    if outcome == "approved":
        target = float(gold["answer_number"])
        return (any(abs(n - target) < 0.005 for n in nums) and len(nums) <= MAX_NUMBERS
                and not REFUSAL.search(message))
    if outcome == "refused":
        return bool(REFUSAL.search(message)) and not APPROVAL.search(message)
    if outcome == "stock":
        stock = int(gold["answer_number"])
        if "out of stock" in message.lower():
            return stock == 0
        return stock in nums and len(nums) <= MAX_NUMBERS
    return False  # "escalated": only the tool settles it


class UserSimulator:
    def __init__(self, task: Task):
        self.data = task.data
        self.resolved = False
        self.gave_order = bool(self.data.get("order_stated"))

    def opening(self) -> str:
        return self.data["opening"]

    def reply(self, message: str) -> str:
        if communicates(message, self.data):
            self.resolved = True
            return RESOLVED_REPLY
        if ASKS_ORDER.search(message):
            if self.data["order_id"]:
                self.gave_order = True
                return f"It is {self.data['order_id']}."
            return f"I have no order. How many {self.data['sku_id']} do you have in stock?"
        return self.restate()

    def restate(self) -> str:
        if self.data["intent"] == "inventory":
            return f"I still need to know how many {self.data['sku_id']} you have in stock."
        if self.gave_order:
            return f"I still need help with my refund for {self.data['order_id']}."
        return "I still need help with my refund."
