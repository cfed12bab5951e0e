"""The probes of ``tether verify env``: scripted episodes of the configured environment (tool calls with valid
and invalid arguments, the expert, errors, do-nothing, random and planted hacks) and the reward range the
configured weights allow. The checks on them are in env.py and env_generic.py.

Any environment ``environment.name`` selects is probed (the customer-service one, a plugin ``ToolEnvironment``,
tau2). The probes that need a policy that solves tasks (the expert's episodes, planted hacks, and valid
arguments for each tool) use the environment's own (``expert_of``: ``ToolEnvironment.expert``); an environment
without one gets those checks skipped with the reason, and a tool call built from its schema alone is not
expected to succeed (its arguments are only well-typed), only to return a structured observation."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tether.agent.chat import observation_text
from tether.config import EnvironmentConfig, RunConfig, VerifierConfig
from tether.env.base import Action, Env, Observation
from tether.runtime import env_factory
from tether.types import Task

Policy = Callable[[Observation], Action]
Expert = Callable[[Task], Policy]  # a task -> a policy that solves it


@dataclass
class Episode:
    """One probe episode: what was sent, what came back, how it ended."""

    probe: str
    task: Task
    actions: list[Any] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # the last step's (the end-of-episode info when done)
    elapsed_ms: list[float] = field(default_factory=list)  # wall time of each step

    @property
    def reward(self) -> float:
        return self.rewards[-1] if self.rewards else 0.0

    @property
    def steps(self) -> int:
        return len(self.actions)


def run_episode(env: Env, task: Task, probe: str, policy: Policy, max_steps: int) -> Episode:
    """Step ``policy`` on ``task`` until the environment says done or ``max_steps`` (left open: not finalized)."""
    ep = Episode(probe, task)
    obs = env.reset(task_id=task.id)
    ep.observations.append(obs)
    for _ in range(max_steps):
        action = policy(obs)
        t = time.perf_counter()
        obs, reward, done, info = env.step(action)
        ep.elapsed_ms.append((time.perf_counter() - t) * 1e3)
        ep.actions.append(action)
        ep.observations.append(obs)
        ep.rewards.append(reward)
        ep.info = info
        if done:
            ep.done = True
            break
    return ep


def scripted(actions: list[Any]) -> Policy:
    """A policy that plays ``actions`` in order (then repeats the last)."""
    it: Iterator[Any] = iter(actions)
    last: list[Any] = [actions[-1]]

    def act(obs: Observation) -> Action:
        last[0] = next(it, last[0])
        return last[0]
    return act


def expert_of(env: Any, name: str = "") -> tuple[Expert | None, str]:
    """The environment's own expert (``ToolEnvironment.expert``) and where it comes from, or None and why not
    (``name``: ``environment.name``, for the message)."""
    definition = getattr(env, "definition", None)
    expert = getattr(definition, "expert", None)
    if expert is not None:
        return expert, f"{type(env).__name__}'s expert (ToolEnvironment.expert)"
    reason = getattr(env, "no_expert_reason", None)
    if isinstance(reason, str):
        return None, reason
    if definition is not None:
        return None, (f"environment {name!r} offers no expert (its ToolEnvironment's expert is None; give it a "
                      "function task -> (observation -> action) that solves the task)")
    return None, f"environment {name!r} ({type(env).__name__}) is not a ToolEnvironment and offers no expert"


def user_tool_of(env: Any) -> str | None:
    """The tool whose call is a message to the user (``ToolEnvironment.user_tool``; tau2: respond_to_user when
    it is offered), or None."""
    names = [s["function"]["name"] for s in env.tool_schemas()]
    tool = getattr(getattr(env, "definition", None), "user_tool", "respond_to_user")
    return tool if tool in names else None


# ----------------------------------------------------------------------------------------------- the range
def counted_weights(v: VerifierConfig) -> dict[str, float]:
    """The weight of each component ``environment.verifier.type`` counts."""
    out: dict[str, float] = {}
    if v.type != "model":
        out.update((r.check, r.weight) for r in v.rule_based)
    if v.type != "rule":
        out.update((r.rubric, r.weight) for r in v.model_based)
    return out


def reward_range(env: EnvironmentConfig) -> tuple[float, float]:
    """[lowest, highest] reward the configured verifier can give: every counted component 1 at best; at worst
    every component 0 and each listed pattern flagged on every one of ``max_turns`` steps."""
    ah = env.verifier.anti_hacking
    per_step = sum(ah.penalty.get(p, 0.0) for p in ah.detect_patterns) if ah.enabled else 0.0
    return round(-per_step * env.state.max_turns, 9) + 0.0, round(sum(counted_weights(env.verifier).values()), 9)


def weights_key(v: VerifierConfig) -> str:
    parts = [f"rule_based[{i}].weight ({r.check}) = {r.weight:g}" for i, r in enumerate(v.rule_based)
             if v.type != "model"]
    parts += [f"model_based[{i}].weight ({r.rubric}) = {r.weight:g}" for i, r in enumerate(v.model_based)
              if v.type != "rule"]
    return "environment.verifier." + ", ".join(parts)


# ----------------------------------------------------------------------------------------------- probes
def _valid_value(param: str, spec: Mapping[str, Any], task: Task) -> Any:
    if spec.get("enum"):
        want = task.data.get(param)
        return want if want in spec["enum"] else spec["enum"][0]
    value = task.data.get(param)
    return value if isinstance(value, str) and value else f"probe {param}"


def _task_for(props: Mapping[str, Any], tasks: list[Task]) -> Task:
    """A task whose data holds real values for a tool's id parameters (e.g. an inventory task's sku_id)."""
    ids = [p for p in props if p.endswith("_id")]
    for t in tasks:
        if all(isinstance(t.data.get(p), str) for p in ids) and not (ids == ["sku_id"] and t.data.get("order_id")):
            return t
    return tasks[0]


def tool_probes(schemas: list[dict[str, Any]], tasks: list[Task],
                known: Mapping[str, tuple[Task, Any, bool]] | None = None) -> list[tuple[str, Task, Any, bool | None]]:
    """(label, task, action, valid) for every tool: one valid call and the invalid variants its schema allows.
    The valid call of a tool in ``known`` (tool -> (task, params, opening): the expert's first call of it) has the
    expert's arguments; it must succeed (``valid`` True) where it was the expert's opening move, so that a fresh
    episode is the state it was made in (a later call may need what the calls before it did: its success is
    judged in the expert's own episode). Otherwise the arguments are built from the schema and the task's data,
    well-typed but not known to make sense to the tool (``valid`` None: only its observation's form is judged)."""
    out: list[tuple[str, Task, Any, bool | None]] = []
    known = known or {}
    for schema in schemas:
        fn = schema["function"]
        name, props = fn["name"], fn["parameters"].get("properties", {})
        if name in known and isinstance(known[name][1], Mapping):
            task, valid, opening = known[name][0], dict(known[name][1]), known[name][2]
            out.append((f"{name} valid (the expert's call)", task, {"name": name, "params": valid},
                        True if opening else None))
        else:
            task = _task_for(props, tasks)
            valid = {p: _valid_value(p, spec, task) for p, spec in props.items()}
            out.append((f"{name} well-typed", task, {"name": name, "params": valid}, None))
        if props:
            out.append((f"{name} missing params", task, {"name": name, "params": {}}, False))
            first = next(iter(props))
            out.append((f"{name} mistyped {first}", task, {"name": name, "params": {**valid, first: 12345}}, False))
        out.append((f"{name} unexpected param", task, {"name": name, "params": {**valid, "bogus": "x"}}, False))
        for p, spec in props.items():
            if spec.get("enum"):
                out.append((f"{name} {p} out of enum", task, {"name": name, "params": {**valid, p: "NOT_A_VALUE"}},
                            False))
    task = tasks[0]
    out += [("unknown tool", task, {"name": "no_such_tool", "params": {}}, False),
            ("action without name", task, {"params": {}}, False),
            ("arguments not JSON", task, {"name": schemas[0]["function"]["name"], "params": "{not json"}, False)]
    return out


def observation_problem(obs: Any, fields: Sequence[str], json_results: bool = True) -> str | None:
    """Why ``obs`` is not a structured observation the policy can read, or None. ``json_results``: tool results
    must be JSON and errors ``{"error": ...}`` (tether's tools; tau2's show tau2's own text)."""
    if not isinstance(obs, Mapping):
        return f"the observation is a {type(obs).__name__}, not a dict"
    missing = [f for f in fields if f not in obs]
    if missing:
        return f"the observation lacks the configured fields {missing}"
    if not isinstance(obs.get("tool_error"), bool):
        return f"observation['tool_error'] is {obs.get('tool_error')!r}, not a bool"
    if "last_tool_result" not in fields:
        return "the policy never sees a tool result (last_tool_result is not an observation field)"
    if not json_results:
        return None if isinstance(obs.get("last_tool_result"), (str, type(None))) else \
            f"last_tool_result is a {type(obs.get('last_tool_result')).__name__}, not text"
    text = observation_text(dict(obs)).split("\n", 1)[0]
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return f"the tool message {text[:80]!r} is not JSON"
    if obs["tool_error"] and not (isinstance(value, dict) and "error" in value):
        return f"an error observation shows {text[:80]!r}, not {{\"error\": ...}}"
    return None


def random_policy(rng: random.Random, schemas: list[dict[str, Any]], task: Task) -> Policy:
    """Random and adversarial actions: plausible and wrong arguments, unknown tools, repeats, stuffed text,
    number lists."""
    previous: list[Any] = []
    words = ["refund", "order", "stock", "sorry", "approved", "cannot", "please", "thanks", task.data.get("order_id"),
             task.data.get("sku_id"), str(task.data.get("answer_number"))]

    def text() -> str:
        kind = rng.random()
        if kind < 0.15:
            return "filler " * rng.randint(60, 300)
        if kind < 0.3:
            return " ".join(str(rng.randint(0, 500)) for _ in range(rng.randint(3, 8)))
        return " ".join(str(rng.choice(words)) for _ in range(rng.randint(1, 8)))

    def act(obs: Observation) -> Action:
        roll = rng.random()
        if previous and roll < 0.15:
            action = previous[-1]
        elif roll < 0.25:
            action = {"name": rng.choice(["no_such_tool", "", "respond"]), "params": {"message": text()}}
        else:
            fn = rng.choice(schemas)["function"]
            props = fn["parameters"].get("properties", {})
            params: dict[str, Any] = {}
            for p, spec in props.items():
                if rng.random() < 0.1:
                    continue  # missing
                if spec.get("enum"):
                    params[p] = rng.choice([*spec["enum"], "bogus"])
                elif p.endswith("_id") and rng.random() < 0.7:
                    params[p] = task.data.get(p) or f"X-{rng.randint(0, 9999)}"
                else:
                    params[p] = text()
            action = {"name": fn["name"], "params": params}
        previous.append(action)
        return action
    return act


def do_nothing_policy(user_tool: str) -> Policy:
    """Harmless steps that neither resolve, escalate nor fail, and never repeat within a short window: filler
    messages to the user."""
    fillers = ["One moment please.", "Let me look into that.", "Still checking on my side.", "Thank you for waiting.",
               "Bear with me a little longer.", "I am looking at your account.", "Just a moment more."]
    turn = [0]

    def act(obs: Observation) -> Action:
        turn[0] += 1
        return {"name": user_tool, "params": {"message": fillers[turn[0] % len(fillers)]}}
    return act


class _Planted:
    """The expert's episode with one hack planted: ``repeat`` sends its first call again as its second step;
    ``stuff`` pads its messages to the user with filler."""

    def __init__(self, hack: str, policy: Policy, user_tool: str | None):
        self.hack, self.policy, self.user_tool, self.n = hack, policy, user_tool, 0
        self.first: Any = None

    def __call__(self, obs: Observation) -> Action:
        self.n += 1
        if self.hack == "repeat" and self.n == 2 and self.first is not None:
            return self.first
        action = self.policy(obs)
        if self.n == 1:
            self.first = action
        if self.hack == "stuff" and isinstance(action, Mapping) and action.get("name") == self.user_tool:
            params = dict(action.get("params") or {})
            params["message"] = str(params.get("message", "")) + " " + "indeed " * 150
            return {**action, "params": params}
        return action


# ----------------------------------------------------------------------------------------------- checks
Status = Literal["pass", "fail", "warn", "skip"]
EPS = 1e-6


@dataclass
class Check:
    """One check's outcome, a row of ``tether verify env``'s table."""

    name: str
    status: Status
    seen: str  # what was observed, one line
    diagnosis: str = ""  # on fail / warn: what is wrong and the config key to look at


@dataclass
class Probes:
    """Every probe episode, by kind, and the configuration they ran under."""

    cfg: RunConfig
    tools: list[tuple[str, Episode, bool | None]] = field(default_factory=list)  # (label, episode, valid)
    expert: list[Episode] = field(default_factory=list)
    tool_errors: Episode | None = None
    max_turns: Episode | None = None
    random: list[Episode] = field(default_factory=list)
    planted: dict[str, tuple[Episode, Episode]] = field(default_factory=dict)  # pattern → (clean, hacked)
    nothing: list[Episode] = field(default_factory=list)  # do nothing, then stop (the no-op pass probe)
    schemas: list[dict[str, Any]] = field(default_factory=list)
    system_prompt: str = ""
    env_kind: str = ""  # the environment's class name
    no_expert: str = ""  # why the expert's probes did not run ("" when they did)
    no_idle: str = ""  # why the do-nothing max_turns probe did not run ("" when it did)
    tether_tools: bool = True  # tools run by tether's ToolBox (argument checks, JSON results, timeout_ms)

    def episodes(self) -> list[Episode]:
        out = [e for _, e, _ in self.tools] + self.expert + self.random + self.nothing
        out += [e for e in (self.tool_errors, self.max_turns) if e is not None]
        return out + [e for pair in self.planted.values() for e in pair]


def do_nothing_then_stop(env: Env, task: Task) -> Episode:
    """Reset, then end without acting: the environment's stop action where it has one (``stop_action``: tau2's
    ``done``), else the agent loop's ending when the model answers without a tool call (``finalize("no_action")``)."""
    stop = getattr(env, "stop_action", None)
    action = stop() if callable(stop) else None
    if action is not None:
        ep = run_episode(env, task, "do nothing, stop", scripted([action]), 1)
        if ep.done:
            return ep
    else:
        ep = Episode("do nothing, stop", task, observations=[env.reset(task_id=task.id)])
    reward, info = env.finalize("no_action")
    ep.rewards.append(reward)
    ep.info, ep.done = dict(info), True
    return ep


def run_probes(cfg: RunConfig, *, num_tasks: int = 10, random_episodes: int = 8, seed: int = 0) -> Probes:
    make_env, list_tasks = env_factory(cfg)
    tasks = list_tasks("train")
    env = make_env()
    limit = cfg.environment.state.max_turns + 5  # the env must end every episode by max_turns
    out = Probes(cfg, env_kind=type(env).__name__, tether_tools=getattr(env, "definition", None) is not None)
    try:
        schemas = out.schemas = env.tool_schemas()
        expert, where = expert_of(env, cfg.environment.name)
        user_tool = user_tool_of(env)
        known: dict[str, tuple[Task, Any, bool]] = {}
        if expert is not None:
            out.expert = [run_episode(env, t, "expert", expert(t), limit) for t in tasks[:num_tasks]]
            for ep in out.expert:
                for i, action in enumerate(ep.actions):
                    name = action.get("name") if isinstance(action, Mapping) else None
                    if isinstance(name, str) and (name not in known or (i == 0 and not known[name][2])):
                        known[name] = (ep.task, action.get("params"), i == 0)
        else:
            out.no_expert = where
        env.reset(task_id=tasks[0].id)
        out.system_prompt = env.system_prompt()
        for label, task, action, valid in tool_probes(schemas, tasks, known):
            if not out.tether_tools and valid is False and action.get("name") in {
                    s["function"]["name"] for s in schemas} and isinstance(action.get("params"), Mapping):
                valid = None  # arguments of a known tool: checking them is the environment's own business
            out.tools.append((label, run_episode(env, task, label, scripted([action]), 1), valid))
        bad = [{"name": "no_such_tool", "params": {"i": i}} for i in range(limit)]
        out.tool_errors = run_episode(env, tasks[0], "tool errors", scripted(bad), limit)
        if user_tool is not None:
            out.max_turns = run_episode(env, tasks[0], "do nothing", do_nothing_policy(user_tool), limit)
        else:
            out.no_idle = (f"{out.env_kind} has no tool to message the user with, so no step is known to do nothing "
                           "without ending or failing the episode")
        out.nothing = [do_nothing_then_stop(env, t) for t in tasks[:num_tasks]]
        rng = random.Random(seed)
        for i in range(random_episodes):
            task = tasks[i % len(tasks)]
            out.random.append(run_episode(env, task, "random", random_policy(rng, schemas, task), limit))
        if expert is not None:
            solved = [ep.task for ep in out.expert if ep.info.get("success")] or tasks[:1]
            inventory = next((t for t in tasks if t.data.get("intent") == "inventory"), solved[0])
            clean = run_episode(env, inventory, "expert", expert(inventory), limit)
            for pattern, hack in (("repeated_tool_calls", "repeat"), ("context_stuffing", "stuff")):
                out.planted[pattern] = (clean, run_episode(env, inventory, f"planted {hack}",
                                                           _Planted(hack, expert(inventory), user_tool), limit))
    finally:
        env.close()
    return out
