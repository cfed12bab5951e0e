"""What every agent loop does alike (the ``tool_agent`` loop, ``agent_loop.name: program``): how the environment's
final info becomes the trajectory's outcome."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tether.env.termination import CUT_REASONS
from tether.types import Trajectory


def apply_final_info(traj: Trajectory, info: Mapping[str, Any]) -> None:
    """Set ``traj``'s outcome from the info of the step that ended the episode (or of ``env.finalize``)."""
    traj.reward_components = dict(info.get("reward_components", {}))
    traj.pending_judge = info.get("pending_judge")  # rubrics the reward loop scores (verifier.judge: llm)
    traj.hacking_flags = dict(info.get("hacking_flags", {}))
    traj.success = bool(info.get("success", False))
    traj.termination = str(info.get("termination", ""))
    traj.truncated = bool(info["truncated"]) if "truncated" in info else traj.termination in CUT_REASONS
    traj.max_turns_failed = bool(info.get("max_turns_failed", False))
