"""Episode memory: the last ``k`` turn records verbatim plus, optionally, a short summary of older turns.

``keep_recent_k`` rather than the full history avoids attention dilution over long episodes (the seed's
reason). The summary is deterministic and templated — no model writes it — and stays a single short line:
how many turns fell out of the window, which tools they called, and the last result of each tool.
An environment can pass its own ``summarize`` to add what it knows (e.g. facts extracted so far).

A *turn* is a ``TurnRecord.turn`` value: records that share it are one turn and are kept or dropped together.
The environment numbers every step as its own turn (its ``observation["memory"]``, for policies that read
observations); the agent loop numbers every *assistant* turn (all the calls of one assistant message), which
is what the policy's context is cut in (``tether.agent.loop``, memory segments).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TurnRecord:
    """One step of an episode: the call, what the model saw back and, if any, the user's reply."""

    turn: int
    tool: str
    args: Any
    result: str
    error: bool = False
    user: str | None = None

    def view(self) -> dict[str, Any]:
        """The record as the model sees it in ``memory.recent`` (no empty keys)."""
        d = asdict(self)
        if not self.error:
            d.pop("error")
        if self.user is None:
            d.pop("user")
        return d


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def default_summary(dropped: Sequence[TurnRecord], max_chars: int = 240) -> str:
    """``"turns 1-3: query_inventory x2 (last {...}), respond_to_user x1"`` — short and templated."""
    if not dropped:
        return ""
    counts = Counter(r.tool for r in dropped)
    last = {r.tool: r for r in dropped}
    parts = []
    for tool, n in counts.items():
        rec = last[tool]
        seen = rec.user if rec.user is not None else rec.result
        parts.append(f"{tool} x{n} (last: {_clip(seen, 60)})")
    span = f"turn {dropped[0].turn}" if len(dropped) == 1 else f"turns {dropped[0].turn}-{dropped[-1].turn}"
    return _clip(f"{span}: " + ", ".join(parts), max_chars)


class KeepRecentK:
    """``add`` every turn; ``view()`` is ``{"recent": [last k records], "summary": str | None}``."""

    def __init__(self, k: int, summary_enabled: bool = True,
                 summarize: Callable[[Sequence[TurnRecord]], str] = default_summary):
        if k < 1:
            raise ValueError(f"memory.k must be >= 1, got {k}")
        self.k = k
        self.summary_enabled = summary_enabled
        self.summarize = summarize
        self.records: list[TurnRecord] = []

    def add(self, record: TurnRecord) -> None:
        self.records.append(record)

    def _cut(self) -> int:
        """Index of the first record of the last ``k`` turns (the records of one turn are contiguous)."""
        turns, last = 0, None
        for i in range(len(self.records) - 1, -1, -1):
            if self.records[i].turn != last:
                turns, last = turns + 1, self.records[i].turn
                if turns > self.k:
                    return i + 1
        return 0

    @property
    def dropped(self) -> list[TurnRecord]:
        """The records of every turn before the last ``k``."""
        return self.records[: self._cut()]

    @property
    def recent(self) -> list[TurnRecord]:
        """The records of the last ``k`` turns."""
        return self.records[self._cut():]

    def summary(self) -> str | None:
        """The summary of what fell out of the window; None when disabled or nothing fell out."""
        dropped = self.dropped
        return self.summarize(dropped) if self.summary_enabled and dropped else None

    def view(self) -> dict[str, Any]:
        return {"recent": [r.view() for r in self.recent], "summary": self.summary()}


def make_memory(config: Any) -> KeepRecentK:
    """From a ``MemoryConfig`` (``type``, ``k``, ``summary_enabled``)."""
    if config.type != "keep_recent_k":
        raise ValueError(f"environment.state.memory.type {config.type!r} is not supported; use 'keep_recent_k'")
    return KeepRecentK(config.k, config.summary_enabled)
