"""The trainer's side of ``backend: ray``: stand-ins for the pieces that live in other actors.

``Run.build`` takes them through ``parts`` (``RayParts``) where the local backend builds its own:

- ``RolloutHandle`` for the rollout engine: ``update_weights`` puts the weights into the object store in buckets
  and has the RolloutWorker load them, or broadcasts the buckets to it (``ray.weight_transfer: nccl``; both in
  ``weight_transfer.py``); ``update_adapter`` sends a LoRA adapter alone (``model.lora``); ``stats`` is the
  engine's.
- ``RemoteRollouter`` for the ``Rollouter``: ``group`` / ``groups`` run in the RolloutWorker, and with them the LLM
  judge's reward loop and the teacher; the trainer settles judge failures (``reward.on_judge_failure``).
- ``RemoteQueue`` for the ``MessageQueue`` (async modes): the same methods, in a QueueWorker actor.

**A rollouter actor that dies.** Ray restarts it (up to ``ray.max_actor_restarts`` times, from the model folder:
token 0). Every call that was in flight fails with ``RayActorError``; ``RemoteRollouter`` makes the same call
again — the same task, step, index and seed, so the same group — once the actor is back and has caught up to the
latest weights. The producer and its ledger (``pipeline/ledger.py``) never see the failure, so each group still
reaches the queue, and the trainer, exactly once; ``ray/requeued_calls`` counts the calls made again,
``ray/actor_restarts`` the restarts and ``ray/weight_catch_ups`` the pushes sent again to an actor that lacked the
latest weights (a new incarnation, or a push cut short) — under ``nccl`` through the object store, and the next
push makes a new broadcast group with the new incarnation (``ray/weight_group_joins``). When the restarts are
spent, ``RolloutActorLost`` ends the run like any failure of the rollouter (the last checkpoint stands;
``--resume`` continues).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from typing import Any, cast

import torch

from tether.config.cluster import RayConfig
from tether.distributed.weight_transfer import (
    BucketLayout,
    MiB,
    WeightGroup,
    WeightPush,
    cut_buckets,
    flatten,
    host_store,
    put_buckets,
    unflatten,
)
from tether.metrics import Reduce, record_metric
from tether.pipeline.queue import MessageQueue
from tether.pipeline.rollouter import RolloutError
from tether.reward.loop import RewardLoop
from tether.types import Group, Task, Trajectory


class RolloutActorLost(RuntimeError):
    """The rollouter actor died and Ray will not restart it again."""


def _actor_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError  # noqa: PLC0415 — the optional extra ``ray``

    return RayActorError, ActorUnavailableError


class RolloutHandle:
    """The rollout engine as the trainer sees it (``WeightSync`` pushes to it, ``step_metrics`` reads ``stats``).

    ``transfer``: ``ray.weight_transfer`` — ``object_store``, or ``nccl``: a broadcast in a ``WeightGroup`` whose
    store this process hosts, made at the first push and again for each new incarnation of the actor."""

    def __init__(self, actor: Any, bucket_bytes: int, max_restarts: int, transfer: str = "object_store",
                 timeout_s: float = 600.0):
        self.actor, self.bucket_bytes, self.max_restarts = actor, bucket_bytes, max_restarts
        self.transfer, self.timeout_s = transfer, timeout_s
        self.token = 0  # the latest push's (0: none yet)
        self.latest: WeightPush | None = None  # held, so that its buckets stay in the object store
        self._tokens = 0
        self._lock = threading.Lock()
        self._pid: int | None = None
        self.restarts = 0
        self._push_lock = threading.Lock()  # nccl: one broadcast at a time, and a catch-up waits for it
        self._sent: tuple[int, int, list[BucketLayout], list[torch.Tensor]] | None = None  # the latest broadcast
        self._store: Any = None  # nccl: the groups' TCPStore, hosted here on self._host
        self._host = ""
        self._group: WeightGroup | None = None
        self._groups = 0

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.update_weights_from_buckets(({n: state_dict[n] for n in names}
                                          for names in cut_buckets(state_dict, self.bucket_bytes)), version)

    def update_weights_from_buckets(self, buckets: Iterable[dict[str, Any]], version: int) -> None:
        """Push ``buckets`` (``Learner.weight_buckets``: gathered as they are asked for) as ``version``: each is put
        into the object store, or flattened into its broadcast buffer, before the next is asked for."""
        if self.transfer == "nccl":
            self._broadcast(buckets, version)
            return
        with self._lock:
            self._tokens += 1
            push = put_buckets(buckets, self._tokens, version)
            self.latest, self.token = push, push.token
        record_metric("perf/weight_sync_buckets", len(push.refs), "sum")
        record_metric("perf/weight_sync_mb", push.nbytes / MiB, "sum")
        self._deliver(push)

    def update_adapter(self, adapter: dict[str, torch.Tensor], scaling: float, version: int) -> None:
        """``model.lora``: push the adapter (``Learner.adapter_for_engine``: A and B by layer name) as ``version``; the
        actor's engine merges it with ``scaling`` (alpha / rank) into its base weights (``LocalEngine.update_adapter``).
        Through the object store under either ``ray.weight_transfer`` (``weight_transfer.py``); ``WeightSync``
        records its bytes as ``perf/weight_sync_mb``."""
        with self._push_lock:  # nccl: after a broadcast in progress, so the catch-up sends the newest push
            with self._lock:
                self._tokens += 1
                buckets = ({n: adapter[n] for n in names} for names in cut_buckets(adapter, self.bucket_bytes))
                push = put_buckets(buckets, self._tokens, version, scaling)
                self.latest, self.token = push, push.token
            self._sent = None  # an older broadcast: never the one to catch up to
        record_metric("perf/weight_sync_buckets", len(push.refs), "sum")
        self._deliver(push)

    def _deliver(self, push: WeightPush) -> None:
        """Have the actor load ``push`` from the object store, again to each new incarnation until one has it."""
        import ray  # noqa: PLC0415 — the optional extra ``ray``

        while True:
            try:
                ray.get(self._load(push))
                return
            except _actor_errors():  # the new incarnation gets this push on the next attempt: it catches up
                self.wait_alive()
                record_metric("ray/weight_catch_ups", 1, "sum")

    def _load(self, push: WeightPush) -> Any:
        """The actor's call that loads ``push`` (an adapter, or weights), as an object ref."""
        if push.scaling is not None:
            return self.actor.update_adapter.remote(push.token, push.version, push.refs, push.scaling)
        return self.actor.update_weights.remote(push.token, push.version, push.refs)

    def _broadcast(self, buckets: Iterable[dict[str, Any]], version: int) -> None:
        """Tell the actor what comes (token, version, layout), then broadcast the buckets to it. Each bucket is
        flattened into its buffer (on the weights' device) as it comes, and the buffers are kept for a catch-up."""
        import ray  # noqa: PLC0415 — the optional extra ``ray``

        with self._push_lock:
            with self._lock:
                self._tokens += 1
                token = self.token = self._tokens
            flat = [flatten(bucket, next(iter(bucket.values())).device) for bucket in buckets]
            nbytes = sum(layout.nbytes for layout, _ in flat)
            record_metric("perf/weight_sync_buckets", len(flat), "sum")
            record_metric("perf/weight_sync_mb", nbytes / MiB, "sum")
            while True:
                try:
                    group = self._group_for(flat[0][1].device)
                    layouts = [layout for layout, _ in flat]
                    buffers = [buffer.to(group.device) for _, buffer in flat]  # a copy only for gloo with CUDA weights
                    self._sent = (token, version, layouts, buffers)
                    self.latest = None  # an object-store copy of an older push: dropped
                    done = self.actor.receive_weights.remote(token, version, group.name, layouts)
                    try:
                        group.send(list(buffers))
                    except RuntimeError:  # the peer is gone (gloo says so at once) or the broadcast timed out
                        ray.get(done)  # the actor's side says why: RayActorError when it died
                        raise
                    ray.get(done)
                    return
                except _actor_errors():  # a new incarnation: a new group, and this push again
                    self.wait_alive()
                    record_metric("ray/weight_catch_ups", 1, "sum")

    def _group_for(self, device: torch.device) -> WeightGroup:
        """The group with the actor's current incarnation; made (joined by the actor) when it has none."""
        import ray  # noqa: PLC0415 — the optional extra ``ray``
        from ray.util import get_node_ip_address  # noqa: PLC0415 — as above

        name, cuda = ray.get(self.actor.weight_group.remote())
        if self._group is not None and name == self._group.name:
            return self._group
        if self._group is not None:
            self._group.close()
            self._group = None
        if self._store is None:
            self._host = get_node_ip_address()
            self._store = host_store(self._host, self.timeout_s)
        backend = "nccl" if device.type == "cuda" and cuda and torch.distributed.is_nccl_available() else "gloo"
        self._groups += 1
        name = f"tether-weights-{self._groups}"
        joined = self.actor.join_weight_group.remote(self._host, self._store.port, name, backend, self.timeout_s)
        try:
            group = WeightGroup(self._store, name, 0, backend, self.timeout_s, device if backend == "nccl" else None)
        except RuntimeError:  # the actor did not join in time: its side says why
            ray.get(joined)
            raise
        ray.get(joined)
        record_metric("ray/weight_group_joins", 1, "sum")
        self._group = group
        return group

    async def catch_up(self) -> None:
        """Send the latest push (the actor ignores one it already holds). Under ``nccl``: once a broadcast in
        progress has ended (it may be what the actor lacks), through the object store if the actor still lacks it."""
        if self.transfer == "nccl":
            push = await asyncio.to_thread(self._object_store_copy)
        else:
            push = self.latest
        if push is not None:
            await self._load(push)

    def _object_store_copy(self) -> WeightPush | None:
        """The latest broadcast put into the object store (once per push), None when the actor holds it, or the
        latest push when it went through the object store anyway (a LoRA adapter: ``update_adapter``)."""
        import ray  # noqa: PLC0415 — the optional extra ``ray``

        with self._push_lock:
            sent = self._sent
            if sent is None:
                return self.latest
            if ray.get(self.actor.stats.remote())["token"] >= sent[0]:
                return None
            token, version, layouts, buffers = sent
            if self.latest is None or self.latest.token != token:  # copies, not views: a pickled view carries
                buckets = [{k: v.clone() for k, v in unflatten(layout, buffer.cpu()).items()}  # its whole buffer
                           for layout, buffer in zip(layouts, buffers, strict=True)]
                self.latest = put_buckets(buckets, token, version)
            return self.latest

    def wait_alive(self, timeout_s: float = 600.0) -> None:
        """Block until the actor answers again (restarted), counting the restart. ``RolloutActorLost`` once Ray
        will not restart it: it died with its restarts spent (the ones seen here), or did not come back in time."""
        import ray  # noqa: PLC0415 — the optional extra ``ray``
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError  # noqa: PLC0415 — the optional extra ``ray``

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pid = ray.get(self.actor.stats.remote(), timeout=60)["pid"]
                break
            except (ActorUnavailableError, GetTimeoutError):  # restarting: loading the model again
                error: BaseException | None = None
            except RayActorError as e:  # dead: for good once its restarts are spent
                if self.restarts >= self.max_restarts:
                    raise RolloutActorLost(f"the rollouter actor died and was not restarted (ray.max_actor_restarts = "
                                           f"{self.max_restarts} restarts spent): {e}") from e
                error = e
            if time.monotonic() > deadline:
                raise RolloutActorLost(f"the rollouter actor did not come back within {timeout_s:.0f} s "
                                       f"(ray.max_actor_restarts = {self.max_restarts}): {error}")
            time.sleep(0.5)
        self.note_pid(pid)

    def note_pid(self, pid: int) -> None:
        with self._lock:
            if self._pid is not None and pid != self._pid:
                self.restarts += 1
                record_metric("ray/actor_restarts", 1, "sum")
            self._pid = pid

    @property
    def stats(self) -> dict[str, Any]:
        import ray  # noqa: PLC0415 — the optional extra ``ray``

        while True:
            try:
                stats = ray.get(self.actor.stats.remote())
                self.note_pid(stats["pid"])
                return stats
            except _actor_errors():
                self.wait_alive()

    def close(self) -> None:
        """The broadcast group ends here; the actor is the driver's to stop (``ray_backend``)."""
        if self._group is not None:
            self._group.close()
            self._group = None
        self._store = None


async def _scored_in_actor(traj: Trajectory) -> None:
    """``RemoteRollouter.score`` with a teacher: the RolloutWorker's rollouter scores each episode, never this."""
    raise RuntimeError("the teacher scores episodes in the rollouter actor (RolloutWorker), not in the trainer")


class RemoteRollouter:
    """``Rollouter.group`` / ``groups`` in the RolloutWorker; ``greedy`` selects its evaluation rollouter.

    The judge's reward loop and the teacher score the episodes in the RolloutWorker. Here, as on a local
    ``Rollouter``, ``rewards`` is the reward loop ``GroupProducer`` settles each group with (the trainer's copy:
    ``settle`` applies ``reward.on_judge_failure`` to what the actor's loop recorded on the trajectories; it never
    calls the judge), and ``score`` is set when a teacher scores (``GroupProducer`` only asks whether it is)."""

    def __init__(self, handle: RolloutHandle, *, greedy: bool = False, rewards: RewardLoop | None = None,
                 teacher: bool = False):
        self.handle, self.greedy, self.rewards = handle, greedy, rewards
        self.score = _scored_in_actor if teacher else None

    async def group(self, task: Task, group_size: int, seed: int) -> Group:
        return await self._call("group", task, group_size, seed)

    async def groups(self, tasks: list[Task], group_size: int | list[int], seed: int, *,
                     keep_failed: bool = False) -> list[Group]:
        return await self._call("groups", self.greedy, tasks, group_size, seed, keep_failed)

    async def _call(self, method: str, *args: Any) -> Any:
        while True:
            try:
                status, payload, events = await getattr(self.handle.actor, method).remote(self.handle.token, *args)
            except _actor_errors():  # died with this call in flight: made again, the same call, once it is back
                record_metric("ray/requeued_calls", 1, "sum")
                await asyncio.to_thread(self.handle.wait_alive)
                continue
            if status == "behind":  # restarted or missed a push: catch up to the latest weights first
                record_metric("ray/weight_catch_ups", 1, "sum")
                try:
                    await self.handle.catch_up()
                except _actor_errors():
                    await asyncio.to_thread(self.handle.wait_alive)
                continue
            for name, value, reduce in events:
                record_metric(name, value, cast(Reduce, reduce))
            if status == "failed":
                message, cause = payload
                raise RolloutError(message, cause)
            return payload


class QueueWorker:
    """The MessageQueue as an actor (threaded: a blocking ``get_batch`` must not hold up ``put``); every method
    is the MessageQueue's own."""

    def __init__(self, max_size: int, window_size: int | None, max_hold_s: float | None = None):
        self.queue = MessageQueue(max_size, window_size, max_hold_s)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.queue, method)(*args, **kwargs)


class RemoteQueue:
    """``MessageQueue`` in a QueueWorker actor: the methods the pipeline calls, forwarded."""

    def __init__(self, actor: Any):
        self.actor = actor

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray  # noqa: PLC0415 — the optional extra ``ray``

        return ray.get(self.actor.call.remote(method, *args, **kwargs))

    def put(self, item: Any) -> bool:
        return bool(self._call("put", item))

    def abandon(self, seq: int) -> None:
        self._call("abandon", seq)

    def close(self) -> None:
        self._call("close")

    def get_batch(self, n: int, timeout: float | None = None) -> Any:
        return self._call("get_batch", n, timeout)

    def get_available(self) -> Any:
        return self._call("get_available")

    def report_stale(self, groups: Any) -> None:
        self._call("report_stale", list(groups))

    def metrics(self) -> dict[str, float]:
        return self._call("metrics")

    def check_accounting(self) -> None:
        self._call("check_accounting")


class RayParts:
    """What ``Run.build`` takes from other actors under ``backend: ray`` (``pipeline.build.RemoteParts``)."""

    def __init__(self, ray_cfg: RayConfig, rollout_actor: Any, queue_options: dict[str, Any] | None = None):
        self.handle = RolloutHandle(rollout_actor, max(1, int(ray_cfg.weight_bucket_mb * MiB)),
                                    ray_cfg.max_actor_restarts, ray_cfg.weight_transfer)
        self.queue_options = queue_options or {}
        self.queue_actor: Any = None

    def engine(self) -> RolloutHandle:
        return self.handle

    def rollouter(self, *, greedy: bool = False, rewards: RewardLoop | None = None,
                  teacher: bool = False) -> RemoteRollouter:
        return RemoteRollouter(self.handle, greedy=greedy, rewards=rewards, teacher=teacher)

    def make_queue(self, max_size: int, window_size: int | None, max_hold_s: float | None = None) -> RemoteQueue:
        """The MessageQueue of the async modes, started as a QueueWorker actor (owned by this, the trainer's,
        process: it ends with the run)."""
        import ray  # noqa: PLC0415 — the optional extra ``ray``

        started = time.perf_counter()
        worker = ray.remote(QueueWorker).options(num_cpus=0, max_concurrency=16, **self.queue_options)
        self.queue_actor = worker.remote(max_size, window_size, max_hold_s)
        queue = RemoteQueue(self.queue_actor)
        queue.metrics()  # started and answering before the rollouter puts into it
        record_metric("ray/queue_start_s", time.perf_counter() - started, "last")
        return queue
