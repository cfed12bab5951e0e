"""``resource_pool.trainer_pool`` / ``rollout_pool`` as Ray placement groups.

Each pool is one placement group of one bundle (``{"CPU": num_cpus, "GPU": num_gpus}``, ``STRICT_PACK``: on one
node), reserved before any actor starts; the trainer actor is scheduled into the trainer pool's bundle, the
rollouter actor into the rollout pool's. A pool is checked against the cluster first: a placement group that can
never be placed would otherwise wait forever, so a pool larger than the cluster — alone, or with the other pool —
fails at start, naming the key and what the cluster has (``PoolTooLarge``, a ``ConfigError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tether.config import ConfigError
from tether.config.cluster import PoolConfig, ResourcePoolConfig

POOLS = ("trainer_pool", "rollout_pool")


class PoolTooLarge(ConfigError):
    """A resource pool asks for more than the cluster has."""


def bundle(pool: PoolConfig) -> dict[str, float]:
    out = {"CPU": float(pool.num_cpus)}
    if pool.num_gpus:
        out["GPU"] = float(pool.num_gpus)
    return out


def check_pools(resource_pool: ResourcePoolConfig, cluster: dict[str, float]) -> None:
    """Raise ``PoolTooLarge`` naming the key when a pool, or both pools together, exceed ``cluster``
    (``ray.cluster_resources()``)."""
    have = {r: float(cluster.get(r, 0.0)) for r in ("CPU", "GPU")}
    shown = f"the cluster has {have['CPU']:g} CPUs and {have['GPU']:g} GPUs"
    pools = {name: getattr(resource_pool, name) for name in POOLS}
    for name, pool in pools.items():
        for resource, key in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
            want = bundle(pool).get(resource, 0.0)
            if want > have[resource]:
                raise PoolTooLarge(f"`resource_pool.{name}.{key}` = {want:g} is more than the cluster has: {shown}; "
                                   f"set resource_pool.{name}.{key} to at most {have[resource]:g}"
                                   + (" (0 = CPUs only)" if resource == "GPU" else ""))
    for resource, key in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
        total = sum(bundle(p).get(resource, 0.0) for p in pools.values())
        if total > have[resource]:
            parts = " + ".join(f"`resource_pool.{n}.{key}` = {bundle(p).get(resource, 0.0):g}"
                               for n, p in pools.items())
            raise PoolTooLarge(f"{parts} = {total:g} is more than the cluster has: {shown}; the two pools are "
                               f"reserved side by side, make them fit together")


@dataclass
class Pools:
    """The two placement groups (``ray.util.placement_group.PlacementGroup``)."""

    trainer: Any
    rollout: Any

    def strategy(self, name: str) -> Any:
        """The scheduling strategy that puts an actor into bundle 0 of pool ``name`` ("trainer" or "rollout")."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415 — the optional extra ``ray``

        return PlacementGroupSchedulingStrategy(placement_group=getattr(self, name),
                                                placement_group_bundle_index=0)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group  # noqa: PLC0415 — the optional extra ``ray``

        for pg in (self.trainer, self.rollout):
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 — already gone with the cluster
                pass


def reserve_pools(resource_pool: ResourcePoolConfig, timeout_s: float = 120.0) -> Pools:
    """Check the pools against the cluster, then reserve both; a reservation not granted within ``timeout_s``
    (resources held by other jobs on a shared cluster) fails naming the pools."""
    import ray  # noqa: PLC0415 — the optional extra ``ray``
    from ray.util.placement_group import placement_group  # noqa: PLC0415 — the optional extra ``ray``

    check_pools(resource_pool, ray.cluster_resources())
    trainer, rollout = bundle(resource_pool.trainer_pool), bundle(resource_pool.rollout_pool)
    pools = Pools(placement_group([trainer], strategy="STRICT_PACK", name="tether-trainer_pool"),
                  placement_group([rollout], strategy="STRICT_PACK", name="tether-rollout_pool"))
    ready, _ = ray.wait([pools.trainer.ready(), pools.rollout.ready()], num_returns=2, timeout=timeout_s)
    if len(ready) < 2:
        pools.remove()
        raise PoolTooLarge(f"resource_pool.trainer_pool {trainer} and rollout_pool {rollout} could not both be "
                           f"placed within {timeout_s:.0f} s (available now: {ray.available_resources()}); free "
                           "resources or make the pools smaller")
    return pools
