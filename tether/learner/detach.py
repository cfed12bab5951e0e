"""``actor_worker.class``: what the trainer's worker keeps of its weights between phases.

``ActorWorker`` keeps nothing: π_prox, the policy the PPO ratio and the behaviour correction are taken around,
is the learner's weights at the start of each step (one forward without grad; AReaL's decoupled PPO).

``DetachActorWorker`` (verl's, ``verl/experimental/separation/engine_workers.py``) keeps copies of the
trainer's weights in CPU memory, by name (``save(slot)``, ``restore(slot)``, ``drop(slot)``), for two uses:

- **π_prox fixed across a sync window.** At every weight sync the weights just pushed to the rollout engine are
  saved as the ``"sync"`` slot; each step scores π_prox under them (save the current weights, restore the
  sync's, score, restore the current). With ``trainer.trigger_parameter_sync_step`` = k > 1 the k steps of a
  window share one π_prox — the policy the rollouter samples from — where ``ActorWorker`` moves it every step
  (verl's ``FullyAsyncTrainer._compute_old_log_prob`` with ``bypass_mode: false``). At k = 1 the two agree: the
  sync happens after every step, so the step starts from the sync's weights (and no copy is restored).
- **Freeing accelerator memory between phases** (``offload`` / ``reload``): the weights, gradients and the
  optimizer's moments move to CPU memory and back, e.g. while the rollout engine needs the GPU.

Only the parameters that train are kept: with ``model.lora`` the adapter alone (the frozen base never moves), so
a slot is the adapter's size and π_prox is the policy with the last sync's adapter — the one the rollout engine
serves (the sync pushes that adapter: ``tether.pipeline.weights``). Sharded (FSDP2) parameters are saved shard by
shard: each rank copies its own local shard, as verl's ``fsdp2_sharded_save_to_cpu``. Timings go to
``perf/detach_save_s`` and ``perf/detach_restore_s`` (seconds per trainer step, summed);
``benchmarks/detach_save_restore.py`` measures them alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tether.metrics import record_metric

SYNC = "sync"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def trained_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's tensor) of every trained parameter of ``model``, FSDP2 units resharded first."""
    for module in model.modules():  # FSDP2 keeps the root's weights gathered after a forward: shard them
        if isinstance(module, FSDPModule):
            module.reshard()
    for name, p in model.named_parameters():  # tied parameters once
        if p.requires_grad:  # frozen ones never move (model.lora: the base): only the trained are kept
            yield name, _local(p)


class ActorWorker:
    """The default worker: π_prox is the current weights; nothing is kept."""

    name = "ActorWorker"

    def on_sync(self, version: int) -> None:
        """The learner's weights were pushed to the rollout engine after ``version`` trainer steps."""

    @contextmanager
    def prox_weights(self, version: int) -> Iterator[None]:
        """Inside: the weights π_prox is scored under (here the current ones) at trainer version ``version``."""
        yield


class DetachActorWorker(ActorWorker):
    """CPU copies of ``model``'s parameters by slot; π_prox under the last sync's copy (see the module doc)."""

    name = "DetachActorWorker"

    def __init__(self, model: torch.nn.Module, optimizer: Any = None):
        self.model, self.optimizer = model, optimizer
        self.slots: dict[str, dict[str, torch.Tensor]] = {}
        self.sync_version: int | None = None  # the trainer version whose weights the "sync" slot holds
        self.offloaded: torch.device | None = None

    # ------------------------------------------------------------------------------------------ slots

    def _params(self) -> Iterator[tuple[str, torch.Tensor]]:
        return trained_params(self.model)

    def save(self, slot: str) -> float:
        """Copy the parameters (this rank's shards) into CPU memory as ``slot``; returns the seconds it took."""
        t = time.perf_counter()
        kept = self.slots.get(slot)
        with torch.no_grad():
            if kept is None:  # pinned memory makes the device → host copies asynchronous
                pin = torch.cuda.is_available() and any(p.is_cuda for _, p in self._params())
                kept = {n: torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                        for n, p in self._params()}
                self.slots[slot] = kept
            for n, p in self._params():
                kept[n].copy_(p, non_blocking=True)
            _synchronize()
        elapsed = time.perf_counter() - t
        record_metric("perf/detach_save_s", elapsed, "sum")
        return elapsed

    def restore(self, slot: str) -> float:
        """Copy ``slot`` back into the parameters, in place (the optimizer keeps its tensors); returns seconds."""
        if slot not in self.slots:
            raise KeyError(f"no weights saved as {slot!r} (saved: {sorted(self.slots)})")
        t = time.perf_counter()
        kept = self.slots[slot]
        with torch.no_grad():
            for n, p in self._params():
                p.copy_(kept[n], non_blocking=True)
            _synchronize()
        elapsed = time.perf_counter() - t
        record_metric("perf/detach_restore_s", elapsed, "sum")
        return elapsed

    def drop(self, slot: str) -> None:
        self.slots.pop(slot, None)

    # ------------------------------------------------------------------------------------------ π_prox

    def on_sync(self, version: int) -> None:
        self.save(SYNC)
        self.sync_version = version

    @contextmanager
    def prox_weights(self, version: int) -> Iterator[None]:
        if self.sync_version is None or self.sync_version == version:  # no update since the sync: the same weights
            yield
            return
        self.save("current")
        self.restore(SYNC)
        try:
            yield
        finally:
            self.restore("current")

    # ------------------------------------------------------------------------------------------ memory

    def offload(self) -> float:
        """Move the parameters, their gradients and the optimizer's state to CPU memory; returns seconds."""
        if self.offloaded is not None:
            return 0.0
        t = time.perf_counter()
        device = next(self.model.parameters()).device
        self._move(torch.device("cpu"))
        self.offloaded = device
        elapsed = time.perf_counter() - t
        record_metric("perf/detach_offload_s", elapsed, "sum")
        return elapsed

    def reload(self) -> float:
        """Bring back what ``offload`` moved, to the device it came from; returns seconds."""
        if self.offloaded is None:
            return 0.0
        t = time.perf_counter()
        self._move(self.offloaded)
        self.offloaded = None
        elapsed = time.perf_counter() - t
        record_metric("perf/detach_reload_s", elapsed, "sum")
        return elapsed

    def _move(self, device: torch.device) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                if isinstance(p, DTensor):
                    raise NotImplementedError("offload of FSDP2-sharded parameters: use fully_shard's "
                                              "CPUOffloadPolicy (tether.learner.fsdp.shard_model(offload=True))")
                p.data = p.data.to(device, non_blocking=True)
                if p.grad is not None:
                    p.grad = p.grad.to(device, non_blocking=True)
            inner = getattr(self.optimizer, "optimizer", self.optimizer)  # PolicyOptimizer wraps torch's
            for state in getattr(inner, "state", {}).values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = v.to(device, non_blocking=True)
            _synchronize()
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def make_worker(name: str, model: torch.nn.Module, optimizer: Any = None) -> ActorWorker:
    """The worker ``actor_worker.class`` names."""
    if name == DetachActorWorker.name:
        return DetachActorWorker(model, optimizer)
    if name == ActorWorker.name:
        return ActorWorker()
    raise ValueError(f"actor_worker.class must be ActorWorker or DetachActorWorker, got {name!r}")
