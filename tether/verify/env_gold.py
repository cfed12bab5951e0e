"""``tether verify env``'s row for a ``tau2:<domain>`` environment: the anti-hacking detectors on tau2's gold.

Every gold trajectory of the domain (``tether.env.tau2.gold``: the gold actions, then the message to the user) is
played through the adapter under the configured ``environment`` section. tau2 scores each 1, so a flag of a call
pattern on one is a false positive (a correct trajectory losing ``anti_hacking.penalty``), and an episode cut
before its last step by ``state.max_turns`` or ``termination.tool_error_threshold`` is one tau2 passes and tether
scores 0. The row gives both as counts over the domain's gold episodes, per pattern; the replays are not scored
(the call patterns are judged per step), about 0.1 s a task.
"""

from __future__ import annotations

from tether.config import RunConfig
from tether.config.environment import TAU2_PREFIX
from tether.verify.env_probes import Check

NAME = "anti_hacking/gold replays"


def check_gold_replays(cfg: RunConfig) -> Check | None:
    """The gold false-positive row of a tau2 environment (None for any other environment)."""
    env = cfg.environment
    if not env.name.startswith(TAU2_PREFIX):
        return None
    from tether.env.tau2.gold import CALL_PATTERNS, flag_table, replay_gold  # noqa: PLC0415 — the optional extra

    domain = env.name[len(TAU2_PREFIX):]
    replays = replay_gold(domain, env, score=False)
    row = flag_table(replays)[domain]
    n = row["episodes"]
    per = ", ".join(f"{p} {row[p]}/{n}" for p in CALL_PATTERNS)
    seen = f"{row['flagged']}/{n} gold episodes flagged ({per}), {row['ended_early']} cut by the limits"
    ah = env.verifier.anti_hacking
    if row["flagged"]:
        first = next(r for r in replays if r.false_positive)
        return Check(NAME, "fail", seen,
                     f"tau2 passes its gold trajectories, yet the detectors flag {row['flagged']} of them (task "
                     f"{first.task_id}: {first.flags}), each costing environment.verifier.anti_hacking.penalty: look "
                     f"at anti_hacking.repeat_window = {ah.repeat_window}, max_repeats = {ah.max_repeats} and "
                     f"detect_patterns")
    if row["ended_early"]:
        first = next(r for r in replays if r.steps < r.script_steps)
        return Check(NAME, "warn", seen,
                     f"{row['ended_early']} gold trajectories end before their last step (task {first.task_id}: "
                     f"{first.script_steps} steps, ended {first.termination} at {first.steps}), scored 0 where tau2 "
                     f"scores 1: environment.state.max_turns = {env.state.max_turns} / termination."
                     f"tool_error_threshold = {env.termination.tool_error_threshold} are tighter than tau2's own "
                     f"limits; unset them to take tau2's")
    return Check(NAME, "pass", seen)
