"""Supervised fine-tuning on trajectories: maximise the log-likelihood of the mask-1 tokens.

The warm start of the demo. Trajectories come from the agent loop (e.g. a scripted expert replayed
through ``ScriptedEngine``), so SFT sees exactly the token layout RL will generate in.
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

import torch

from tether.algo import logprobs_from_logits
from tether.learner.batch import TrainBatch
from tether.types import Trajectory


def sft(model: Any, trajectories: Sequence[Trajectory], *, pad_id: int, epochs: int = 3, lr: float = 1e-3,
        batch_size: int = 16, weight_decay: float = 0.0, warmup: int = 10, seed: int = 0,
        log: Any = None) -> list[float]:
    """Train ``model`` in place; AdamW with linear warmup then cosine decay. Returns the per-epoch losses
    (mean negative log-likelihood per trained token)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(trajectories) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    rng = random.Random(seed)
    order = list(range(len(trajectories)))
    # Sorting each shuffled chunk by length keeps padding small.
    losses = []
    for epoch in range(epochs):
        rng.shuffle(order)
        total, count = 0.0, 0
        for i in range(0, len(order), batch_size):
            chunk = [trajectories[j] for j in order[i:i + batch_size]]
            batch = TrainBatch.from_trajectories(chunk, [0.0] * len(chunk), pad_id=pad_id)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V]
            logp = logprobs_from_logits(logits[:, :-1], batch.input_ids[:, 1:])  # [B, T-1]
            mask = batch.loss_mask[:, 1:]
            loss = -(logp * mask).sum() / mask.sum().clamp_min(1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total += float(loss.detach()) * float(mask.sum())
            count += int(mask.sum())
        losses.append(total / max(count, 1))
        if log:
            log(f"sft epoch {epoch + 1}/{epochs}: nll/token {losses[-1]:.4f}")
    model.eval()
    return losses
