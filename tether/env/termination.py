"""When an episode ends, and why.

Checked after every step, first match wins:

1. ``user_issue_resolved`` — the success criterion: the (simulated) user declared the issue resolved;
2. ``escalated`` — a terminal tool (``escalate_to_human``) ran without error;
3. ``tool_errors`` — ``tool_error_threshold`` error observations so far;
4. ``max_turns`` — ``max_turns`` steps were taken; ``truncated=True`` when ``max_turns_exceeded`` is
   ``"truncate"`` (a time limit, in Gymnasium's sense: not a terminal state), ``False`` when ``"fail"``.

Endings decided outside the environment (the agent loop's own limits) come in through ``external``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

RESOLVED = "user_issue_resolved"
ESCALATED = "escalated"
TOOL_ERRORS = "tool_errors"
MAX_TURNS = "max_turns"
# Limits of the agent loop / context: the episode was cut, not finished.
CUT_REASONS = frozenset({MAX_TURNS, "max_assistant_turns", "max_user_turns", "context_window"})


@dataclass(frozen=True)
class Ending:
    reason: str
    truncated: bool = False


@dataclass(frozen=True)
class TerminationRule:
    max_turns: int
    max_turns_exceeded: str = "truncate"  # "truncate" | "fail"
    tool_error_threshold: int = 3
    terminal_tools: frozenset[str] = frozenset()
    success_criteria: str = RESOLVED

    def __post_init__(self) -> None:
        if self.max_turns_exceeded not in ("truncate", "fail"):
            raise ValueError(f"termination.max_turns_exceeded must be 'truncate' or 'fail', "
                             f"got {self.max_turns_exceeded!r}")
        if self.success_criteria != RESOLVED:
            raise ValueError(f"termination.success_criteria {self.success_criteria!r} is not supported; "
                             f"use {RESOLVED!r}")

    @classmethod
    def from_config(cls, termination: Any, max_turns: int, terminal_tools: Iterable[str] = ()) -> TerminationRule:
        return cls(max_turns, termination.max_turns_exceeded, termination.tool_error_threshold,
                   frozenset(terminal_tools), termination.success_criteria)

    def check(self, *, resolved: bool, terminal_call: bool, tool_errors: int, turns: int) -> Ending | None:
        """The ending after a step, or None to continue."""
        if resolved:
            return Ending(RESOLVED)
        if terminal_call:
            return Ending(ESCALATED)
        if tool_errors >= self.tool_error_threshold:
            return Ending(TOOL_ERRORS)
        if turns >= self.max_turns:
            return Ending(MAX_TURNS, truncated=self.max_turns_exceeded == "truncate")
        return None

    @staticmethod
    def external(reason: str) -> Ending:
        """An ending the agent loop decided (e.g. ``max_assistant_turns``, ``no_action``)."""
        return Ending(reason, truncated=reason in CUT_REASONS)
