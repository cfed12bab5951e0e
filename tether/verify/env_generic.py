"""The checks of ``tether verify env`` that hold for any environment, whatever its tools and verifier:

- ``tool schemas``: every tool schema is a well-formed OpenAI function (a name, object parameters, ``required``
  among the properties, each property typed), names unique;
- ``tool schemas/rendered``: the configured model's chat template shows every tool and parameter name in the
  prompt (a template that ignores ``tools`` leaves the model guessing); skipped, saying why, when the model's
  tokenizer is not at hand without building a model;
- ``parser round-trip``: a call of every tool, written the way the configured ``tool_parser`` reads calls, parses
  back to the same name and arguments;
- ``timeouts``: no call with valid arguments timed out (``action_space[*].timeout_ms``), and how long the
  slowest call of each tool took;
- ``do nothing``: an episode that does nothing and stops is scored (an end, a finite reward in the verifier's
  range, a reward breakdown);
- ``no-op pass``: such an episode does not pass, or, where it does (tau2's database check passes a do-nothing
  agent on every task whose gold actions write nothing), anti-hacking flags it as ``no_op_pass``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from tether.agent.chat import render_ids
from tether.agent.parsers import get_parser
from tether.runtime import cache_dir, model_path
from tether.verify.env_probes import EPS, Check, Probes, reward_range
from tether.warmstart.tiny_sft import cache_key

_TYPED = ("type", "enum", "anyOf", "oneOf", "allOf", "$ref", "const")


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a well-formed OpenAI function-tool schema, or None."""
    if not isinstance(schema, Mapping) or schema.get("type") != "function" or not isinstance(
            schema.get("function"), Mapping):
        return f"not {{'type': 'function', 'function': {{...}}}}: {str(schema)[:80]}"
    fn = schema["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        return f"a function without a name: {str(fn)[:80]}"
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or params.get("type") != "object":
        return f"{name}: parameters must be a JSON schema of type object, got {str(params)[:80]}"
    props = params.get("properties", {})
    if not isinstance(props, Mapping):
        return f"{name}: properties must be an object"
    missing = [r for r in params.get("required", []) if r not in props]
    if missing:
        return f"{name}: required {missing} are not among its properties {list(props)}"
    untyped = [p for p, spec in props.items() if not (isinstance(spec, Mapping) and any(k in spec for k in _TYPED))]
    if untyped:
        return f"{name}: parameters {untyped} have no type (a type hint on the function's argument)"
    return None


def check_schemas(p: Probes) -> Check:
    names = [s.get("function", {}).get("name") if isinstance(s, Mapping) else None for s in p.schemas]
    problems = [f"{problem}" for s in p.schemas if (problem := schema_problem(s))]
    doubled = sorted({n for n in names if names.count(n) > 1 and n})
    if doubled:
        problems.append(f"tool names {doubled} appear more than once")
    seen = f"{len(p.schemas)} tools: {', '.join(str(n) for n in names)}"
    if not p.schemas:
        return Check("tool schemas", "fail", "no tools", "the environment offers no tool: look at environment."
                                                         "action_space and the environment's tools")
    if problems:
        return Check("tool schemas", "fail", seen, f"{problems[0]}; look at the environment's tool definitions "
                                                   "(a ToolEnvironment's functions: type hints and docstrings) and "
                                                   "environment.action_space")
    return Check("tool schemas", "pass", seen + ", all well-formed")


def _tokenizer(p: Probes) -> tuple[Any, str]:
    """The configured model's tokenizer without building a model (None and why not, otherwise)."""
    model = p.cfg.model
    if model.path:
        path = model.path
    elif model.preset == "tiny":
        path = model_path(p.cfg)  # built once (seconds) and cached, as tether train would
    else:
        path = str(cache_dir() / f"tiny-sft-{cache_key(p.cfg)}")
        if not Path(path, "config.json").is_file():
            return None, (f"the {model.preset} preset is not built yet (tether train or tether sft builds it, "
                          "minutes): no chat template to render with")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True), str(path)
    except (OSError, ValueError) as e:
        return None, f"no tokenizer at model {path!r} ({type(e).__name__}: {str(e)[:120]})"


def check_rendered(p: Probes) -> Check:
    name = "tool schemas/rendered"
    tokenizer, where = _tokenizer(p)
    if tokenizer is None:
        return Check(name, "skip", where)
    messages = [{"role": "system", "content": p.system_prompt}, {"role": "user", "content": "Hello."}]
    try:
        text = tokenizer.decode(render_ids(tokenizer, messages, p.schemas, add_generation_prompt=True))
    except Exception as e:  # noqa: BLE001 — a template that cannot take these tools: the finding itself
        return Check(name, "fail", f"the chat template of {where} raised {type(e).__name__}",
                     f"rendering the tools failed ({e}); look at model.path / model.preset (its chat template) "
                     "and the tool schemas")
    hidden = [s["function"]["name"] for s in p.schemas if s["function"]["name"] not in text]
    hidden += [f"{s['function']['name']}.{k}" for s in p.schemas
               for k in s["function"].get("parameters", {}).get("properties", {}) if k not in text]
    seen = f"{len(p.schemas)} tools rendered by the chat template of {where}: {len(tokenizer.encode(text))} tokens"
    if hidden:
        return Check(name, "fail", seen, f"the prompt does not show {hidden[:5]}: the model's chat template ignores "
                                         "(some of) the tools; look at model.path / model.preset (a template "
                                         "with tool support)")
    return Check(name, "pass", seen + ", every tool and parameter name shown")


def write_call(parser: str, name: str, arguments: Mapping[str, Any]) -> str | None:
    """A tool call as the ``parser`` reads it from the model's text (None: no writer for that parser)."""
    if parser in ("hermes", "function_call_parser"):
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False) + \
            "\n</tool_call>"
    if parser == "pythonic":
        return f"[{name}(" + ", ".join(f"{k}={v!r}" for k, v in arguments.items()) + ")]"
    return None


def check_parser(p: Probes) -> Check:
    parser = p.cfg.tool_parser.name
    first: dict[str, Any] = {}  # each tool's first probe: its valid (or well-typed) call
    for _, ep, _ in p.tools:
        action = ep.actions[0] if ep.actions else None
        if isinstance(action, Mapping) and isinstance(action.get("params"), Mapping):
            first.setdefault(str(action.get("name")), action["params"])
    names = {s["function"]["name"] for s in p.schemas}
    calls = [(name, args) for name, args in first.items() if name in names]
    if write_call(parser, "x", {}) is None:
        return Check("parser round-trip", "skip", f"tool_parser.name = {parser}: no writer for its format here, "
                                                  "so its round trip is not checked")
    bad = []
    for name, args in calls:
        text = write_call(parser, name, args)
        assert text is not None
        turn = get_parser(parser)(text)
        got = [(c.name, c.arguments) for c in turn.calls]
        if got != [(name, dict(args))] or turn.errors:
            bad.append(f"{text[:100]!r} parsed as {got} {[e.reason for e in turn.errors]}")
    seen = f"{len(calls)} calls (one per tool) written as {parser} reads them"
    if bad:
        return Check("parser round-trip", "fail", seen + f", {len(bad)} not read back",
                     f"{bad[0]}; look at tool_parser.name = {parser} (tether/agent/parsers.py)")
    return Check("parser round-trip", "pass", seen + ", each parsed back to the same name and arguments")


def check_timeouts(p: Probes) -> Check:
    limits = {a.name: a.timeout_ms for a in p.cfg.environment.action_space}
    tools = {s["function"]["name"] for s in p.schemas}
    slowest: dict[str, float] = {}
    timed_out = []
    judged = [(ep, True) for ep in p.expert] + [(ep, v) for _, ep, v in p.tools]
    for ep, valid in judged:
        for action, obs, ms in zip(ep.actions, ep.observations[1:], ep.elapsed_ms):
            name = action.get("name") if isinstance(action, Mapping) else None
            if not isinstance(name, str) or name not in tools:
                continue
            slowest[name] = max(slowest.get(name, 0.0), ms)
            text = str(obs.get("last_tool_result")) if isinstance(obs, Mapping) else ""
            if valid and "timed out" in text:
                timed_out.append(f"{name} ({ep.probe} on {ep.task.id}): {text[:100]}")
    shown = ", ".join(f"{n} {ms:.0f}" + (f"/{limits[n]:g}" if n in limits else "") + " ms"
                      for n, ms in sorted(slowest.items()))
    seen = f"slowest call per tool (of its timeout_ms): {shown or 'no calls'}"
    if timed_out:
        name = timed_out[0].split(" ", 1)[0]
        index = next((i for i, a in enumerate(p.cfg.environment.action_space) if a.name == name), None)
        key = f"environment.action_space[{index}].timeout_ms" if index is not None else "environment.action_space"
        return Check("timeouts", "fail", seen, f"a call with valid arguments timed out: {timed_out[0]}; look at "
                                               f"{key} against its latency_ms and the tool's own run time")
    if not any(n in limits for n in slowest):
        return Check("timeouts", "pass", seen + f"; {p.env_kind}'s tools run without tether's timeout_ms")
    return Check("timeouts", "pass", seen)


def check_do_nothing(p: Probes) -> Check:
    lo, hi = reward_range(p.cfg.environment)
    eps = p.nothing
    bad = []
    for ep in eps:
        r = ep.reward
        if not (ep.done and math.isfinite(r) and lo - EPS <= r <= hi + EPS):
            bad.append(f"{ep.task.id}: done={ep.done}, reward {r}")
        elif "reward_components" not in ep.info:
            bad.append(f"{ep.task.id}: ended without a reward breakdown (info has no reward_components)")
    endings = sorted({str(ep.info.get("termination")) for ep in eps})
    rewards = [ep.reward for ep in eps]
    seen = (f"{len(eps)} episodes that do nothing and stop ({', '.join(endings)}): rewards in "
            f"[{min(rewards, default=0):.3g}, {max(rewards, default=0):.3g}]")
    if bad:
        return Check("do nothing", "fail", seen, f"{bad[0]}; an episode that does nothing must still be scored, in "
                                                 f"[{lo:.3g}, {hi:.3g}]: look at the environment's finalize and "
                                                 "environment.verifier")
    return Check("do nothing", "pass", seen + ", each scored")


def check_no_op_pass(p: Probes) -> Check:
    ah = p.cfg.environment.verifier.anti_hacking
    passed = [ep for ep in p.nothing if ep.info.get("success")]
    flagged = [ep for ep in passed if (ep.info.get("hacking_flags") or {}).get("no_op_pass")]
    n = len(p.nothing)
    if not passed:
        return Check("no-op pass", "pass", f"none of {n} do-nothing episodes passed")
    seen = (f"{len(passed)}/{n} do-nothing episodes passed ({', '.join(ep.task.id for ep in passed[:5])}), "
            f"{len(flagged)} flagged no_op_pass")
    if len(flagged) < len(passed):
        ep = next(e for e in passed if e not in flagged)
        return Check("no-op pass", "fail", seen,
                     f"doing nothing passes task {ep.task.id} unflagged: the verifier rewards an empty episode; make "
                     "its success need the work done (environment.verifier, termination.success_criteria), or list "
                     "no_op_pass in environment.verifier.anti_hacking.detect_patterns (enabled: true)")
    penalty = ah.penalty.get("no_op_pass", 0.0) if ah.enabled else 0.0
    costly = [ep for ep in flagged if (ep.info.get("hacking_penalty") or 0) > 0]
    if penalty <= 0 or not costly:
        return Check("no-op pass", "warn", seen + ", penalty 0",
                     "flagged and counted, but free: a task whose right answer writes nothing (a correct refusal) "
                     "also passes this way; set environment.verifier.anti_hacking.penalty.no_op_pass to make it cost")
    return Check("no-op pass", "pass", seen + f", each costs {penalty:g}")
