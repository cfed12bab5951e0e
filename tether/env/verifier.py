"""The hybrid verifier: weighted rule checks + rubric scores − hacking penalties, with a breakdown.

    reward = gate · Σ_rules wᵢ·cᵢ  +  Σ_rubrics wⱼ·cⱼ  −  Σ_patterns penalty[p] · flags[p]

- A **rule check** is a plain callable ``(world, transcript, task) -> float in [0, 1]`` that reads the
  environment's *state* (its database), not the agent's text — a claim in a message never passes it.
- A **rubric** is scored by a ``Judge`` (``score(rubric, transcript, task) -> float in [0, 1]``):
  ``DeterministicJudge`` — plain functions, no model is called (the offline default). With
  ``verifier.judge: llm`` the rubrics are **deferred** instead: ``verify`` scores the rule checks (and any
  rubric the gate zeroes) now, and returns the rest as ``Verdict.pending`` — each rubric's prompt with the
  episode rendered for a judge (``JudgeView``: the request, the conversation, the tool calls, the final
  answer) — for the reward loop (``tether.reward``) to score asynchronously and add to the reward. Until
  then the reward holds the rule part only; ``info()["pending_judge"]`` says what is left.
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

import json
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


@dataclass(frozen=True)
class JudgeView:
    """An episode as an LLM judge reads it; the fields a rubric prompt may name (``config.RUBRIC_FIELDS``)."""

    task: str  # the user's request (the opening message)
    conversation: str  # the messages between the agent and the user, in order
    tool_calls: str  # every other call: name, arguments, result, errors marked
    final_answer: str  # the last successful message to the user or terminal call; "(none)" if there is none

    def fields(self) -> dict[str, str]:
        return {"task": self.task, "conversation": self.conversation, "tool_calls": self.tool_calls,
                "final_answer": self.final_answer}


def _args(args: Any) -> str:
    return json.dumps(args, ensure_ascii=False, sort_keys=True, default=str) if args is not None else "(unparsed)"


def judge_view(transcript: Transcript, task: Task, user_tool: str = "respond_to_user") -> JudgeView:
    """The episode as text for a judge, from the transcript alone (every environment has one): a call of
    ``user_tool`` is a message to the user (its reply follows it), any other call is a tool call."""
    opening = str(task.data.get("opening", task.data.get("prompt", "")))
    conversation = [f"user: {opening}"]
    calls: list[str] = []
    final = "(none)"
    for t in transcript.turns:
        if t.tool == user_tool and isinstance(t.args, Mapping):
            message = str(t.args.get("message", ""))
            conversation.append(f"agent: {message}" + (" [not delivered: error]" if t.error else ""))
            if t.user is not None:
                conversation.append(f"user: {t.user}")
            if not t.error:
                final = message
        else:
            calls.append(f"{len(calls) + 1}. {t.tool}({_args(t.args)}) -> {'ERROR ' if t.error else ''}{t.result}")
            if not t.error:
                final = f"{t.tool}({_args(t.args)})"
    return JudgeView(opening, "\n".join(conversation), "\n".join(calls) or "(no tool calls)", final)


BUILTIN_PROMPTS: dict[str, str] = {
    "response_quality": (
        "You grade a customer-service agent's final answer.\n\nThe customer's request:\n{task}\n\n"
        "The conversation:\n{conversation}\n\nThe agent's tool calls and their results:\n{tool_calls}\n\n"
        "The agent's final answer:\n{final_answer}\n\nScore 1 if the final answer tells the customer the "
        "correct outcome, as the tool results establish it, briefly and politely; 0.5 if it is correct but long, "
        "vague or impolite; 0 if it is wrong, missing or not backed by a tool result."),
    "efficiency": (
        "You grade how efficiently a customer-service agent worked.\n\nThe customer's request:\n{task}\n\n"
        "The agent's tool calls and their results:\n{tool_calls}\n\nThe conversation:\n{conversation}\n\n"
        "Score 1 if the agent made only the calls the request needs, each once, and no call failed; lower it "
        "for each repeated, failed or needless call or needless question; 0 if it never did the needed work."),
}
"""The LLM judge's prompts of the seed's two rubrics (a rubric's ``prompt`` in the config replaces them)."""


@dataclass
class PendingRubrics:
    """The rubrics of one episode left to an asynchronous judge (``tether.reward`` fills ``scored``/``failed``)."""

    rubrics: list[tuple[str, float, str]]  # (name, weight, prompt template)
    view: JudgeView
    scored: dict[str, float] = field(default_factory=dict)  # name -> score in [0, 1]
    failed: dict[str, str] = field(default_factory=dict)  # name -> why the judge failed


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
    pending: PendingRubrics | None = None  # rubrics left to the reward loop's judge (verifier.judge: llm)

    def as_failure(self) -> Verdict:
        """This episode scored as a failure (``termination.max_turns_exceeded: fail``): every component 0,
        ``success`` False; the hacking penalty still applies, so hacking never pays. Nothing is left to judge."""
        names = [*self.components, *(name for name, _, _ in self.pending.rubrics)] if self.pending else self.components
        return replace(self, reward=round(-self.hacking_penalty, 9) + 0.0,
                       components={name: 0.0 for name in names}, success=False, pending=None)

    def info(self) -> dict[str, Any]:
        out = {"reward_components": dict(self.components), "reward_weights": dict(self.weights),
               "hacking_flags": dict(self.hacking_flags), "hacking_penalty": self.hacking_penalty,
               "success": self.success, "ended_as_required": self.gate, "partial_credit": self.partial}
        if self.pending is not None:
            out["pending_judge"] = self.pending
        return out


def _checked(name: str, value: Any) -> float:
    value = float(value)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"verifier component {name!r} returned {value}; components must be in [0, 1]")
    return value


class HybridVerifier:
    """``judge=None`` defers the rubrics to an asynchronous judge: ``prompts`` gives each one's template."""

    def __init__(self, *, rules: Sequence[tuple[str, float]], rubrics: Sequence[tuple[str, float]],
                 rule_fns: Mapping[str, RuleFn], judge: Judge | None, gate: GateFn = lambda tr, task: True,
                 gated: Iterable[str] = (), penalty: Mapping[str, float] | None = None, type: str = "hybrid",
                 progress: ProgressFn = lambda world, tr, task: False, prompts: Mapping[str, str] | None = None):
        if type not in ("hybrid", "rule", "model"):
            raise ValueError(f"verifier.type must be 'hybrid', 'rule' or 'model', got {type!r}")
        missing = sorted({name for name, _ in rules} - set(rule_fns))
        if missing:
            raise ValueError(f"verifier.rule_based names unknown checks {missing}; known: {sorted(rule_fns)}")
        self.prompts = dict(prompts or {})
        if judge is None:
            unprompted = [name for name, _ in rubrics if name not in self.prompts]
            if unprompted:
                raise ValueError(f"rubrics {unprompted} have no prompt for the LLM judge: give each a `prompt` in "
                                 f"environment.verifier.model_based (built-in prompts: {sorted(BUILTIN_PROMPTS)})")
        elif isinstance(judge, DeterministicJudge):
            unknown = [f"model_based[{i}] ({name})" for i, (name, _) in enumerate(rubrics) if name not in judge.scorers]
            if unknown and type != "rule":
                raise ValueError(f"environment.verifier.{', '.join(unknown)}: the deterministic judge scores only "
                                 f"{sorted(judge.scorers)}; set environment.verifier.judge: llm with a prompt for "
                                 "another rubric")
        self.rules, self.rubrics = list(rules), list(rubrics)
        self.rule_fns, self.judge, self.gate, self.progress = dict(rule_fns), judge, gate, progress
        self.gated = frozenset(gated)
        self.penalty = dict(penalty or {})
        self.type = type

    @classmethod
    def from_config(cls, verifier: Any, *, rule_fns: Mapping[str, RuleFn], judge: Judge,
                    gate: GateFn, gated: Iterable[str] = (),
                    progress: ProgressFn = lambda world, tr, task: False) -> HybridVerifier:
        """From a ``VerifierConfig``; penalties apply only when anti-hacking is enabled. ``judge`` scores the rubrics
        unless ``verifier.judge`` is ``llm``: then they are deferred, each with its ``prompt`` (or the built-in one)."""
        ah = verifier.anti_hacking
        penalty = {p: ah.penalty.get(p, 0.0) for p in ah.detect_patterns} if ah.enabled else {}
        llm = getattr(verifier, "judge", "deterministic") == "llm"
        prompts = {r.rubric: r.prompt or BUILTIN_PROMPTS.get(r.rubric) for r in verifier.model_based} if llm else {}
        return cls(rules=[(r.check, r.weight) for r in verifier.rule_based],
                   rubrics=[(r.rubric, r.weight) for r in verifier.model_based],
                   rule_fns=rule_fns, judge=None if llm else judge, gate=gate, gated=gated, penalty=penalty,
                   type=verifier.type, progress=progress,
                   prompts={k: v for k, v in prompts.items() if v is not None})

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
        deferred: list[tuple[str, float, str]] = []
        if self.type != "rule":
            for name, weight in self.rubrics:
                ok = gate or name not in self.gated
                if not ok:
                    components[name] = 0.0
                elif self.judge is None:
                    deferred.append((name, weight, self.prompts[name]))
                else:
                    components[name] = _checked(name, self.judge.score(name, transcript, task))
        flags = {p: n for p, n in (hacking_flags or {}).items() if n}
        pen = penalty_of(flags, self.penalty)
        weights = self.weights
        reward = sum(weights[name] * c for name, c in components.items()) - pen
        success = gate and all(s == 1.0 for s in rule_scores.values())
        pending = PendingRubrics(deferred, judge_view(transcript, task)) if deferred else None
        return Verdict(round(reward, 9), components, weights, flags, round(pen, 9), success, gate, by_progress,
                       pending)
