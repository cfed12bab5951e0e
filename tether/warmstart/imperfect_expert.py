"""A deliberately imperfect expert for the tiny-sft warm start (and ``tether sft --expert --mistake-rate``).

It makes three *systematic* mistakes, each with probability ``rate`` per episode where it applies, so
that a model imitating it learns the wrong behaviour as its most likely one (greedy decoding fails
those cases) while the right one stays in its distribution for RL to find:

- a refund for a LATE or NOT_NEEDED reason is filed with reason code DAMAGED (wrong amount);
- an escalation is filed with priority "low" instead of the one the policy tool returned;
- a stock answer says "in stock" without the number (the user is not satisfied).
"""

from __future__ import annotations

import random

from tether.env.base import Action, Observation
from tether.env.customer_service import ScriptedExpert


class ImperfectExpert(ScriptedExpert):
    def __init__(self, rate: float, rng: random.Random):
        super().__init__()
        self.rate, self.flip = rate, rng.random() < rate  # one draw per episode: the mistake is all-or-nothing

    def act(self, obs: Observation) -> Action:
        action = super().act(obs)
        if not self.flip:
            return action
        name, params = action["name"], dict(action["params"])
        if name == "check_refund_policy" and params.get("reason_code") in ("LATE", "NOT_NEEDED"):
            params["reason_code"] = "DAMAGED"
        elif name == "escalate_to_human":
            params["priority"] = "low"
        elif name == "respond_to_user" and params["message"].endswith(" in stock.") and self.intent == "inventory":
            params["message"] = f"{self.sku} is in stock."
        else:
            return action
        self.mistakes.append(name)
        fixed = {"name": name, "params": params}
        self.last = fixed
        return fixed
