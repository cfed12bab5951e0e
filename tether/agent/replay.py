"""Demonstrations: a scripted policy's episode replayed through the real agent loop.

The policy acts on observations (``policy(obs) -> action``); its actions are written as the assistant
texts the model would produce (a message to the user as plain text, any other tool as a Hermes
``<tool_call>`` block) and replayed with ``ScriptedEngine`` against a fresh environment. The result is a
Trajectory with the exact token layout of an RL rollout, ready for supervised warm-starting.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tether.agent.loop import USER_TOOL, LoopLimits, make_agent_loop
from tether.engine.base import SamplingParams
from tether.engine.scripted import ScriptedEngine
from tether.env.base import Action, Env, Observation
from tether.types import Task, Trajectory


def action_text(action: Action) -> str:
    """The assistant text that the agent loop parses back into ``action``."""
    if action["name"] == USER_TOOL:
        return str(action["params"]["message"])
    call = {"name": action["name"], "arguments": action["params"]}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def play_actions(env: Env, task: Task, policy: Callable[[Observation], Action],
                 limits: LoopLimits) -> tuple[list[Action], float]:
    """Play one action per assistant turn, stopping where the tool_agent loop would (its turn limits)."""
    obs = env.reset(task_id=task.id)
    actions: list[Action] = []
    user_turns = 0
    while len(actions) < limits.max_assistant_turns:
        action = policy(obs)
        actions.append(action)
        obs, reward, done, _ = env.step(action)
        if done:
            return actions, float(reward)
        user_turns += bool(obs.get("user_reply"))
        if user_turns >= limits.max_user_turns:
            return actions, env.finalize("max_user_turns")[0]
    return actions, env.finalize("max_assistant_turns")[0]


async def demonstrate(task: Task, make_env: Callable[[], Env], policy: Callable[[Observation], Action],
                      tokenizer: Any, *, limits: LoopLimits, max_tokens: int = 256,
                      parser: str = "hermes") -> Trajectory:
    """Play ``task`` with ``policy``, then replay it through the tool_agent loop; the two must agree."""
    actions, reward = play_actions(make_env(), task, policy, limits)
    engine = ScriptedEngine(tokenizer, [action_text(a) for a in actions])
    loop = make_agent_loop("tool_agent", engine=engine, tokenizer=tokenizer,
                           sampling=SamplingParams(max_tokens=max_tokens), limits=limits, parser=parser)
    traj = await loop.run(task, make_env())
    if abs(traj.reward - reward) > 1e-9 or engine.texts:
        raise RuntimeError(f"replaying task {task.id} through the agent loop gave reward {traj.reward} "
                           f"(the policy got {reward}; {len(engine.texts)} actions unused): the loop's limits "
                           f"or parser disagree with the environment")
    return traj
