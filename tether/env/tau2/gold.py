"""tau2's gold trajectories replayed through the adapter: how often the anti-hacking detectors flag them.

A gold trajectory is what tau2 itself scores 1: the task's gold actions (``evaluation_criteria.actions``) as tool
calls, then one message telling the user the task's ``communicate_info`` (or a closing line), after which the
scripted user stops. Played through ``Tau2Env`` in user-simulator mode under an ``environment`` config (its
``verifier.anti_hacking``, ``state.max_turns``, ``termination.tool_error_threshold``), every flag of
``repeated_tool_calls`` or ``context_stuffing`` on one is a false positive: a trajectory tau2 passes losing reward.
``tests/test_tau2_adapter.py`` asserts there are none on every task of every domain, and ``tether verify env`` on a
``tau2:<domain>`` environment reports the rate (``anti_hacking/gold replays``).

    replays = replay_gold("retail")                 # the default config of tau2:retail
    flag_table(replays)                             # {"retail": {"episodes": 114, "flagged": 0, ...}}

``score=False`` leaves the episode unscored (the user answers the last message instead of stopping: tau2's
evaluator is most of a replay's time); the call patterns are judged per step, so their flags are the same.
``no_op_pass`` is judged on a scored episode only; on gold it marks the tasks whose gold actions write nothing,
by design (its penalty is 0 unless set).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tether.config.environment import TAU2_PREFIX, EnvironmentConfig
from tether.env.anti_hacking import NO_OP_PASS
from tether.env.base import Action
from tether.env.tau2._load import check_domain, tasks_by_id
from tether.env.tau2.env import RESPOND, Tau2Env
from tether.env.tau2.user import ScriptedUser

OPENING = "Hello, I need help."
CLOSING = "Is there anything else I can help you with?"
NOT_STOPPING = "Thank you."  # the user's reply to the last message when the replay is not scored
CALL_PATTERNS = ("repeated_tool_calls", "context_stuffing")


@dataclass(frozen=True)
class GoldReplay:
    """One gold trajectory as the adapter played it."""

    domain: str
    task_id: str
    flags: dict[str, int]  # detections per pattern (no_op_pass only when scored)
    steps: int  # environment steps played (fewer than the script when a limit ended it)
    script_steps: int  # the gold actions, plus the message to the user
    tool_errors: int  # calls that failed (some gold actions fail in tau2 too: retail 21 has 3)
    termination: str | None  # None: not scored (score=False) and not ended by a limit
    tau2_reward: float | None  # tau2's reward (None: not scored)

    @property
    def false_positive(self) -> bool:
        """Whether a call pattern flagged it (every such flag on a gold trajectory is a false positive)."""
        return any(self.flags.get(p) for p in CALL_PATTERNS)


def gold_actions(task: Any) -> list[Action]:
    """The gold trajectory of a tau2 task as tether actions: its gold tool calls, then the message to the user."""
    crit = task.evaluation_criteria
    calls = [{"name": a.name, "params": dict(a.arguments)} for a in (crit.actions or [])]
    say = " ".join(crit.communicate_info or []) or CLOSING
    return [*calls, {"name": RESPOND, "params": {"message": say}}]


def _environment(domain: str, environment: EnvironmentConfig | None) -> EnvironmentConfig:
    if environment is None:
        return EnvironmentConfig(name=f"{TAU2_PREFIX}{domain}")
    return environment


def replay(domain: str, task_id: str, environment: EnvironmentConfig | None = None, *,
           score: bool = True) -> GoldReplay:
    """The gold trajectory of ``task_id`` through a ``Tau2Env`` configured by ``environment`` (None: the defaults
    of ``tau2:<domain>``)."""
    env_cfg = _environment(domain, environment)
    task = tasks_by_id(check_domain(domain))[task_id]
    lines = [OPENING] if score else [OPENING, *[NOT_STOPPING] * 2]
    env = Tau2Env(domain, solo=False, user_factory=lambda t: ScriptedUser(lines),
                  max_steps=env_cfg.state.max_turns, max_errors=env_cfg.termination.tool_error_threshold,
                  anti_hacking=env_cfg.verifier.anti_hacking)
    env.reset(task_id)
    actions = gold_actions(task)
    flags: dict[str, int] = {}
    steps, errors, info = 0, 0, None
    for action in actions:
        obs, _, done, info = env.step(action)
        steps += 1
        errors += bool(obs["tool_error"])
        for pattern in info["hacking"]:
            flags[pattern] = flags.get(pattern, 0) + 1
        if done:
            break
    ended = info is not None and "termination" in info
    if ended and info is not None and info["hacking_flags"].get(NO_OP_PASS):
        flags[NO_OP_PASS] = info["hacking_flags"][NO_OP_PASS]
    env.close()
    return GoldReplay(domain, task_id, flags, steps, len(actions), errors,
                      info["termination"] if ended and info is not None else None,
                      info["tau2_reward"] if ended and info is not None else None)


def replay_gold(domain: str, environment: EnvironmentConfig | None = None, *, score: bool = True,
                task_ids: Iterable[str] | None = None) -> list[GoldReplay]:
    """Every task's gold trajectory of ``domain`` (or those of ``task_ids``), in tau2's order."""
    ids = list(task_ids) if task_ids is not None else list(tasks_by_id(check_domain(domain)))
    return [replay(domain, i, environment, score=score) for i in ids]


def flag_table(replays: Sequence[GoldReplay]) -> dict[str, dict[str, int]]:
    """Per domain: ``episodes``, ``flagged`` (episodes a call pattern flagged), per pattern the episodes it
    flagged, and ``ended_early`` (episodes a limit cut before their last step)."""
    out: dict[str, dict[str, int]] = {}
    for r in replays:
        row = out.setdefault(r.domain, {"episodes": 0, "flagged": 0, **{p: 0 for p in CALL_PATTERNS},
                                        "ended_early": 0})
        row["episodes"] += 1
        row["flagged"] += r.false_positive
        for pattern, n in r.flags.items():
            row[pattern] = row.get(pattern, 0) + (n > 0)
        row["ended_early"] += r.steps < r.script_steps
    return out
