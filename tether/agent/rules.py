"""What every agent loop does alike (the ``tool_agent`` loop, ``agent_loop.name: program``, and the deployment path
of ``tether verify consistency``): which tool calls are refused, with what message, and how the environment's final
info becomes the trajectory's outcome."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from tether.env.termination import CUT_REASONS
from tether.types import Trajectory

EPISODE_ENDED = "error: the episode has ended"  # the one refusal not counted in the trajectory's errors


def refused_call(name: str, offered: Collection[str], *, env_done: bool, call_in_turn: int = 1,
                 max_parallel_calls: int | None = None) -> str | None:
    """The error observation of a tool call that is not run, or None to run it: the ``call_in_turn``-th call after
    one generation beyond ``max_parallel_calls`` (None: the caller counts no calls here), a tool the episode does
    not offer, or any call once the environment has ended the episode (``EPISODE_ENDED``)."""
    if max_parallel_calls is not None and call_in_turn > max_parallel_calls:
        return f"error: at most {max_parallel_calls} tool calls per turn; '{name}' was not run"
    if name not in offered:
        return f"error: tool '{name}' is not available; available: {sorted(offered)}"
    if env_done:
        return EPISODE_ENDED
    return None


def apply_final_info(traj: Trajectory, info: Mapping[str, Any]) -> None:
    """Set ``traj``'s outcome from the info of the step that ended the episode (or of ``env.finalize``), and add the
    scoring time the environment reports (``compute_score_s``) to ``traj.metrics.compute_score``: the loops time
    their own ``env.finalize`` call."""
    traj.reward_components = dict(info.get("reward_components", {}))
    traj.pending_judge = info.get("pending_judge")  # rubrics the reward loop scores (verifier.judge: llm)
    traj.hacking_flags = dict(info.get("hacking_flags", {}))
    traj.success = bool(info.get("success", False))
    traj.termination = str(info.get("termination", ""))
    traj.truncated = bool(info["truncated"]) if "truncated" in info else traj.termination in CUT_REASONS
    traj.max_turns_failed = bool(info.get("max_turns_failed", False))
    traj.metrics.compute_score += float(info.get("compute_score_s", 0.0))
