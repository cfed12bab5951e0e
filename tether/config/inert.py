"""Values that are valid but cannot act within the run: ``RunConfig.warnings()``.

A config error stops the run; these do not (a short smoke run with the production intervals is legitimate),
but a user who set ``reallocation_interval: 100`` for a 16-step run should be told that adaptive allocation
will never reallocate, rather than read "adaptive" in the dump and believe it did. Each warning names the
key, says why it cannot act and what would make it act. Pure: a function of the resolved config.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel

from tether.config.actor import actor_inert
from tether.config.cluster import cluster_inert
from tether.config.plan import max_env_steps
from tether.config.reward import reward_inert

if TYPE_CHECKING:
    from tether.config.run import RunConfig

KL_MIN_MOVE = 0.10  # below this relative change of β over the whole run, the adaptive controller is inert
KL_MAX_ERROR = 0.2  # the controller's clip of the proportional error (tether.algo.kl_control)


def inert_values(cfg: RunConfig) -> list[str]:
    """One sentence per value that cannot act within ``cfg``'s run, naming the key; [] when all can."""
    tr, po = cfg.trainer, cfg.policy_optimization
    steps = tr.total_steps
    out: list[str] = []

    ra = po.rollout_allocation
    if ra.strategy == "adaptive" and ra.reallocation_interval >= steps:
        out.append(f"policy_optimization.rollout_allocation.reallocation_interval = {ra.reallocation_interval} >= "
                   f"trainer.total_steps = {steps}: adaptive allocation never reallocates in this run (every task "
                   f"gets group_size rollouts, as with strategy: fixed); set it below {steps}")

    kl = po.kl_control
    if kl.type != "none" and kl.adaptive:
        if kl.init_coef == 0:
            out.append("policy_optimization.kl_control.adaptive = true with init_coef = 0: the controller scales β, "
                       "so β stays 0; set init_coef > 0 or adaptive: false")
        else:
            most = max_kl_coef_change(cfg.learner.batch_size, kl.horizon, steps)
            if most < KL_MIN_MOVE:
                out.append(f"policy_optimization.kl_control.adaptive = true with horizon = {kl.horizon} trajectories: "
                           f"β can change by at most {most:.1%} over {steps} steps of {cfg.learner.batch_size} "
                           f"trajectories, so it stays ≈ init_coef; for β to follow target_kl set horizon <= "
                           f"{horizon_for(cfg.learner.batch_size, steps)} (or adaptive: false)")

    if cfg.rollout.mode != "sync" and tr.trigger_parameter_sync_step > steps:
        out.append(f"trainer.trigger_parameter_sync_step = {tr.trigger_parameter_sync_step} > trainer.total_steps = "
                   f"{steps}: the rollouter never receives new weights in this run ({cfg.rollout.mode}); every "
                   f"rollout comes from the initial policy")
    if tr.eval_every > steps:
        out.append(f"trainer.eval_every = {tr.eval_every} > trainer.total_steps = {steps}: held-out evaluation runs "
                   f"only at step 0 and at the end")
    if tr.save_every > steps:
        out.append(f"trainer.save_every = {tr.save_every} > trainer.total_steps = {steps}: the only checkpoint is "
                   f"the one at the end")

    if cfg.rollout.mode == "sync":  # only what a file or --set chose: the defaults are not the user's claim
        set_here = _explicit(cfg)
        for key in ("buffer.type", "buffer.freshness_weight", "buffer.diversity_weight",
                    "rollout.partial_rollout.replay_buffer_size", "buffer.stale_filter.max_policy_lag",
                    "rollout.scheduler.max_staleness", "rollout.scheduler.type", "rollout.scheduler.window_size",
                    "rollout.scheduler.max_hold_s"):
            if key in set_here:
                out.append(f"{key} acts in the async modes only: rollout.mode is sync, where every step trains the "
                           f"groups generated for it with the current weights (nothing waits, nothing is stale)")
        if "trainer.use_trainer_do_validate" in set_here:
            out.append("trainer.use_trainer_do_validate acts in the async modes only: in sync mode the rollout engine "
                       "holds the trainer's weights at every evaluation, so both choices evaluate the same weights")
    if cfg.trainer.deterministic and cfg.rollout.mode != "sync":
        out.append(f"trainer.deterministic = true in {cfg.rollout.mode}: every request is computed on its own (the "
                   "engine's batching cost is paid), but which weights a group is generated with still depends on "
                   "the rollouter's and trainer's timing, so two runs repeat only when that timing does "
                   "(docs/determinism.md)")
    out += _lr_schedule_inert(cfg)
    opc = cfg.learner.off_policy_correction
    if opc.method == "truncated_importance_sampling" and not opc.tis_enabled:
        out.append("learner.off_policy_correction.tis_enabled = false has no effect with method "
                   "truncated_importance_sampling, which truncates the weight at tis_cap by definition")
    if (opc.method == "double_sided_importance_sampling" and opc.tis_enabled and opc.token_level_clipping
            and opc.tis_cap >= 1 + opc.clip_ratio and "learner.off_policy_correction.tis_enabled" in _explicit(cfg)):
        out.append(f"learner.off_policy_correction.tis_cap = {opc.tis_cap} >= 1 + clip_ratio = {1 + opc.clip_ratio}: "
                   "inside the double-sided band no weight reaches the cap, so truncation never acts (the weight is "
                   "the ratio itself, IcePop); tis_enabled: false would train with weight 1 inside the band")

    if cfg.engine.type == "remote":  # the server's engine batches and interrupts: its own config decides
        set_here = _explicit(cfg)
        server_side = ("engine.max_batch_size", "rollout.partial_rollout.enabled",
                       "rollout.partial_rollout.segment_length")
        for key in server_side:
            if key in set_here:
                out.append(f"{key} acts on the in-process engine only: with engine.type remote the server's engine "
                           f"batches and applies weight updates (for tether serve, set it in the config given to "
                           f"`tether serve --config`); llm_client.max_concurrency bounds the requests in flight here")
    elif cfg.engine.weight_sync_dir is not None:
        out.append("engine.weight_sync_dir acts with engine.type remote only: the local engine takes the weights "
                   "in memory")

    out += actor_inert(cfg)
    out += reward_inert(cfg)
    out += cluster_inert(cfg)
    reachable = max_env_steps(cfg.agent_loop.max_assistant_turns, cfg.agent_loop.max_parallel_calls)
    if cfg.environment.state.max_turns > reachable:
        al = cfg.agent_loop
        out.append(f"environment.state.max_turns = {cfg.environment.state.max_turns} is never reached: the agent "
                   f"loop ends an episode after at most agent_loop.max_assistant_turns × max_parallel_calls = "
                   f"{al.max_assistant_turns} × {al.max_parallel_calls} = {reachable} environment steps, so "
                   f"termination.max_turns_exceeded never applies")
    return out


def _lr_schedule_inert(cfg: RunConfig) -> list[str]:
    opt = cfg.policy_optimization.optimizer
    key = "policy_optimization.optimizer"
    if opt.lr_scheduler == "constant":
        return [f"{key}.{k} acts with lr_scheduler cosine or linear only: lr_scheduler is constant"
                for k in ("min_lr_ratio", "decay_steps") if f"{key}.{k}" in _explicit(cfg)]
    if opt.decay_steps is not None and opt.decay_steps <= opt.warmup_steps + 1:
        return [f"{key}.decay_steps = {opt.decay_steps} <= warmup_steps + 1 = {opt.warmup_steps + 1}: the lr falls "
                f"from lr to lr × min_lr_ratio in one update after the warm-up; set decay_steps above it"]
    if opt.min_lr_ratio == 1.0:
        return [f"{key}.min_lr_ratio = 1: the {opt.lr_scheduler} decay ends where it starts (a constant lr)"]
    return []


def max_kl_coef_change(batch_size: int, horizon: int, steps: int) -> float:
    """The largest relative change of β the adaptive controller can make over ``steps`` trainer steps:
    each step multiplies β by at most 1 + 0.2 · batch_size / horizon (``tether.algo.kl_control``)."""
    return (1.0 + KL_MAX_ERROR * batch_size / horizon) ** steps - 1.0


def horizon_for(batch_size: int, steps: int, move: float = KL_MIN_MOVE) -> int:
    """The largest horizon (trajectories) at which β can still change by ``move`` over ``steps`` steps."""
    per_step = (1.0 + move) ** (1.0 / steps) - 1.0
    return max(1, math.floor(KL_MAX_ERROR * batch_size / per_step))


def _explicit(cfg: RunConfig) -> set[str]:
    """Dotted keys set in a file or by --set (pydantic's ``model_fields_set``, walked through the sections)."""
    out: set[str] = set()

    def walk(model: BaseModel, prefix: str) -> None:
        for name in model.model_fields_set:
            value = getattr(model, name)
            key = f"{prefix}{type(model).model_fields[name].alias or name}"
            if isinstance(value, BaseModel):
                walk(value, key + ".")
            else:
                out.add(key)

    walk(cfg, "")
    return out
