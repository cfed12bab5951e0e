"""Bounded staleness, enforced twice: admission control before a group starts, a filter when it is consumed.

Versions are *parameter* versions: the trainer's ``param_version``, raised by one at every weight sync
(every ``trainer.trigger_parameter_sync_step`` trainer steps). A model token carries the version that
sampled it (``Trajectory.versions``; -1 on tool/user tokens, which no policy sampled).

**Lag of a group** = current version − the *oldest* version among its model tokens. A group ages as a
unit (its advantages are relative within it), and with partial rollouts one trajectory may hold tokens
of several versions: the oldest one is the conservative bound on how far behaviour and target differ.
A group without any model token has no lag (``None``): there is nothing the policy sampled to be stale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from tether.pipeline.scheduler import Signal
from tether.types import Group, Trajectory

G = TypeVar("G")


def _group(item) -> Group:
    """A ``Group``, or the group of a record that wraps one (``QueuedGroup``)."""
    return item if isinstance(item, Group) else item.group


def model_token_versions(trajectories: Sequence[Trajectory]) -> list[int]:
    """The versions of every model token (mask 1); -1 entries are skipped (a token no policy sampled)."""
    return [v for t in trajectories for s in t.segments for m, v in zip(s.response_mask, s.versions)
            if m == 1 and v >= 0]


def oldest_version(group: Group) -> int | None:
    versions = model_token_versions(group.trajectories)
    return min(versions) if versions else None


def policy_lag(group: Group, current_version: int) -> int | None:
    oldest = oldest_version(group)
    return None if oldest is None else current_version - oldest


def mask_older_segments(traj: Trajectory) -> int:
    """``reuse_policy: on_policy_segment_only``: of a partial rollout (model tokens of several versions),
    train only on the segment of its newest version; the older segments stay in the sequence as context.
    Clears their ``response_mask`` in place (versions and logprobs are kept) and returns how many tokens
    it removed from training. The lag of the trajectory then counts from that newest segment."""
    versions = model_token_versions([traj])
    if not versions or min(versions) == max(versions):
        return 0
    newest, masked = max(versions), 0
    for seg in traj.segments:  # memory segments (tether.types): every one of them, in place
        for i, (m, v) in enumerate(zip(seg.response_mask, seg.versions)):
            if m == 1 and 0 <= v < newest:
                seg.response_mask[i] = 0
                masked += 1
    return masked


def stale_filter(groups: Sequence[G], current_version: int, max_policy_lag: int) -> tuple[list[G], list[G]]:
    """Split into ``(kept, dropped)``: dropped when ``policy_lag > max_policy_lag`` (``buffer.stale_filter``).

    Accepts ``Group``s or records with a ``.group`` (``QueuedGroup``); order is kept within each list.
    Groups without model tokens are kept. Report the dropped ones to ``MessageQueue.report_stale``.
    """
    kept: list[G] = []
    dropped: list[G] = []
    for item in groups:
        lag = policy_lag(_group(item), current_version)
        (dropped if lag is not None and lag > max_policy_lag else kept).append(item)
    return kept, dropped


def version_lag_stats(trajectories: Sequence[Trajectory], current_version: int) -> dict[str, float]:
    """Per-token lag ``current_version − version`` over every model token of ``trajectories``.

    Mean and max over tokens, not over trajectories; both 0.0 when there is no model token.
    """
    lags = [current_version - v for v in model_token_versions(trajectories)]
    if not lags:
        return {"rollout/policy_version_lag_mean": 0.0, "rollout/policy_version_lag_max": 0.0}
    return {"rollout/policy_version_lag_mean": sum(lags) / len(lags),
            "rollout/policy_version_lag_max": float(max(lags))}


class AdmissionController:
    """AReaL's staleness-bounded admission (paper Eq. 3, ``areal/infra/staleness_manager.py``).

    At parameter version v at most ``(v − initial_version + max_staleness + 1) · groups_per_step`` groups
    may have been started in total (minus those ``release``d). ``groups_per_step`` is the number of groups
    the trainer consumes per *parameter version* (groups per trainer step × trigger_parameter_sync_step).
    If the trainer consumes in start order, group ``seq`` is trained at version ⌊seq / groups_per_step⌋
    and was started at a version ≥ that − max_staleness, so its lag is at most ``max_staleness``.
    With ``max_staleness = 0`` only the batch of the current version can be generated: the sync schedule.

    Departure from AReaL: no ``max_concurrent − running`` term (the rollouter's own concurrency limit
    does that). Start positions (``seq``) are handed out here, 0, 1, 2, …, and are never reused.
    """

    def __init__(self, max_staleness: int, groups_per_step: int, *, initial_version: int = 0):
        if max_staleness < 0 or groups_per_step < 1:
            raise ValueError(f"need max_staleness >= 0 and groups_per_step >= 1, got {max_staleness}, "
                             f"{groups_per_step}")
        self.max_staleness, self.groups_per_step = max_staleness, groups_per_step
        self._initial_version = self._version = initial_version
        self._next_seq = 0  # starts handed out
        self._released = 0  # starts given back (never delivered)
        self._closed = False
        self._signal = Signal()

    @property
    def version(self) -> int:
        return self._version

    @property
    def started(self) -> int:
        return self._next_seq

    def _capacity(self) -> int:
        allowed = (self._version - self._initial_version + self.max_staleness + 1) * self.groups_per_step
        return allowed - (self._next_seq - self._released)

    @property
    def capacity(self) -> int:
        """How many more groups may start now (0 when closed)."""
        with self._signal.lock:
            return 0 if self._closed else max(self._capacity(), 0)

    def _try_start_locked(self) -> int | None:
        if self._closed or self._capacity() <= 0:
            return None
        self._next_seq += 1
        return self._next_seq - 1

    def try_start(self) -> int | None:
        """Take a start slot: its start position ``seq``, or ``None`` when the bound (or close) forbids it."""
        with self._signal.lock:
            return self._try_start_locked()

    def _attempt(self) -> int | bool | None:
        seq = self._try_start_locked()
        return seq if seq is not None else (False if self._closed else None)

    async def wait_to_start_async(self, timeout: float | None = None) -> int | None:
        """Wait, in the rollouter's event loop (suspending the task, not the loop), until a slot is free and take
        it; ``None`` on timeout or close."""
        r = await self._signal.wait_async(self._attempt, timeout)
        return None if r is False else r

    def on_version(self, version: int) -> None:
        """The trainer published ``version``; waiters whose slot is now allowed wake up."""
        with self._signal.lock:
            if version < self._version:
                raise ValueError(f"parameter version went back from {self._version} to {version}")
            self._version = version
            self._signal.notify_all()

    def release(self, n: int = 1) -> None:
        """Give back ``n`` started groups that will never reach the trainer (a failed episode, or a group the stale
        filter dropped), so that the version still gets its ``groups_per_step`` groups (AReaL does this for rejected
        rollouts)."""
        with self._signal.lock:
            if n < 0 or self._released + n > self._next_seq:
                raise ValueError(f"release({n}) with {self._next_seq} started, {self._released} released")
            self._released += n
            self._signal.notify_all()

    def close(self) -> None:
        with self._signal.lock:
            self._closed = True
            self._signal.notify_all()
