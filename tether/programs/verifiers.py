"""verifiers (0.4.0, ``verifiers.v1``) tasksets trained through agent programs, scored by verifiers itself.

    from tether.programs.verifiers import VerifiersTaskset
    bridge = VerifiersTaskset(MyTaskset(vf.TasksetConfig()))   # any v1 Taskset (config in, vf.Task rows out)
    # config: environment.name: my_module:bridge, agent_loop.name: program, agent_loop.program: my_module:agent
    agent = bridge.agent

``bridge`` is a tether environment (``make_env`` / ``list_tasks``): the taskset's rows as tether tasks — train: the
first ``environment.num_train_tasks``, eval: the eval taskset's first ``num_eval_tasks`` when one is given, else
the rows after the train ones (held out) — in episodes with no tools of their own. ``bridge.agent`` is the agent
program: per episode it runs verifiers' own rollout of the row (``vf.Agent.run``: a subprocess runtime, verifiers'
interception server, its trace, its ``@vf.reward`` / ``@vf.metric`` / judge scoring) with the run's model
reached at the episode's endpoint (``ep.base_url``, ``ep.api_key``, ``ep.model``), and returns the trace's reward
(``Trace.reward``: the weighted sum of its rewards). The environment's ``finalize`` gives the same reward, each of
verifiers' rewards as a reward component (``verifiers/<name>``, weighted) and its metrics in the info.

The harness is verifiers' ``null`` harness (a tool-less chat loop) run in this process (``ChatHarness``: one
completion, no tools offered): the bundled one launches its chat program through ``uv``, which fetches the program's
dependencies at run time. As verifiers' harness contract allows, it runs in-process, its model call through the
interception endpoint. A task with tool servers (``Task.toolsets``) is refused by verifiers' own pairing check.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

try:
    import verifiers.v1 as vf
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.harnesses.null.harness import NullHarness, NullHarnessConfig
except ImportError as e:  # the optional extra, in a venv of its own
    raise ImportError(f"tether.programs.verifiers needs verifiers 0.4.0 ({e}): pip install 'tether[verifiers]' in a "
                      "venv of its own (its openai and mcp pins differ from the test and mcp extras')") from e
from openai import APIError, AsyncOpenAI

from tether.env.base import Action, Observation, StepOutput
from tether.programs.episode import Episode
from tether.types import Task


class VerifiersRolloutFailed(RuntimeError):
    """verifiers' rollout did not complete (its trace's errors are the message): the episode's ``program_error``."""


class ChatHarness(NullHarness):
    """verifiers' ``null`` harness run in-process: the conversation (system prompt, the task's prompt) sent once to
    the interception endpoint, the reply the run's answer. No tools are offered, so the bundled chat loop would stop
    there too. Returns a synthetic ``ProgramResult`` (exit 1 with the error when the endpoint refused the call: a
    limit of the episode); the trace is the record."""

    SUPPORTS_MCP = False  # no tool servers: verifiers' pairing check refuses a task that has some
    SUPPORTS_TOOL_INTERCEPTION = False

    async def setup(self, runtime: vf.Runtime) -> None:
        """Nothing to install (the bundled harness prepares its uv script here)."""

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData,
                     tool_interception_url: str | None = None) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
        except APIError as e:
            return vf.ProgramResult(exit_code=1, stdout="", stderr=f"{type(e).__name__}: {e}")
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


def _key_variable(api_key: str) -> str:
    """verifiers reads an endpoint's key from an environment variable: one named after the key's hash, set once."""
    name = "TETHER_VERIFIERS_KEY_" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    os.environ[name] = api_key
    return name


@dataclass
class TraceResult:
    """What verifiers made of one episode: its reward, each reward (weighted) and metric, and its errors."""

    reward: float
    rewards: dict[str, float]
    metrics: dict[str, float]
    ok: bool
    stop_condition: str | None
    errors: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, trace: vf.Trace) -> TraceResult:
        return cls(reward=float(trace.reward),
                   rewards={k: float(r.value) for k, r in trace.rewards.items() if r is not None},
                   metrics={k: float(v) for k, v in trace.metrics.items() if v is not None}, ok=bool(trace.ok),
                   stop_condition=trace.stop_condition,
                   errors=[f"{e.type}: {e.message}" if hasattr(e, "message") else str(e) for e in trace.errors])


class VerifiersEnv:
    """One episode of a verifiers row in tether: the opening prompt, no tools; scored by what ``record`` got."""

    def __init__(self, bridge: VerifiersTaskset):
        self.bridge = bridge
        self.verifier = self  # the Env protocol's verifier: verifiers scores the episode
        self.task: Task | None = None
        self.result: TraceResult | None = None

    def reset(self, task_id: str | None = None) -> Observation:
        if task_id is None:
            raise ValueError("a verifiers episode needs its task id")
        self.task, self.result = self.bridge.task(task_id), None
        return {"user_reply": self.task.data["prompt"], "tool_error": False, "last_tool_result": ""}

    async def astep(self, action: Action) -> StepOutput:
        return ({"tool_error": True, "user_reply": None,
                 "last_tool_result": f"error: tool '{action.get('name')}' is not available"}, 0.0, False, {})

    def step(self, action: Action) -> StepOutput:
        return {"tool_error": True, "user_reply": None,
                "last_tool_result": f"error: tool '{action.get('name')}' is not available"}, 0.0, False, {}

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    def system_prompt(self) -> str:
        return str(self.task.data.get("system_prompt") or "") if self.task is not None else ""

    def record(self, result: TraceResult) -> None:
        """verifiers' verdict on this episode (the agent program calls it before returning)."""
        self.result = result

    def finalize(self, termination: str) -> tuple[float, dict[str, Any]]:
        r = self.result
        if r is None:  # the program failed before verifiers scored anything
            return 0.0, {"termination": termination, "reward_components": {}, "success": False}
        return r.reward, {"termination": termination, "success": r.ok and r.reward >= self.bridge.success_reward,
                          "reward_components": {f"verifiers/{k}": v for k, v in r.rewards.items()},
                          "verifiers_metrics": dict(r.metrics), "verifiers_stop": r.stop_condition}

    def close(self) -> None:
        pass


def _prompt_text(task: vf.Task) -> str:
    return task.data.prompt_text


class VerifiersTaskset:
    """A verifiers ``Taskset`` as a tether environment and its agent program (module docstring).

    eval_taskset: the held-out rows (default: the train taskset's rows after ``environment.num_train_tasks``).
    success_reward: the verifiers reward at or above which an episode counts as a success (tether's
    ``success``). agent_config: fields of ``vf.AgentConfig`` for every rollout (e.g. ``timeout``, ``retries``); the
    model, client, sampling, runtime and harness are the bridge's."""

    def __init__(self, taskset: vf.Taskset, *, eval_taskset: vf.Taskset | None = None, success_reward: float = 1.0,
                 agent_config: dict[str, Any] | None = None):
        self.taskset, self.eval_taskset, self.success_reward = taskset, eval_taskset, success_reward
        self.agent_config = dict(agent_config or {})
        clash = {"model", "client", "runtime", "harness", "sampling"} & set(self.agent_config)
        if clash:
            raise ValueError(f"agent_config sets {sorted(clash)}: the bridge sets those (the episode's endpoint, model "
                             "and sampling, a subprocess runtime, the in-process chat harness)")
        self._rows: dict[str, list[vf.Task]] = {}
        self._tasks: dict[str, Task] = {}

    # -- the environment: make_env(config), list_tasks(split, config) -----------------------------------------
    def make_env(self, config: Any = None) -> VerifiersEnv:
        return VerifiersEnv(self)

    def list_tasks(self, split: str, config: Any = None) -> list[Task]:
        env_cfg = getattr(config, "environment", None)
        n_train = getattr(env_cfg, "num_train_tasks", None)
        n_eval = getattr(env_cfg, "num_eval_tasks", None)
        if split == "train":
            rows = _take(self.taskset, n_train)
        elif split == "eval":
            rows = (_take(self.eval_taskset, n_eval) if self.eval_taskset is not None
                    else _take(self.taskset.skip(n_train or 0), n_eval))
        else:
            raise ValueError(f"split {split!r}: a verifiers taskset has 'train' and 'eval'")
        self._rows[split] = rows
        tasks = [Task(id=f"vf-{split}-{i}", split=split, kind=type(row).__name__,
                      data={"prompt": _prompt_text(row), "system_prompt": row.data.system_prompt, "key": row.key,
                            "idx": row.data.idx})
                 for i, row in enumerate(rows)]
        self._tasks.update({t.id: t for t in tasks})
        return tasks

    def task(self, task_id: str) -> Task:
        if task_id not in self._tasks:
            raise KeyError(f"no verifiers task {task_id!r}: list_tasks makes them")
        return self._tasks[task_id]

    def row(self, task: Task) -> vf.Task:
        """The verifiers task behind a tether task."""
        return self._rows[task.split][int(task.id.rsplit("-", 1)[1])]

    # -- the agent program ---------------------------------------------------------------------------------------
    def agent_for(self, ep: Episode) -> vf.Agent:
        """verifiers' agent for this episode: its endpoint and model, a subprocess runtime, the chat harness."""
        sampling = {k: v for k, v in ep.sampling.items() if v is not None}
        config = vf.AgentConfig(**self.agent_config, model=ep.model, runtime=vf.SubprocessConfig(),
                                harness=NullHarnessConfig(id="null"), sampling=vf.SamplingConfig(**sampling),
                                client=vf.EvalClientConfig(base_url=ep.base_url,
                                                           api_key_var=_key_variable(ep.api_key)))
        agent = vf.Agent(config)
        agent.harness = ChatHarness(agent.harness.config)
        return agent

    async def agent(self, ep: Episode) -> float:
        """One episode: verifiers' rollout of the task's row against the episode's endpoint; its reward."""
        async with self.agent_for(ep) as agent:
            trace = await agent.run(self.row(ep.task))
        result = TraceResult.of(trace)
        ep.env.record(result)  # type: ignore[attr-defined]
        if not result.ok:
            raise VerifiersRolloutFailed("verifiers' rollout failed: " + "; ".join(result.errors or ["no error"]))
        return result.reward


def _take(taskset: vf.Taskset, n: int | None) -> list[vf.Task]:
    view: Iterable[vf.Task] = taskset.take(n) if n is not None else taskset
    if n is None and not taskset.bounded:
        raise ValueError(f"{type(taskset).__name__} is infinite: set environment.num_train_tasks / num_eval_tasks")
    return list(view)


