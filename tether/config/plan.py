"""``Plan``: the values a run's components use, derived once from a ``RunConfig``.

A config says what the user asked for, in the seeds' vocabulary (one number may be spelled by several keys, and
some keys mean different things per ``rollout.mode``). The plan is what the run will do: each effective value
computed here, once, and handed by ``Run.build`` to the component that needs it as an explicit argument. A
component never re-derives one of these from the config, so two places cannot disagree about, say, the staleness
bound of ``one_step_off_policy`` (the monitor once checked the configured 4 while the pipeline held 1).

``Plan.of(cfg)`` is cheap and pure; ``totals()`` is what ``tether train`` and ``tether config`` print at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from tether.secrets import Secret

if TYPE_CHECKING:  # the plan is derived from a RunConfig; run.py's checks use the plan's pieces (max_env_steps)
    from tether.config.run import RunConfig

Mode = Literal["sync", "one_step_off_policy", "fully_async"]


@dataclass(frozen=True)
class Plan:
    mode: Mode
    seed: int
    deterministic: bool
    dtype: str  # model.dtype: the policy's weights (and the KV cache's) in memory
    # -- sizes per trainer step (samples = trajectories)
    group_size: int  # rollouts per task before reallocation (advantage.group_size)
    prompts_per_step: int  # groups per step
    samples_per_step: int  # learner.batch_size
    mini_batch_size: int  # samples per optimizer update
    micro_batch_size: int  # samples per forward/backward
    optimizer_updates_per_step: int
    max_groups_in_flight: int  # groups generated at once (rollout.worker.max_concurrent_tasks / group_size)
    max_response_tokens: int  # the longest response an episode can produce: engine.max_tokens × assistant turns
    max_env_steps: int  # the most environment steps an episode can take under the agent loop's limits
    # -- weights and staleness
    sync_every: int  # trainer steps per weight sync (1 in sync mode: weights move every step)
    max_staleness: int  # versions a trained token may lag the learner: 0 sync, min(1, s) one-step-off, s fully_async
    groups_per_version: int  # groups started per parameter version (admission control): prompts × sync_every
    groups_per_take: int  # groups the async trainer takes from the queue at once (ppo_mini_batch_size / group_size)
    max_policy_lag: int | None  # the stale filter at consumption (None: off)
    queue_size: int  # the MessageQueue's capacity, in groups
    window_size: int | None  # windowed_fifo's window (None: plain fifo)
    max_hold_s: float | None  # windowed_fifo: seconds a finished group waits outside the window (None: no limit)
    # -- evaluation
    eval_tasks: int
    # -- secrets: the environment variables the config's ``Secret`` values read (``${VAR}``), which a process
    # started elsewhere (a Ray actor) must be handed by name; never their values
    secret_variables: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: RunConfig) -> Plan:
        ro, tr, lc = cfg.rollout, cfg.trainer, cfg.learner
        g = cfg.policy_optimization.advantage.group_size
        prompts = lc.batch_size // g
        sync_every = 1 if ro.mode == "sync" else tr.trigger_parameter_sync_step
        staleness = {"sync": 0, "one_step_off_policy": min(1, ro.scheduler.max_staleness),
                     "fully_async": ro.scheduler.max_staleness}[ro.mode]
        stale = cfg.buffer.stale_filter
        return cls(
            mode=ro.mode, seed=tr.seed, deterministic=tr.deterministic, dtype=cfg.model.dtype,
            group_size=g, prompts_per_step=prompts, samples_per_step=lc.batch_size,
            mini_batch_size=lc.mini_batch_size, micro_batch_size=lc.mini_batch_size // lc.gradient_accumulation_steps,
            optimizer_updates_per_step=lc.batch_size // lc.mini_batch_size,
            max_groups_in_flight=max(1, ro.worker.max_concurrent_tasks // g),
            max_response_tokens=cfg.engine.max_tokens * cfg.agent_loop.max_assistant_turns,
            max_env_steps=max_env_steps(cfg.agent_loop.max_assistant_turns, cfg.agent_loop.max_parallel_calls),
            sync_every=sync_every, max_staleness=staleness, groups_per_version=prompts * sync_every,
            groups_per_take=max(1, tr.ppo_mini_batch_size // g),
            max_policy_lag=stale.max_policy_lag if stale.enabled else None,
            queue_size=cfg.message_queue.max_queue_size,
            window_size=ro.scheduler.window_size if ro.scheduler.type == "windowed_fifo" else None,
            max_hold_s=ro.scheduler.max_hold_s if ro.scheduler.type == "windowed_fifo" else None,
            eval_tasks=tr.eval_tasks or cfg.environment.num_eval_tasks,
            secret_variables=tuple(secret_variables(cfg)),
        )

    def totals(self) -> dict[str, int]:
        """The derived totals printed at start (never computed in shell)."""
        return {"samples_per_step": self.samples_per_step, "prompts_per_step": self.prompts_per_step,
                "group_size": self.group_size, "optimizer_updates_per_step": self.optimizer_updates_per_step,
                "micro_batch_size": self.micro_batch_size, "eval_tasks": self.eval_tasks}


def max_env_steps(max_assistant_turns: int, max_parallel_calls: int) -> int:
    """The most environment steps the ``tool_agent`` loop can take in one episode: ``environment.state.max_turns``
    counts environment steps (one per tool call, ``respond_to_user`` included); the loop runs at most
    ``max_parallel_calls`` calls per assistant turn and ends the episode after ``max_assistant_turns`` turns
    (``max_user_turns`` bounds only the ``respond_to_user`` steps)."""
    return max_assistant_turns * max_parallel_calls


def secret_variables(value: Any) -> list[str]:
    """The environment variables referenced by the ``Secret`` values anywhere in ``value`` (a config, a section, a
    list or mapping of them), in field order, each once; a literal secret names none."""
    out: list[str] = []
    if isinstance(value, Secret):
        out += value.variables()
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            out += secret_variables(getattr(value, name))
    elif isinstance(value, list | tuple):
        for item in value:
            out += secret_variables(item)
    elif isinstance(value, dict):
        for item in value.values():
            out += secret_variables(item)
    return list(dict.fromkeys(out))
