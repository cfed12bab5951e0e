"""The reference environment: a customer-service agent over a SQLite world (tau-bench retail in miniature).

    world.py     SQLite schema, the refund policy (``decide``), the tool functions, per-episode copies
    tasks.py     deterministic train/eval tasks with gold outcomes (five balanced kinds)
    user_sim.py  the scripted user and ``communicates`` (did a message state the right outcome?)
    grading.py   rule checks on the database, deterministic rubrics, the "ended as required" gate
    env.py       ``CustomerServiceEnv`` (reset/step/astep/finalize, observations, termination, reward)
    expert.py    ``ScriptedExpert`` (solves every task; ``mistake_rate`` for imperfect demos), ``play``
"""

from __future__ import annotations

import json
from typing import Any

from tether.env.customer_service.env import CustomerServiceEnv, EpisodeEndedError, environment_config, tasks
from tether.env.customer_service.expert import ScriptedExpert, play

__all__ = ["CustomerServiceEnv", "EpisodeEndedError", "ScriptedExpert", "environment_config", "example_texts",
           "play", "tasks"]


def example_texts(n: int, config: Any = None) -> list[str]:
    """Up to ``n`` distinct representative strings — system prompt, tool schemas, opening messages, tool
    calls and results, user replies, expert messages — taken from expert episodes (train tasks, then
    eval), e.g. to train the tiny tokenizer on."""
    env = CustomerServiceEnv(config)
    seen: dict[str, None] = {env.system_prompt(): None}
    for schema in env.tool_schemas():
        seen[json.dumps(schema)] = None
    try:
        for task in (*env.tasks("train"), *env.tasks("eval")):
            if len(seen) >= n:
                break
            steps, _, _ = play(env, task.id)
            seen[task.data["opening"]] = None
            for action, obs in steps:
                seen[json.dumps({"name": action["name"], "arguments": action["params"]})] = None
                seen.update({str(v): None for v in action["params"].values()})
                for key in ("last_tool_result", "user_reply"):
                    if obs.get(key):
                        seen[str(obs[key])] = None
    finally:
        env.close()
    return list(seen)[:n]
