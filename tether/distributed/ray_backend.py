"""``backend: ray``: the driver. Connects to (or starts) a cluster, reserves the resource pools, starts the actors,
runs the trainer actor to the end and stops everything it started.

    driver ─ ray.init(ray.address) ─ placement groups (resource_pool.*)
      ├─ RolloutWorker  in rollout_pool  (engine + environments; restarted up to ray.max_actor_restarts times)
      └─ TrainerWorker  in trainer_pool  (tether.pipeline.trainer.train with the remote parts)
            └─ QueueWorker (async modes: the MessageQueue, started by the trainer, no reserved resources)

Every actor is given the variables of ``envvars.actor_env_vars`` (the values as constructor arguments, never in
a Ray runtime environment, whose values Ray logs), and the driver checks that each actor sees every one of them
before the run starts (the source document's 401 case). A trainer actor
that dies stops the run: ``TrainerActorFailed`` names the last complete checkpoint (checkpoints are written to a
temporary folder and renamed, so a kill never leaves a torn one) and ``--resume`` continues from it, exactly once
(``pipeline/ledger.py``). The run directory must be visible to the trainer actor: on a multi-node cluster, a
shared filesystem.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tether.config import RunConfig
from tether.config.cluster import RayConfig
from tether.config.plan import Plan
from tether.distributed.actors import RolloutWorker, TrainerWorker
from tether.distributed.envvars import actor_env_vars, runtime_env
from tether.distributed.placement import Pools, reserve_pools
from tether.learner.checkpoint import latest_checkpoint
from tether.runtime import model_path

log = logging.getLogger(__name__)


class TrainerActorFailed(RuntimeError):
    """The trainer actor died; the message names the last complete checkpoint."""


def init_kwargs(ray_cfg: RayConfig) -> dict[str, Any]:
    """``ray.init`` arguments: connect to ``ray.address``, or start a local cluster of ``ray.num_cpus`` CPUs."""
    if ray_cfg.address:
        return {"address": ray_cfg.address}
    return {"num_cpus": ray_cfg.num_cpus, "include_dashboard": False}


def connect(ray_cfg: RayConfig) -> bool:
    """Connect this process to its cluster (a connection already made is used as it is); returns whether this
    call made the connection, and so must end it."""
    import ray  # noqa: PLC0415 — the optional extra ``ray``

    if ray.is_initialized():
        return False
    ray.init(**init_kwargs(ray_cfg), log_to_driver=True)
    return True


def _options(pool: Any, pools: Pools, name: str, env: dict[str, str], **extra: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": pool.num_cpus, "scheduling_strategy": pools.strategy(name),
                            "runtime_env": runtime_env(env), **extra}
    if pool.num_gpus:
        opts["num_gpus"] = pool.num_gpus
    return opts


def start_rollout_worker(cfg: RunConfig, model_dir: str, pools: Pools, env: dict[str, str]) -> Any:
    """The RolloutWorker actor in the rollout pool (Ray restarts it up to ``ray.max_actor_restarts`` times)."""
    import ray  # noqa: PLC0415 — the optional extra ``ray``

    return ray.remote(RolloutWorker).options(
        **_options(cfg.resource_pool.rollout_pool, pools, "rollout", env, max_restarts=cfg.ray.max_actor_restarts,
                   max_task_retries=0, max_concurrency=1000)).remote(cfg, model_dir, env)


def check_env(actor: Any, env: dict[str, str]) -> None:
    """Raise unless ``actor`` sees every variable of ``env`` (names compared, values never leave the actor)."""
    import ray  # noqa: PLC0415 — the optional extra ``ray``

    seen = ray.get(actor.env_present.remote(sorted(env)))
    missing = [k for k, ok in seen.items() if not ok]
    if missing:  # cannot happen while apply_env works; if it does, say so before a request gets a 401
        raise RuntimeError(f"an actor ({actor}) does not see environment variable(s) {', '.join(missing)} although "
                           "they were handed to it")


def train_on_ray(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, model_dir: str | None = None,
                 show_progress: bool = True, allow_config_change: tuple[str, ...] = (),
                 on_start: Any = None) -> Any:
    """``tether.pipeline.trainer.train`` on Ray; returns its ``RunResult``. ``on_start(actors)`` (tests) is
    called with ``{"rollout": handle, "trainer": handle}`` once both actors are up."""
    import ray  # noqa: PLC0415 — the optional extra ``ray``
    from ray.exceptions import RayActorError, RayTaskError  # noqa: PLC0415 — as above

    started = connect(cfg.ray)
    actors: list[Any] = []
    pools: Pools | None = None
    try:
        path = model_dir or model_path(cfg)  # a preset is built here, once, before the actors load it
        pools = reserve_pools(cfg.resource_pool)
        env = actor_env_vars(Plan.of(cfg).secret_variables, cfg.ray.env_vars)
        log.info("ray backend: actors get environment variables %s", sorted(env))  # names only
        rollout = start_rollout_worker(cfg, path, pools, env)
        actors.append(rollout)
        trainer: Any = ray.remote(TrainerWorker).options(  # both start at once: each loads torch and the model
            **_options(cfg.resource_pool.trainer_pool, pools, "trainer", env, max_restarts=0)
        ).remote(cfg, path, rollout, {"runtime_env": runtime_env(env)}, env)
        actors.append(trainer)
        for actor in actors:
            check_env(actor, env)
        if on_start is not None:
            on_start({"rollout": rollout, "trainer": trainer})
        try:
            return ray.get(trainer.train.remote(str(run_dir), resume, show_progress, tuple(allow_config_change)))
        except RayTaskError as e:  # the run raised in the actor: the caller handles the error itself, by its kind
            if isinstance(e.cause, Exception):  # (a RunDirInUse refusal, a bad config: exit 2 in one line)
                raise e.cause from None
            raise
        except RayActorError as e:
            last = latest_checkpoint(Path(run_dir))
            raise TrainerActorFailed(f"the trainer actor died ({type(e).__name__}); the last complete checkpoint is "
                                     f"{last or 'none (the run starts again from step 0)'}; continue the run with "
                                     f"--resume") from e
    finally:
        for actor in reversed(actors):
            ray.kill(actor, no_restart=True)
        if pools is not None:
            pools.remove()
        if started:
            ray.shutdown()
