"""Weights from the trainer to the rollout engine through the Ray object store, in buckets, versioned.

The trainer packs its state dict (CPU tensors) into buckets of at most ``ray.weight_bucket_mb`` MiB — a tensor
larger than a bucket is a bucket of its own — and puts each into the object store; the rollouter actor fetches the
buckets and loads them into its engine as one update, at the engine's next step boundary (``LocalEngine.
update_weights``). verl streams its weights the same way (``update_weights_bucket_megabytes``), over NCCL/CUDA IPC
on GPUs; the ``torch.distributed`` broadcast path (``ray.weight_transfer: nccl``) is refused at load until it can
be tested on GPUs.

Every push carries a **token** (1, 2, …; 0 = the weights the actor loaded from the model folder) besides the
parameter version: a version may be pushed twice (a resume pushes the checkpoint's weights under the version they
already had), a token never. The rollouter actor applies a push only when its token is newer than the one it holds,
and refuses to generate with any token but the trainer's latest: a restarted actor, or one that missed a push,
catches up to the latest weights before its next rollout (``RemoteEngine.catch_up``).
"""

from __future__ import annotations

from typing import Any

import torch

MiB = 1024 * 1024


def pack_buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """The state dict in order, cut into buckets of at most ``bucket_bytes`` bytes (a larger tensor alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[dict[str, torch.Tensor]] = []
    size = bucket_bytes  # forces a new bucket for the first tensor
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if size + n > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = t
        size += n
    return buckets


def unpack_buckets(buckets: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        out.update(bucket)
    return out


class WeightPush:
    """One push: its token, parameter version and the object references of its buckets (kept alive by this
    object: the trainer holds the latest push so that a restarted actor can fetch it)."""

    def __init__(self, token: int, version: int, refs: list[Any], nbytes: int):
        self.token, self.version, self.refs, self.nbytes = token, version, refs, nbytes


def put_weights(state_dict: dict[str, torch.Tensor], token: int, version: int, bucket_bytes: int) -> WeightPush:
    import ray  # noqa: PLC0415 — the optional extra ``ray``

    buckets = pack_buckets(state_dict, bucket_bytes)
    nbytes = sum(t.numel() * t.element_size() for b in buckets for t in b.values())
    return WeightPush(token, version, [ray.put(b) for b in buckets], nbytes)
