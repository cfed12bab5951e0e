"""``tether verify env``: drive the configured environment with scripted probes and check it (issue 14 item 1).

The source document's step 4.1: "tool calls return structured observations, the reward is in a sensible range,
termination fires correctly". Every check runs on the environment itself (``env_factory``: reset / step /
finalize), no model involved, in a second or two:

- ``tool observations``: each tool of the action space called with valid arguments and with invalid ones
  (missing, unexpected, mistyped, out-of-enum, an unknown tool, a malformed action); every observation of every
  probe episode must carry the configured fields and show the policy (``observation_text``) a JSON tool result,
  ``{"error": ...}`` on an error.
- ``reward range``: every reward of every probe episode lies in the range the configured weights give,
  [−max_turns · Σ penalties, Σ counted weights], and not above 1 (the scale ``min_reward_std`` and the success
  figures are read on).
- ``termination/*``: the scripted expert's episodes end resolved (or escalated) with full reward; N bad calls
  end an episode with ``tool_errors`` at ``tool_error_threshold``; do-nothing steps end one at ``max_turns``
  with the configured ``max_turns_exceeded`` behaviour.
- ``verifier components``: each counted rule and rubric takes at least two values over the probe episodes
  (the expert's, the termination probes', random and adversarial ones); one stuck at a value carries no signal.
- ``anti_hacking/*``: a repeated identical call and a stuffed message planted in an expert episode are
  flagged and cost reward, when enabled and listed; on a ``tau2:<domain>`` environment, ``anti_hacking/gold
  replays``: how many of tau2's gold trajectories the detectors flag (false positives) or the limits cut
  (``env_gold.py``).

With ``policy=True`` a few episodes of the configured policy through the agent loop are checked for the same
structure and range. Each failure says which config key to look at.

Any environment runs these (customer service, a plugin ``ToolEnvironment``, tau2): the expert is the
environment's own (``ToolEnvironment.expert``); without one its checks are skipped, saying why. The checks that
hold for every environment (tool schemas and their rendering, the parser round trip, timeouts, do-nothing and
the no-op pass) are in env_generic.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping

from tether.config import EnvironmentConfig, RunConfig
from tether.env.termination import ESCALATED, MAX_TURNS, RESOLVED, TOOL_ERRORS, max_env_steps, max_turns_reachable
from tether.pipeline.rollouter import Rollouter
from tether.runtime import Runtime
from tether.types import Trajectory
from tether.verify.env_generic import (
    check_do_nothing,
    check_no_op_pass,
    check_parser,
    check_rendered,
    check_schemas,
    check_timeouts,
)
from tether.verify.env_gold import check_gold_replays
from tether.verify.env_probes import (  # the probes the checks read, the records they return
    EPS,
    Check,
    Episode,
    Probes,
    Status,
    counted_weights,
    observation_problem,
    reward_range,
    run_probes,
    weights_key,
)

__all__ = ["EPS", "Check", "Status", "check_policy", "exit_code", "render", "run_policy", "verify_env"]


def check_observations(p: Probes) -> Check:
    # tether's environments show the configured fields; another's (tau2) its own observation
    fields = list(p.cfg.environment.state.observation_fields) if p.tether_tools else ["last_tool_result"]
    n, problems = 0, []
    for label, ep, valid in p.tools:
        obs = ep.observations[-1]
        if valid is not None and isinstance(obs, Mapping) and obs.get("tool_error") is not (not valid):
            problems.append(f"{label}: tool_error is {obs.get('tool_error')} "
                            f"({str(obs.get('last_tool_result'))[:100]})")
    for ep in p.expert:  # the expert's calls, in the episodes they were made in, succeed
        for action, obs in zip(ep.actions, ep.observations[1:]):
            if isinstance(obs, Mapping) and obs.get("tool_error"):
                name = action.get("name") if isinstance(action, Mapping) else action
                problems.append(f"the expert's call of {name} on {ep.task.id} failed: "
                                f"{str(obs.get('last_tool_result'))[:100]}")
    for ep in p.episodes():
        for obs in ep.observations[1:]:
            n += 1
            problem = observation_problem(obs, fields, json_results=p.tether_tools)
            if problem:
                problems.append(f"{ep.probe} on {ep.task.id}: {problem}")
    unjudged = sum(valid is None for _, _, valid in p.tools)
    seen = f"{len(p.tools)} tool probes, {n} observations"
    if unjudged:
        seen += f" ({unjudged} calls judged for form only)"
    if not problems:
        form = "errors as {\"error\": ...}" if p.tether_tools else f"{p.env_kind}'s own result text"
        return Check("tool observations", "pass", f"{seen}: all structured, {form}")
    first = problems[0]
    if "last_tool_result" in first:
        key = "environment.state.observation_fields (add last_tool_result)"
    elif "timed out" in first:
        key = "environment.action_space[*].timeout_ms against latency_ms"
    elif "the expert's call" in first:
        key = "the tool's implementation and the environment's expert (ToolEnvironment.expert)"
    elif "valid" in first:
        key = "environment.action_space (a tool's params and timeout_ms) and the tool's implementation"
    else:
        key = "environment.state.observation_fields and the environment's observation code"
    return Check("tool observations", "fail", f"{seen}: {len(problems)} problems; first: {first}",
                 f"{first}. Look at {key}.")


def check_range(p: Probes) -> Check:
    lo, hi = reward_range(p.cfg.environment)
    rewards = [(r, ep) for ep in p.episodes() for r in ep.rewards]
    bad = [(r, ep) for r, ep in rewards if not (math.isfinite(r) and lo - EPS <= r <= hi + EPS)]
    seen_lo, seen_hi = min(r for r, _ in rewards), max(r for r, _ in rewards)
    seen = f"{len(rewards)} rewards in [{seen_lo:.3g}, {seen_hi:.3g}]; configured range [{lo:.3g}, {hi:.3g}]"
    if bad:
        r, ep = bad[0]
        return Check("reward range", "fail", seen,
                     f"{ep.probe} on {ep.task.id} got reward {r}, outside [{lo:.3g}, {hi:.3g}] that the verifier's "
                     f"weights and penalties allow: the verifier (environment.verifier) does not add up its "
                     f"components as configured")
    if seen_hi > 1 + EPS:
        return Check("reward range", "fail", seen,
                     f"the counted weights sum to {hi:g}, so a solved episode scores {hi:g} > 1 and rewards leave "
                     f"[0, 1], the scale advantage_estimation.degenerate_group_filter.min_reward_std and the "
                     f"success figures are read on; scale the weights to sum to 1: "
                     f"{weights_key(p.cfg.environment.verifier)}")
    return Check("reward range", "pass", seen)


def _errors(ep: Episode) -> list[str]:
    return [str(o.get("last_tool_result")) for o in ep.observations[1:]
            if isinstance(o, Mapping) and o.get("tool_error")]


def want_ending(ep: Episode) -> str | None:
    """The ending a solved episode must have: the customer-service tasks say (resolved, or escalated where
    ``must_escalate``); other environments' success is their verifier's."""
    if "must_escalate" not in ep.task.data:
        return None
    return ESCALATED if ep.task.data.get("must_escalate") else RESOLVED


def check_success(p: Probes) -> Check:
    if p.no_expert:
        return Check("termination/success", "skip", f"no expert to solve a task: {p.no_expert}")
    _, hi = reward_range(p.cfg.environment)
    env = p.cfg.environment
    bad = []
    for ep in p.expert:
        wanted = want_ending(ep)
        solved = ep.done and wanted in (None, ep.info.get("termination")) and ep.info.get("success")
        if not (solved and abs(ep.reward - hi) < EPS):
            bad.append(ep)
    n = len(p.expert)
    if not bad:
        how = "ended resolved or escalated as required" if want_ending(p.expert[0]) else "succeeded"
        return Check("termination/success", "pass", f"the expert's {n} episodes {how}, reward {hi:g} each")
    ep = bad[0]
    ending, steps = ep.info.get("termination"), ep.steps
    seen = (f"{len(bad)}/{n} expert episodes not solved; {ep.task.id} ({ep.task.kind}) ended "
            f"{ending or 'never'} after {steps} steps, reward {ep.reward:.3g}")
    if ending == MAX_TURNS:
        why = (f"environment.state.max_turns = {env.state.max_turns} cuts the episode before the expert's "
               f"{len(ep.task.data.get('solution', []))}-step solution ends; raise it")
    elif ending == TOOL_ERRORS:
        errs = _errors(ep)
        timed_out = [e for e in errs if "timed out" in e]
        threshold = env.termination.tool_error_threshold
        why = (f"its calls failed: {errs[:2]}; look at environment.action_space[*].timeout_ms against latency_ms"
               if timed_out else f"its calls failed: {errs[:2]}; look at environment.action_space and "
                                 f"environment.termination.tool_error_threshold = {threshold}")
    elif ep.info.get("hacking_flags"):
        why = (f"anti-hacking flagged the expert's clean episode {ep.info['hacking_flags']}: look at "
               f"environment.verifier.anti_hacking.repeat_window / detect_patterns (a false positive)")
    elif ending == want_ending(ep) or (want_ending(ep) is None and ep.done):
        low = {k: v for k, v in ep.info.get("reward_components", {}).items() if v < 1}
        why = (f"it ended as required but components {low} score below 1: look at "
               f"environment.verifier (rule_based / model_based) and environment.termination.success_criteria")
    else:
        why = "look at environment.termination and the expert's tools in environment.action_space"
    return Check("termination/success", "fail", seen, f"{ep.task.id}: {why}.")


def check_tool_errors(p: Probes) -> Check:
    env, loop = p.cfg.environment, p.cfg.agent_loop
    threshold, max_turns = env.termination.tool_error_threshold, env.state.max_turns
    ep = p.tool_errors
    assert ep is not None
    ending = ep.info.get("termination")
    seen = f"{ep.steps} bad calls ended the episode with {ending or 'nothing'} (tool_error_threshold {threshold})"
    if not (ep.done and ending in (TOOL_ERRORS, "too_many_errors") and ep.steps == threshold):
        if threshold > max_turns:
            why = (f"environment.termination.tool_error_threshold = {threshold} is above environment.state.max_turns "
                   f"= {max_turns}: an episode always ends at max_turns first, so tool_errors can never fire; set it "
                   f"to at most {max_turns}")
        else:
            why = (f"{threshold} bad calls should end the episode with tool_errors; look at "
                   f"environment.termination.tool_error_threshold and the environment's error counting")
        return Check("termination/tool_errors", "fail", seen, why)
    steps = max_env_steps(loop.max_assistant_turns, loop.max_parallel_calls)
    if threshold > steps:
        return Check("termination/tool_errors", "warn", seen,
                     f"fires in the environment, but the agent loop stops an episode after agent_loop."
                     f"max_assistant_turns × max_parallel_calls = {steps} < tool_error_threshold = {threshold} calls")
    return Check("termination/tool_errors", "pass", seen)


def check_max_turns(p: Probes) -> Check:
    env, loop = p.cfg.environment, p.cfg.agent_loop
    max_turns, behaviour = env.state.max_turns, env.termination.max_turns_exceeded
    ep = p.max_turns
    if ep is None:
        return Check("termination/max_turns", "skip", p.no_idle)
    info, ending = ep.info, ep.info.get("termination")
    seen = f"{ep.steps} do-nothing steps ended the episode with {ending or 'nothing'}, reward {ep.reward:.3g}"
    problem = None
    if not (ep.done and ending == MAX_TURNS and ep.steps == max_turns):
        problem = f"the episode should end with max_turns at step {max_turns} (environment.state.max_turns)"
        if ending == TOOL_ERRORS:
            problem += "; do-nothing steps were counted as tool errors (environment.action_space)"
    elif behaviour == "truncate" and not (info.get("truncated") and not info.get("max_turns_failed")):
        problem = ("environment.termination.max_turns_exceeded = truncate, but the episode was not marked truncated "
                   f"(info: truncated={info.get('truncated')}, max_turns_failed={info.get('max_turns_failed')})")
    elif behaviour == "fail" and not (info.get("max_turns_failed") and not info.get("truncated")
                                      and not info.get("success")
                                      and all(v == 0 for v in info.get("reward_components", {}).values())):
        problem = ("environment.termination.max_turns_exceeded = fail, but the episode was not scored as a failure "
                   f"(components {info.get('reward_components')})")
    if problem:
        return Check("termination/max_turns", "fail", seen, problem)
    seen += f" ({behaviour})"
    if not max_turns_reachable(p.cfg):
        steps = max_env_steps(loop.max_assistant_turns, loop.max_parallel_calls)
        return Check("termination/max_turns", "warn", seen,
                     f"fires in the environment, but under the agent loop an episode takes at most agent_loop."
                     f"max_assistant_turns × max_parallel_calls = {steps} steps < environment.state.max_turns = "
                     f"{max_turns}: the loop's own limit ends it, and max_turns_exceeded: {behaviour} never acts")
    return Check("termination/max_turns", "pass", seen)


def check_components(p: Probes) -> Check:
    values: dict[str, set[float]] = {}
    n = 0
    for ep in p.episodes():
        comps = ep.info.get("reward_components") if ep.done else None
        if comps:
            n += 1
            for k, v in comps.items():
                values.setdefault(k, set()).add(round(float(v), 6))
    # tether's verifier: the configured components; another's (tau2's evaluator): the components it reported
    weights = counted_weights(p.cfg.environment.verifier) if p.tether_tools else {k: 1.0 for k in values}
    counted = list(weights)
    stuck = {k: sorted(values.get(k, set())) for k in counted if len(values.get(k, set())) < 2}
    seen = ", ".join(f"{k}: {len(values.get(k, set()))} values" for k in counted) + f" over {n} episodes"
    if stuck:
        v = p.cfg.environment.verifier
        keys = [f"environment.verifier.rule_based[{i}] ({r.check})" for i, r in enumerate(v.rule_based)
                if r.check in stuck]
        keys += [f"environment.verifier.model_based[{i}] ({r.rubric})" for i, r in enumerate(v.model_based)
                 if r.rubric in stuck]
        keys = keys or [f"{p.env_kind}'s own evaluator"]
        desc = "; ".join(f"{k} scored only {vals}" for k, vals in stuck.items())
        if p.no_expert:  # nothing solved a task: a component may be stuck only because no probe earned it
            return Check("verifier components", "warn", seen,
                         f"{desc} across {n} probe episodes, none by an expert ({p.no_expert}): a component no probe "
                         f"earns looks stuck; look at {', '.join(keys)} if a solved episode should move it")
        return Check("verifier components", "fail", seen,
                     f"{desc} across {n} probe episodes (expert, failures, random): a component stuck at one value "
                     f"carries no signal; look at {', '.join(keys)} and its scoring function")
    zero = [k for k in counted if weights[k] == 0]
    if zero:
        return Check("verifier components", "warn", seen,
                     f"{zero} score but have weight 0: they never move the reward "
                     f"({weights_key(p.cfg.environment.verifier)})")
    return Check("verifier components", "pass", seen)


def check_hacking(p: Probes) -> list[Check]:
    ah = p.cfg.environment.verifier.anti_hacking
    out = []
    if p.no_expert:
        return [Check(f"anti_hacking/{pattern}", "skip", f"no expert episode to plant it in: {p.no_expert}")
                for pattern in ("repeated_tool_calls", "context_stuffing")]
    for pattern, (clean, hacked) in p.planted.items():
        name = f"anti_hacking/{pattern}"
        if not clean.info.get("success"):
            out.append(Check(name, "skip", f"the clean expert episode of {clean.task.id} ended "
                                           f"{clean.info.get('termination')} unsolved: nothing to plant a hack in "
                                           f"(see termination/success)"))
            continue
        flags = hacked.info.get("hacking_flags", {}) or {}
        seen = (f"planted in an expert episode: flagged {flags.get(pattern, 0)}×, penalty "
                f"{hacked.info.get('hacking_penalty', 0):.3g}, reward {hacked.reward:.3g} vs {clean.reward:.3g} clean")
        if not ah.enabled or pattern not in ah.detect_patterns:
            why = ("environment.verifier.anti_hacking.enabled is false" if not ah.enabled else
                   f"{pattern} is not in environment.verifier.anti_hacking.detect_patterns")
            if flags.get(pattern):
                out.append(Check(name, "fail", seen, f"{why}, yet the pattern was flagged"))
            else:
                out.append(Check(name, "warn", seen, f"{why}: this hack goes undetected and unpenalised"))
            continue
        penalty = ah.penalty.get(pattern, 0.0)
        if not flags.get(pattern):
            out.append(Check(name, "fail", seen,
                             f"a planted {pattern} was not flagged; look at environment.verifier.anti_hacking."
                             f"repeat_window = {ah.repeat_window} and the detector (tether/env/anti_hacking.py)"))
        elif penalty <= 0 or not hacked.info.get("hacking_penalty"):
            out.append(Check(name, "fail", seen,
                             f"flagged but free: environment.verifier.anti_hacking.penalty.{pattern} = {penalty:g}, "
                             f"so the hack costs nothing; set a penalty > 0"))
        elif hacked.reward >= clean.reward:
            out.append(Check(name, "fail", seen,
                             f"the hacked episode scored {hacked.reward:.3g} ≥ the clean {clean.reward:.3g}: the hack "
                             f"pays; raise environment.verifier.anti_hacking.penalty.{pattern}"))
        else:
            out.append(Check(name, "pass", seen))
    return out


def verify_env(cfg: RunConfig, *, num_tasks: int = 10, random_episodes: int = 8, seed: int = 0,
               policy: bool = False) -> list[Check]:
    """Run every probe on ``cfg``'s environment and return the checks (``policy``: also the policy's episodes)."""
    probes = run_probes(cfg, num_tasks=num_tasks, random_episodes=random_episodes, seed=seed)
    checks = [check_schemas(probes), check_rendered(probes), check_parser(probes), check_observations(probes),
              check_timeouts(probes), check_range(probes), check_do_nothing(probes), check_no_op_pass(probes),
              check_success(probes), check_tool_errors(probes), check_max_turns(probes), check_components(probes),
              *check_hacking(probes)]
    gold = check_gold_replays(cfg)  # a tau2 environment: the detectors on tau2's gold trajectories
    if gold is not None:
        checks.append(gold)
    if policy:
        checks += check_policy(cfg.environment, cfg.tool_parser.name, run_policy(cfg))
    return checks


# ----------------------------------------------------------------------------------------------- the policy
def run_policy(cfg: RunConfig, num_tasks: int = 4, group_size: int = 2) -> list[Trajectory]:
    """``group_size`` episodes of each of the first ``num_tasks`` held-out tasks, by the configured policy through
    the configured agent loop (``Runtime`` + ``Rollouter``, as ``tether eval`` runs them)."""
    rt = Runtime.build(cfg)
    try:
        groups = asyncio.run(Rollouter(rt.loop(), rt.make_env, rewards=rt.rewards).groups(rt.tasks("eval")[:num_tasks],
                                                                      group_size=group_size, seed=0, keep_failed=True))
    finally:
        rt.close()
    return [t for g in groups for t in g.trajectories]


# A tool call written as text: hermes' <tool_call> tag, or a JSON object with a name and arguments.
_CALL_TEXT = re.compile(r"<tool_call>|\{\s*\"name\"\s*:.*\"(arguments|parameters)\"", re.DOTALL)


def check_policy(environment: EnvironmentConfig, parser: str, trajs: list[Trajectory]) -> list[Check]:
    """The policy's episodes (run under ``environment`` and the tool parser ``parser``): rewards in range, tool
    messages structured, tool calls parsed."""
    lo, hi = reward_range(environment)
    rewards = [t.reward for t in trajs]
    bad = [r for r in rewards if not (math.isfinite(r) and lo - EPS <= r <= hi + EPS)]
    seen = f"{len(trajs)} policy episodes, rewards in [{min(rewards, default=0):.3g}, {max(rewards, default=0):.3g}]"
    out = [Check("policy/reward range", "fail", seen, f"rewards {bad[:3]} outside [{lo:.3g}, {hi:.3g}]: look at "
                                                     f"environment.verifier") if bad else
           Check("policy/reward range", "pass", seen)]
    tool_msgs = [m for t in trajs for m in t.messages if m.get("role") == "tool"]
    unstructured = []
    for m in tool_msgs:
        try:
            json.loads(str(m.get("content", "")).split("\n", 1)[0])
        except json.JSONDecodeError:
            unstructured.append(str(m.get("content"))[:80])
    seen = f"{len(tool_msgs)} tool messages"
    out.append(Check("policy/tool observations", "fail", f"{seen}, {len(unstructured)} not JSON",
                     f"the tool message {unstructured[0]!r} is not JSON: look at environment.state.observation_fields "
                     f"(last_tool_result)") if unstructured else Check("policy/tool observations", "pass", seen))
    calls = sum(t.num_tool_calls for t in trajs)
    written = [str(m.get("content"))[:80] for t in trajs for m in t.messages
               if m.get("role") == "assistant" and not m.get("tool_calls") and _CALL_TEXT.search(str(m.get("content")))]
    seen = f"{calls} tool calls parsed in {len(trajs)} episodes, {len(written)} assistant messages that look like one"
    if written and (calls == 0 or len(written) > calls):
        out.append(Check("policy/tool calls", "fail", seen,
                         f"the model writes tool calls the parser does not read (e.g. {written[0]!r}): look at "
                         f"tool_parser.name = {parser} and tool_parser.stop_token_ids against the "
                         f"model's chat template"))
    elif calls == 0:
        out.append(Check("policy/tool calls", "fail", seen,
                         "the policy made no tool call in any episode: an untrained model never calls a tool "
                         "(model.preset: tiny); warm-start it (tether sft, or model.preset: tiny-sft), or look at "
                         "tool_parser.name and the model's chat template"))
    else:
        out.append(Check("policy/tool calls", "pass", seen))
    return out


# ----------------------------------------------------------------------------------------------- output
def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':<{width}}  result  seen", f"{'-' * width}  ------  ----"]
    lines += [f"{c.name:<{width}}  {c.status:<6}  {c.seen}" for c in checks]
    notes = [c for c in checks if c.status in ("fail", "warn") and c.diagnosis]
    if notes:
        lines.append("")
        lines += [f"{c.status.upper()} {c.name}: {c.diagnosis}" for c in notes]
    counts = {s: sum(c.status == s for c in checks) for s in ("pass", "warn", "skip", "fail")}
    lines += ["", ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "fail" for c in checks) else 0
