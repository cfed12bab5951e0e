"""Weights from the trainer to the rollout engine, in buckets, versioned: through the Ray object store, or by a
``torch.distributed`` broadcast (``ray.weight_transfer``).

**object_store** (the default). The trainer packs its state dict (CPU tensors) into buckets of at most
``ray.weight_bucket_mb`` MiB — a tensor larger than a bucket is a bucket of its own — and puts each into the object
store; the rollouter actor fetches the buckets and loads them into its engine as one update, at the engine's next
step boundary (``LocalEngine.update_weights``).

**nccl**. The same buckets, each flattened into one byte buffer (``flatten``: every tensor at a 16-byte-aligned
offset, so its slice views back as its dtype), are broadcast from the trainer (rank 0) to the rollouter actor
(rank 1) in a process group of those two members (``WeightGroup``), made on a ``TCPStore`` the trainer hosts —
never ``torch.distributed``'s default group, which the trainer may hold for its own FSDP ranks and the actor has
none of. NCCL when the trainer's weights are on a GPU and the actor has one, gloo otherwise: the same code, the
backend chosen per group. Before the buffers, a Ray call tells the actor the push's token, version and the bucket
layout (names, shapes, dtypes, offsets), so it can allocate what it receives into; the trainer sends that call
without waiting, broadcasts, then waits for its answer, and the actor receives on a thread of its own, never on its
event loop: neither side waits on something only the other's blocked half could do. An actor that dies mid-push
fails the broadcast (gloo says so at once; NCCL after the group's timeout) and the push is made again to its next
incarnation. verl broadcasts its weights the
same way (``update_weights_bucket_megabytes``, NCCL between the actor and the rollout GPUs). NCCL needs the two
ranks on different GPUs (separate ``resource_pool`` GPUs); only the gloo path has been run here (a CPU machine).

Every push carries a **token** (1, 2, …; 0 = the weights the actor loaded from the model folder) besides the
parameter version: a version may be pushed twice (a resume pushes the checkpoint's weights under the version they
already had), a token never. The rollouter actor applies a push only when its token is newer than the one it holds,
and refuses to generate with any token but the trainer's latest: a restarted actor, or one that missed a push,
catches up to the latest weights before its next rollout (``RolloutHandle.catch_up``). Under ``nccl`` it catches up
through the object store — the trainer keeps the latest push's buffers (on a GPU: one more copy of the weights in
its memory) and puts them there when a catch-up asks — and the next push makes a new group with the new
incarnation (``ray/weight_group_joins``; a group cannot take in a new process). Both paths record
``perf/weight_sync_buckets`` and ``perf/weight_sync_mb`` per sync (``WeightSync`` the seconds,
``perf/weight_sync_s``).

**A LoRA adapter** (``model.lora``). The base weights never change, so a sync sends only the adapter — A and B of
every adapted layer, by the base model's layer names, with alpha / rank — through the object store whatever
``ray.weight_transfer`` says (a few hundred KiB to a few MiB: a broadcast group buys nothing), under the same tokens;
the actor merges it into the base weights its engine loaded from the model folder (``LocalEngine.update_adapter``).
A restarted actor starts from the base again and catches up to the latest adapter like to the latest weights.
``WeightSync`` records its ``perf/weight_sync_mb`` (the adapter's bytes).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tether.learner.buckets import cut_buckets

MiB = 1024 * 1024
ALIGN = 16
"""Bytes: each tensor starts at a multiple of this in its bucket's buffer (``Tensor.view(dtype)`` needs its offset
to be a multiple of the dtype's size)."""


def pack_buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """``cut_buckets``'s buckets of contiguous CPU tensors (what the object store path puts)."""
    return [{name: state_dict[name].detach().to("cpu").contiguous() for name in names}
            for names in cut_buckets(state_dict, bucket_bytes)]


def unpack_buckets(buckets: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        out.update(bucket)
    return out


class WeightPush:
    """One push: its token, parameter version and the object references of its buckets (kept alive by this
    object: the trainer holds the latest push so that a restarted actor can fetch it). ``scaling``: set for a LoRA
    adapter (``model.lora``: the buckets hold A and B by layer name, the engine merges them with alpha / rank =
    ``scaling`` into its base weights); None for weights."""

    def __init__(self, token: int, version: int, refs: list[Any], nbytes: int, scaling: float | None = None):
        self.token, self.version, self.refs, self.nbytes, self.scaling = token, version, refs, nbytes, scaling


def put_buckets(buckets: Iterable[dict[str, torch.Tensor]], token: int, version: int,
                scaling: float | None = None) -> WeightPush:
    """Put each bucket into the object store (as contiguous CPU tensors) as it comes: a bucket is dropped here before
    the next is asked for. ``scaling``: the buckets are a LoRA adapter (``WeightPush``)."""
    import ray  # noqa: PLC0415 — the optional extra ``ray``

    refs, nbytes = [], 0
    for bucket in buckets:
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in bucket.items()}
        nbytes += sum(t.numel() * t.element_size() for t in cpu.values())
        refs.append(ray.put(cpu))
    return WeightPush(token, version, refs, nbytes, scaling)


# ------------------------------------------------------------------------------------------- the broadcast (nccl)

@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    """Bytes from the start of the bucket's buffer (a multiple of ``ALIGN``)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BucketLayout:
    """What the receiver needs to allocate one bucket's buffer and read its tensors back out of it."""

    slots: tuple[Slot, ...]
    nbytes: int
    """The buffer's size (the tensors' bytes and the alignment padding)."""


def flatten(bucket: dict[str, torch.Tensor], device: torch.device) -> tuple[BucketLayout, torch.Tensor]:
    """One bucket as one uint8 buffer on ``device``, and its layout."""
    slots, offset = [], 0
    for name, t in bucket.items():
        slots.append(Slot(name, tuple(t.shape), t.dtype, offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    for slot, t in zip(slots, bucket.values(), strict=True):
        buffer[slot.offset: slot.offset + slot.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return BucketLayout(tuple(slots), offset), buffer


def unflatten(layout: BucketLayout, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The bucket's tensors, as views into ``buffer``."""
    return {s.name: buffer[s.offset: s.offset + s.nbytes].view(s.dtype).reshape(s.shape) for s in layout.slots}


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store the trainer hosts for its weight groups, on a port the OS picks (``store.port``)."""
    return dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class WeightGroup:
    """One member of a two-member process group that broadcasts weights from rank 0 (the trainer) to rank 1 (the
    rollouter actor). Both members construct it at once: the constructor returns when the other has joined.

    ``store``: the trainer's ``host_store``, or on the actor a client of it (``join``); ``name`` keeps the keys of
    one group apart from the groups made before it on the same store (one per actor incarnation); ``device`` (NCCL
    only): the GPU the buffers live on, by default the current one."""

    def __init__(self, store: dist.Store, name: str, rank: int, backend: str, timeout_s: float,
                 device: torch.device | None = None):
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(name, store)
        self.pg: Any
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            options.is_high_priority_stream = False
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
            self.device = device or torch.device("cuda", torch.cuda.current_device())
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        self.store, self.name, self.rank, self.backend = store, name, rank, backend

    @classmethod
    def join(cls, host: str, port: int, name: str, backend: str, timeout_s: float) -> WeightGroup:
        """Rank 1: connect to the trainer's store at ``host:port`` and join group ``name``."""
        store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
        return cls(store, name, 1, backend, timeout_s)

    def _broadcast(self, buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.pg.broadcast([buffer], options).wait()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":  # an NCCL wait() orders the streams only: the host waits here
            torch.cuda.synchronize(self.device)

    def send(self, buffers: list[torch.Tensor]) -> None:
        """Rank 0: broadcast the buffers, one after the other."""
        for buffer in buffers:
            self._broadcast(buffer)
        self._synchronize()

    def receive(self, layouts: list[BucketLayout]) -> dict[str, torch.Tensor]:
        """Rank 1: receive the buffers ``send`` broadcasts, laid out by ``layouts``; the state dict they hold."""
        state_dict: dict[str, torch.Tensor] = {}
        for layout in layouts:
            buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            self._broadcast(buffer)
            state_dict.update(unflatten(layout, buffer))
        self._synchronize()
        return state_dict

    def close(self) -> None:
        self.pg.shutdown()
