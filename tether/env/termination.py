"""When an episode ends, and why.

Checked after every step, first match wins:

1. ``user_issue_resolved`` — the success criterion: the (simulated) user declared the issue resolved;
2. ``escalated`` — a terminal tool (``escalate_to_human``) ran without error (``terminal_reason``: a plugin
   environment names its own, e.g. ``submitted``);
3. ``tool_errors`` — ``tool_error_threshold`` error observations so far;
4. ``max_turns`` — ``max_turns`` steps were taken. ``max_turns_exceeded: truncate`` keeps the verifier's
   partial score and marks the episode ``truncated`` (a time limit, in Gymnasium's sense: not a terminal
   state); ``fail`` marks it ``failed``: the environment scores it as a failure (every reward component 0,
   ``success`` False; a hacking penalty still applies) and it is not ``truncated``.

Endings decided outside the environment (the agent loop's own limits) come in through ``external``.

A step is one tool call (``respond_to_user`` included). Under the ``tool_agent`` loop an episode takes at most
``max_assistant_turns × max_parallel_calls`` steps (a turn's extra calls are refused without a step), so a
larger ``max_turns`` is never reached and ``max_turns_exceeded`` never acts: ``max_turns_reachable(cfg)``
says which (the seed's 20 > 5 × 2 is not reachable).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tether.config.plan import max_env_steps

RESOLVED = "user_issue_resolved"
ESCALATED = "escalated"
TOOL_ERRORS = "tool_errors"
MAX_TURNS = "max_turns"
# Limits of the agent loop / context: the episode was cut, not finished.
CUT_REASONS = frozenset({MAX_TURNS, "max_assistant_turns", "max_user_turns", "context_window"})


@dataclass(frozen=True)
class Ending:
    reason: str
    truncated: bool = False  # cut by a limit: score what was done
    failed: bool = False  # cut by max_turns under max_turns_exceeded: fail: score it as a failure


@dataclass(frozen=True)
class TerminationRule:
    max_turns: int
    max_turns_exceeded: str = "truncate"  # "truncate" | "fail"
    tool_error_threshold: int = 3
    terminal_tools: frozenset[str] = frozenset()
    success_criteria: str = RESOLVED
    terminal_reason: str = ESCALATED  # the ending's reason when a terminal tool ran

    def __post_init__(self) -> None:
        if self.max_turns_exceeded not in ("truncate", "fail"):
            raise ValueError(f"termination.max_turns_exceeded must be 'truncate' or 'fail', "
                             f"got {self.max_turns_exceeded!r}")
        if self.success_criteria != RESOLVED:
            raise ValueError(f"termination.success_criteria {self.success_criteria!r} is not supported; "
                             f"use {RESOLVED!r}")

    @classmethod
    def from_config(cls, termination: Any, max_turns: int, terminal_tools: Iterable[str] = (),
                    terminal_reason: str = ESCALATED) -> TerminationRule:
        return cls(max_turns, termination.max_turns_exceeded, termination.tool_error_threshold,
                   frozenset(terminal_tools), termination.success_criteria, terminal_reason)

    def check(self, *, resolved: bool, terminal_call: bool, tool_errors: int, turns: int) -> Ending | None:
        """The ending after a step, or None to continue."""
        if resolved:
            return Ending(RESOLVED)
        if terminal_call:
            return Ending(self.terminal_reason)
        if tool_errors >= self.tool_error_threshold:
            return Ending(TOOL_ERRORS)
        if turns >= self.max_turns:
            truncate = self.max_turns_exceeded == "truncate"
            return Ending(MAX_TURNS, truncated=truncate, failed=not truncate)
        return None

    @staticmethod
    def external(reason: str) -> Ending:
        """An ending the agent loop decided (e.g. ``max_assistant_turns``, ``no_action``)."""
        return Ending(reason, truncated=reason in CUT_REASONS)


def max_turns_reachable(cfg: Any) -> bool:
    """Whether ``environment.state.max_turns`` can end an episode of a ``RunConfig`` under the agent loop's own
    limits; when False, ``environment.termination.max_turns_exceeded`` has no effect in that run."""
    a = cfg.agent_loop
    return cfg.environment.state.max_turns <= max_env_steps(a.max_assistant_turns, a.max_parallel_calls)
