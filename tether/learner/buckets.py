"""The trainer's weights in buckets of bytes: how a weight sync cuts a state dict (``ray.weight_bucket_mb``), so
that a sharded trainer can gather, send and free one bucket at a time (``Learner.weight_buckets``,
``LearnerGroup.weight_buckets``) instead of holding a whole copy beside its shards."""

from __future__ import annotations

from typing import Any


def cut_buckets(state_dict: dict[str, Any], bucket_bytes: int) -> list[list[str]]:
    """The state dict's names in order, cut into buckets of at most ``bucket_bytes`` bytes (a larger tensor alone).
    Sizes are the whole tensors' (a DTensor shard reports its global shape), so every rank cuts alike."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[str]] = []
    size = bucket_bytes  # forces a new bucket for the first tensor
    for name, tensor in state_dict.items():
        n = tensor.numel() * tensor.element_size()
        if size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += n
    return buckets
