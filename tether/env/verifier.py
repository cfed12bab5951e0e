"""The hybrid verifier: weighted rule checks + rubric scores − hacking penalties, with a breakdown.

    reward = gate · Σ_rules wᵢ·cᵢ  +  Σ_rubrics wⱼ·cⱼ  −  Σ_patterns penalty[p] · flags[p]

- A **rule check** is a plain callable ``(world, transcript, task) -> float in [0, 1]`` that reads the
  environment's *state* (its database), not the agent's text — a claim in a message never passes it.
- A **rubric** is scored by a ``Judge`` (``score(rubric, transcript, task) -> float in [0, 1]``). The one
  shipped is ``DeterministicJudge``: plain functions, no model is called. A model judge can implement the
  same protocol later.
- The **gate** (anti "do nothing"): a rule check, and every rubric named in ``gated``, scores 0 unless the
  episode ended the way the task requires (e.g. resolved, or escalated when policy demands it). Without
  it a do-nothing, truncated or immediately-escalated episode would pass "no refund was wrongly issued"
  checks for free (tau2 RFC #129).
- **Partial credit** (``verify(..., partial=True)``, an episode truncated at ``max_turns`` under
  ``max_turns_exceeded: truncate``: "score what was done"): the rule checks count when ``progress`` holds —
  the task's own work was done (e.g. the gold order was checked against the policy) — instead of the gate, so
  a do-nothing episode still earns nothing; gated rubrics stay gated (a cut episode is not efficient).
- ``success`` = gate AND every rule check is 1.0.
- ``Verdict.as_failure()``: the same verdict scored as a failure (an episode that ran out of turns under
  ``max_turns_exceeded: fail``).

``type`` selects what counts: ``"rule"`` (rules only), ``"model"`` (rubrics only) or ``"hybrid"`` (both);
rule checks are evaluated in every case because ``success`` needs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from tether.env.anti_hacking import penalty_of
from tether.env.memory import TurnRecord
from tether.types import Task


@dataclass
class Transcript:
    """What happened in one episode, for rubrics and rules: every step and why it ended."""

    turns: list[TurnRecord] = field(default_factory=list)
    termination: str = ""

    def calls(self, tool: str | None = None, ok_only: bool = False) -> list[TurnRecord]:
        return [t for t in self.turns if (tool is None or t.tool == tool) and not (ok_only and t.error)]

    def last_arg(self, tool: str, param: str) -> str | None:
        """``param`` of the last successful call of ``tool``."""
        for t in reversed(self.turns):
            if t.tool == tool and not t.error and isinstance(t.args, Mapping):
                value = t.args.get(param)
                return value if isinstance(value, str) else None
        return None


@runtime_checkable
class Judge(Protocol):
    def score(self, rubric: str, transcript: Transcript, task: Task) -> float:
        """A score in [0, 1] of ``transcript`` for ``task`` under ``rubric``."""
        ...


RubricFn = Callable[[Transcript, Task], float]
RuleFn = Callable[[Any, Transcript, Task], float]
GateFn = Callable[[Transcript, Task], bool]
ProgressFn = Callable[[Any, Transcript, Task], bool]


class DeterministicJudge:
    """A Judge made of plain scoring functions, one per rubric name; no model is called."""

    def __init__(self, scorers: Mapping[str, RubricFn]):
        self.scorers = dict(scorers)

    def score(self, rubric: str, transcript: Transcript, task: Task) -> float:
        try:
            fn = self.scorers[rubric]
        except KeyError:
            raise KeyError(f"DeterministicJudge has no rubric {rubric!r}; known: {sorted(self.scorers)}") from None
        return fn(transcript, task)


@dataclass
class Verdict:
    reward: float
    components: dict[str, float]  # raw score cᵢ ∈ [0, 1] of each counted component
    weights: dict[str, float]
    hacking_flags: dict[str, int]
    hacking_penalty: float
    success: bool
    gate: bool
    partial: bool = False  # the rule checks were scored on progress (truncated at max_turns), not on the gate

    def as_failure(self) -> Verdict:
        """This episode scored as a failure (``termination.max_turns_exceeded: fail``): every component 0,
        ``success`` False; the hacking penalty still applies, so hacking never pays."""
        return replace(self, reward=round(-self.hacking_penalty, 9) + 0.0,
                       components={name: 0.0 for name in self.components}, success=False)

    def info(self) -> dict[str, Any]:
        return {"reward_components": dict(self.components), "reward_weights": dict(self.weights),
                "hacking_flags": dict(self.hacking_flags), "hacking_penalty": self.hacking_penalty,
                "success": self.success, "ended_as_required": self.gate, "partial_credit": self.partial}


def _checked(name: str, value: Any) -> float:
    value = float(value)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"verifier component {name!r} returned {value}; components must be in [0, 1]")
    return value


class HybridVerifier:
    def __init__(self, *, rules: Sequence[tuple[str, float]], rubrics: Sequence[tuple[str, float]],
                 rule_fns: Mapping[str, RuleFn], judge: Judge, gate: GateFn = lambda tr, task: True,
                 gated: Iterable[str] = (), penalty: Mapping[str, float] | None = None, type: str = "hybrid",
                 progress: ProgressFn = lambda world, tr, task: False):
        if type not in ("hybrid", "rule", "model"):
            raise ValueError(f"verifier.type must be 'hybrid', 'rule' or 'model', got {type!r}")
        missing = sorted({name for name, _ in rules} - set(rule_fns))
        if missing:
            raise ValueError(f"verifier.rule_based names unknown checks {missing}; known: {sorted(rule_fns)}")
        self.rules, self.rubrics = list(rules), list(rubrics)
        self.rule_fns, self.judge, self.gate, self.progress = dict(rule_fns), judge, gate, progress
        self.gated = frozenset(gated)
        self.penalty = dict(penalty or {})
        self.type = type

    @classmethod
    def from_config(cls, verifier: Any, *, rule_fns: Mapping[str, RuleFn], judge: Judge,
                    gate: GateFn, gated: Iterable[str] = (),
                    progress: ProgressFn = lambda world, tr, task: False) -> HybridVerifier:
        """From a ``VerifierConfig``; penalties apply only when anti-hacking is enabled."""
        ah = verifier.anti_hacking
        penalty = {p: ah.penalty.get(p, 0.0) for p in ah.detect_patterns} if ah.enabled else {}
        return cls(rules=[(r.check, r.weight) for r in verifier.rule_based],
                   rubrics=[(r.rubric, r.weight) for r in verifier.model_based],
                   rule_fns=rule_fns, judge=judge, gate=gate, gated=gated, penalty=penalty, type=verifier.type,
                   progress=progress)

    @property
    def weights(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.type != "model":
            out.update(self.rules)
        if self.type != "rule":
            out.update(self.rubrics)
        return out

    def verify(self, world: Any, transcript: Transcript, task: Task,
               hacking_flags: Mapping[str, int] | None = None, *, partial: bool = False) -> Verdict:
        """``partial``: the episode was truncated and is scored on what was done (module docstring)."""
        gate = bool(self.gate(transcript, task))
        by_progress = not gate and partial and bool(self.progress(world, transcript, task))
        rule_scores = {name: _checked(name, self.rule_fns[name](world, transcript, task)) if gate or by_progress
                       else 0.0 for name, _ in self.rules}
        components: dict[str, float] = {}
        if self.type != "model":
            components.update(rule_scores)
        if self.type != "rule":
            for name, _ in self.rubrics:
                ok = gate or name not in self.gated
                components[name] = _checked(name, self.judge.score(name, transcript, task)) if ok else 0.0
        flags = {p: n for p, n in (hacking_flags or {}).items() if n}
        pen = penalty_of(flags, self.penalty)
        weights = self.weights
        reward = sum(weights[name] * c for name, c in components.items()) - pen
        success = gate and all(s == 1.0 for s in rule_scores.values())
        return Verdict(round(reward, 9), components, weights, flags, round(pen, 9), success, gate, by_progress)
