"""``backend``, ``ray`` and ``resource_pool``: where the components run (``tether.distributed``).

``backend: local`` (the default) runs everything in one process. ``backend: ray`` runs the rollouter (with its
engine), the MessageQueue and the trainer as Ray actors, placed in the ``resource_pool`` pools through Ray
placement groups; the same config trains with either.
"""

from __future__ import annotations

from typing import Any, Literal

from tether.config.base import NonNegInt, PosFloat, PosInt, Section

__all__ = ["PoolConfig", "RayConfig", "ResourcePoolConfig", "TrainerPoolConfig", "trainer_ranks"]


class PoolConfig(Section):
    """One Ray resource pool: a placement group of one bundle on one node (``backend: ray``)."""

    num_gpus: NonNegInt = 0
    """GPUs in the pool, in devices (0 = CPUs only). The seeds' separation_config.yaml gives 8 per pool; a pool
    larger than the cluster fails at start, naming this key and what the cluster has."""
    num_cpus: PosInt = 1
    """CPUs in the pool (the actor's CPU share; with GPUs, the CPUs that go with them)."""


class TrainerPoolConfig(PoolConfig):
    """The trainer's pool: its resources (``backend: ray``) and how many trainer ranks train (any backend)."""

    num_ranks: PosInt | None = None
    """Trainer ranks: processes that train one model together, its parameters, gradients and optimizer state
    sharded by FSDP2 (``actor_worker.strategy: fsdp2``; gloo on CPUs, NCCL on GPUs, rank r on GPU r). Rank 0 is the
    trainer's own process (the pipeline's); ``tether train`` starts ranks 1..N-1 itself (``tether.learner.pool``),
    under either backend (under ``backend: ray``: inside the trainer actor, on its node and GPUs). Every step's
    trajectories are shared out among them by tokens, and N ranks train what one trains. None = ``num_gpus`` with
    ``backend: ray`` and a sharding strategy, else 1. May change on ``--resume`` (checkpoints hold whole weights)."""


class ResourcePoolConfig(Section):
    """Separate resource pools for training and rollout (``backend: ray``; separation_config.yaml). The trainer
    actor is placed in ``trainer_pool``, the rollouter actor (and its engine) in ``rollout_pool``; the
    MessageQueue actor needs no reserved resources."""

    trainer_pool: TrainerPoolConfig = TrainerPoolConfig()
    """Trainer resources, and the trainer's ranks."""
    rollout_pool: PoolConfig = PoolConfig()
    """Rollout resources."""


class RayConfig(Section):
    """How ``backend: ray`` reaches its cluster and moves weights (read only with ``backend: ray``)."""

    address: str | None = None
    """The Ray cluster to connect to (``auto``, ``HOST:PORT`` of the head's GCS, or ``ray://HOST:10001``).
    None = start a local cluster in this process (``ray.num_cpus`` CPUs), shut down at the end."""
    num_cpus: PosInt | None = None
    """CPUs of the local cluster started when ``ray.address`` is None (None = all the machine's); ignored when
    connecting to an existing cluster."""
    env_vars: list[str] = []
    """Names of further environment variables to pass to every actor (their values are read from this process at
    start and never written to logs or the run's config). Always passed: the variables the config's secrets
    reference (``llm_client.api_key: ${VAR}``), every ``TETHER_*`` variable and the thread-count variables — an
    actor on an existing cluster does not inherit this process's environment (the source document's 401 case)."""
    weight_transfer: Literal["object_store", "nccl"] = "object_store"
    """How the trainer's weights reach the rollout engine, in buckets of ``ray.weight_bucket_mb``: object_store (CPU
    tensors through the Ray object store) or nccl (a torch.distributed broadcast from the trainer to the rollouter
    actor in a process group of their own: NCCL when both hold GPUs, gloo on CPUs, through the same code; a
    restarted rollouter catches up through the object store). ``perf/weight_sync_mb`` and ``perf/weight_sync_s``
    measure either; ``ray/weight_group_joins`` counts the broadcast groups made."""
    weight_bucket_mb: PosFloat = 256.0
    """Size of one weight bucket, in MiB: at each sync the trainer gathers its weights a bucket of at most this many
    bytes at a time (one tensor larger than a bucket is a bucket of its own) and puts or broadcasts each before it
    gathers the next; ``perf/weight_sync_buckets`` counts them."""
    max_actor_restarts: NonNegInt = 3
    """How often a dead rollouter actor is restarted (its in-flight groups re-queued, the latest weights sent
    again) before the run fails. 0 = a rollouter failure ends the run."""


def trainer_ranks(cfg: Any) -> int:
    """The run's trainer ranks (``resource_pool.trainer_pool.num_ranks``, its None resolved)."""
    pool = cfg.resource_pool.trainer_pool
    if pool.num_ranks is not None:
        return int(pool.num_ranks)
    sharded = cfg.actor_worker.strategy in ("fsdp", "fsdp2")
    return pool.num_gpus if cfg.backend == "ray" and sharded and pool.num_gpus else 1


def cluster_inert(cfg: Any) -> list[str]:
    """``RunConfig.warnings``'s sentence for the keys of this file set while ``backend`` is local."""
    if cfg.backend == "ray":
        return []
    keys = [f"resource_pool.{pool}.{key}" for pool in ("trainer_pool", "rollout_pool")
            for key in sorted(getattr(cfg.resource_pool, pool).model_fields_set - {"num_ranks"})
            if pool in cfg.resource_pool.model_fields_set]  # num_ranks acts under either backend
    keys += [f"ray.{key}" for key in sorted(cfg.ray.model_fields_set)]
    if not keys:
        return []
    return [f"{', '.join(keys)} act with backend: ray only: backend is local (one process, nothing is placed or "
            "transferred); set backend: ray to use them"]
