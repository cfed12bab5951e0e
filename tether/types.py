"""Typed records passed between stages: Task → Trajectory → Group → (later) Batch.

A Trajectory is token-in/token-out: the ids the model saw and produced, never a re-tokenisation of the
finished conversation (verl found re-tokenising breaks convergence). Every response token carries a
mask bit (1 = sampled by the policy, 0 = tool/user/template token), the behaviour logprob it was
sampled with (0.0 where mask is 0) and the policy version that produced it (-1 where mask is 0).

**Segments.** When ``environment.state.memory`` bounds what the policy sees (``keep_recent_k``), an episode
is played in context *segments*: when the conversation holds more than ``k`` completed turns, the agent loop
continues in a new segment whose prompt is the system prompt, the opening request, the summary of the turns
that fell out and the last ``k`` turns (``tether.agent.loop``). Each segment is token-in/token-out on its own
(its prompt ids, response ids, mask, behaviour logprobs and versions); a model token belongs to exactly one
segment (the one it was generated in), and every segment shares the episode's reward and advantage.

A ``Trajectory``'s own ``prompt_ids`` … ``versions`` are its **first** segment, so an episode that never reached
the bound (one segment) reads exactly as before; later segments are in ``continuations``, and ``segments``
lists all of them (the first one as a view over the trajectory's own lists: mutating
``traj.segments[0].response_mask`` mutates ``traj.response_mask``). Code that trains on or counts tokens
iterates ``segments``. (Not to be confused with the *version* segments of a partial rollout: runs of model
tokens of one policy version inside a sequence, see ``tether.pipeline.staleness``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

USER_TOOL = "respond_to_user"
"""The action that speaks to the user: a reply in plain text is this call (agent loops, replays, the diversity
signature)."""


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
class Segment:
    """One token-in/token-out context of an episode: what the engine was given, what it produced."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # [R] 1 = model token
    logprobs: list[float] = field(default_factory=list)  # [R] behaviour logprob, 0.0 where mask 0
    versions: list[int] = field(default_factory=list)  # [R] policy version, -1 where mask 0

    @property
    def num_model_tokens(self) -> int:
        return sum(self.response_mask)

    def check(self, name: str = "segment") -> None:
        """Raise if the per-token arrays disagree in length (a bug in assembly, never user input)."""
        n = len(self.response_ids)
        if not (len(self.response_mask) == len(self.logprobs) == len(self.versions) == n):
            raise AssertionError(
                f"{name}: response_ids {n}, response_mask {len(self.response_mask)}, "
                f"logprobs {len(self.logprobs)}, versions {len(self.versions)} must all be equal"
            )


@dataclass
class TeacherScores:
    """A teacher's scores of one segment's response tokens (on-policy distillation, ``tether.teacher``)."""

    logprobs: list[float]  # [R] teacher log-prob of each response token (temperature 1)
    top_ids: list[list[int]] | None = None  # [R][<=K] the teacher's most likely ids at each position, best first
    top_logprobs: list[list[float]] | None = None  # [R][<=K] their log-probs
    latency_s: float = 0.0  # wall time from asking to answer (queueing included)


@dataclass
class Trajectory:
    """One episode. Its ``prompt_ids`` … ``versions`` are the first segment; see the module docstring."""

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
    truncated: bool = False  # cut by a limit, scored on what was done (Gymnasium's truncation)
    max_turns_failed: bool = False  # hit environment.state.max_turns under max_turns_exceeded: fail (scored 0)
    termination: str = ""  # why the episode ended, e.g. "user_issue_resolved", "max_turns"
    num_tool_calls: int = 0
    num_user_turns: int = 0
    num_assistant_turns: int = 0
    errors: list[str] = field(default_factory=list)
    metrics: AgentLoopMetrics = field(default_factory=AgentLoopMetrics)
    continuations: list[Segment] = field(default_factory=list)  # segments after the first, in order
    pending_judge: Any = None  # rubrics left to the reward loop's judge (tether.env.verifier.PendingRubrics)
    teacher: list[TeacherScores] | None = None  # one per segment, when a teacher scored the episode

    @property
    def segments(self) -> list[Segment]:
        """Every segment, first to last; the first shares its lists with this trajectory's own fields."""
        first = Segment(self.prompt_ids, self.response_ids, self.response_mask, self.logprobs, self.versions)
        return [first, *self.continuations]

    @property
    def num_model_tokens(self) -> int:
        return sum(s.num_model_tokens for s in self.segments)

    def check(self) -> None:
        """Raise if the per-token arrays of a segment disagree in length (a bug in assembly, never user input)."""
        for i, seg in enumerate(self.segments):
            seg.check(f"trajectory {self.task_id}" + (f" segment {i}" if i else ""))


@dataclass
class Group:
    """The group_size trajectories of one task; advantages are relative within it and it ages as one."""

    task_id: str
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]
