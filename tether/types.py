"""Typed records passed between stages: Task → Trajectory → Group → (later) Batch.

A Trajectory is token-in/token-out: the ids the model saw and produced, never a re-tokenisation of the
finished conversation (verl found re-tokenising breaks convergence). Every response token carries a
mask bit (1 = sampled by the policy, 0 = tool/user/template token), the behaviour logprob it was
sampled with (0.0 where mask is 0) and the policy version that produced it (-1 where mask is 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One episode specification of an environment."""

    id: str
    split: str  # "train" | "eval"
    kind: str  # environment-specific category, e.g. "refund_stated"
    data: dict[str, Any] = field(default_factory=dict)  # what the env needs to set the episode up
    tools: tuple[str, ...] | None = None  # per-sample tool selection; None = every tool


@dataclass
class AgentLoopMetrics:
    """Per-trajectory timings (seconds) and counters, named as in verl's AgentLoopMetrics."""

    generate_sequences: float = 0.0  # time spent waiting for the engine
    tool_calls: float = 0.0  # time spent executing tools (wall, parallel calls overlap)
    compute_score: float = 0.0  # time spent in the verifier
    num_preempted: int = 0  # generations interrupted by a weight sync and resumed
    num_turns: int = 0  # user turns + assistant turns + 1, as in verl


@dataclass
class Trajectory:
    task_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # [R] 1 = model token
    logprobs: list[float] = field(default_factory=list)  # [R] behaviour logprob, 0.0 where mask 0
    versions: list[int] = field(default_factory=list)  # [R] policy version, -1 where mask 0
    messages: list[dict[str, Any]] = field(default_factory=list)  # readable conversation
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    hacking_flags: dict[str, int] = field(default_factory=dict)  # pattern -> times detected
    success: bool = False
    truncated: bool = False
    termination: str = ""  # why the episode ended, e.g. "user_issue_resolved", "max_turns"
    num_tool_calls: int = 0
    num_user_turns: int = 0
    num_assistant_turns: int = 0
    errors: list[str] = field(default_factory=list)
    metrics: AgentLoopMetrics = field(default_factory=AgentLoopMetrics)

    @property
    def num_model_tokens(self) -> int:
        return sum(self.response_mask)

    def check(self) -> None:
        """Raise if the per-token arrays disagree in length (a bug in assembly, never user input)."""
        n = len(self.response_ids)
        if not (len(self.response_mask) == len(self.logprobs) == len(self.versions) == n):
            raise AssertionError(
                f"trajectory {self.task_id}: response_ids {n}, response_mask {len(self.response_mask)}, "
                f"logprobs {len(self.logprobs)}, versions {len(self.versions)} must all be equal"
            )


@dataclass
class Group:
    """The group_size trajectories of one task; advantages are relative within it and it ages as one."""

    task_id: str
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]
