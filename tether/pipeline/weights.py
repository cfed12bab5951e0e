"""Weight sync and the one owner of the parameter version.

``param_version`` counts weight syncs: the trainer pushes its weights to the rollout engine every
``trainer.trigger_parameter_sync_step`` steps (every step in ``sync`` mode), and the version goes up by one.
So after step s the engine generates with version ⌊s / every⌋, a pure function of the step — a resumed run
knows its version without storing it. Every token a policy sampled carries the version that sampled it;
staleness (``max_staleness``, ``max_policy_lag``, ``rollout/policy_version_lag_*``) is counted in these
versions, as in verl's fully-async trainer and AReaL.

``WeightSync.version`` is the only copy the pipeline reads; the pieces that must react to a new version
(admission control, the replay buffer's freshness) subscribe to it instead of keeping their own count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from tether.metrics import record_metric

MiB = 1 << 20
RUN_LOG = logging.getLogger("tether.run")  # RUN/train.log (tether.pipeline.progress)


class WeightSync:
    """``dtype``: the engine's (``model.dtype``): the learner's float32 master weights are cast in the copy it pushes
    (half the bytes to copy and send in bfloat16); None = as the learner holds them."""

    def __init__(self, engine: Any, learner: Any, every: int, *, start_step: int = 0, dtype: torch.dtype | None = None):
        if every < 1:
            raise ValueError(f"trainer.trigger_parameter_sync_step must be >= 1, got {every}")
        self.engine, self.learner, self.every = engine, learner, every
        self.dtype = None if dtype == torch.float32 else dtype
        self.version = start_step // every
        self._listeners: list[Callable[[int], None]] = []

    def subscribe(self, listener: Callable[[int], None]) -> None:
        """``listener(version)`` is called after every push."""
        self._listeners.append(listener)

    def push(self) -> None:
        """Load the learner's weights into the engine as ``self.version`` and tell the subscribers.

        With ``model.lora`` (``learner.lora_scaling`` set) only the adapter goes (``update_adapter``: A and B of every
        adapted layer and alpha / rank; the engine keeps its base weights), when the engine takes one; else the whole
        weights (merged, for a LoRA learner). ``perf/weight_sync_mb``: the bytes pushed, in MiB (``backend: ray``'s
        engine records its own)."""
        t = time.perf_counter()
        sent: int | None = 0
        scaling = getattr(self.learner, "lora_scaling", None)
        if scaling is not None and hasattr(self.engine, "update_adapter"):  # model.lora: the adapter alone
            adapter = self.learner.adapter_for_engine(self.dtype)
            sent = _nbytes(adapter)
            self.engine.update_adapter(adapter, scaling, self.version)
        elif hasattr(self.engine, "update_weights_from_buckets"):  # backend: ray — gathered and sent bucket by bucket
            self.engine.update_weights_from_buckets(self.learner.weight_buckets(self.engine.bucket_bytes, self.dtype),
                                                    self.version)  # it records perf/weight_sync_mb itself
            sent = None
        else:  # the engine loads every tensor at once (one version at a step boundary): the whole state dict
            state = self.learner.state_dict_for_engine(self.dtype)
            sent = _nbytes(state)
            self.engine.update_weights(state, self.version)
        for listener in self._listeners:
            listener(self.version)
        elapsed = time.perf_counter() - t
        record_metric("perf/weight_sync_s", elapsed, "sum")
        if sent is not None:
            record_metric("perf/weight_sync_mb", sent / MiB, "sum")
        RUN_LOG.info("parameter sync: param_version=%d pushed to the rollout engine in %.3f s", self.version, elapsed)

    def after_step(self, step: int) -> bool:
        """Sync when ``step`` completes a sync interval; returns whether it did."""
        if step % self.every:
            return False
        self.version = step // self.every
        self.push()
        return True


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors' elements (what a sync moves; no container overhead)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
