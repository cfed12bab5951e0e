"""Supervised fine-tuning on trajectories: maximise the log-likelihood of the mask-1 tokens.

The warm start of ``tether sft``, the ``tiny-sft`` preset and the demo. Trajectories come from the agent
loop (a scripted expert replayed through ``ScriptedEngine``) or are laid out as it would lay them out (JSONL
conversations), so SFT sees exactly the token layout RL will generate in (``tether.warmstart.demos``).

Two hooks keep the loop generic: ``augment(trajectory, rng)`` returns the trajectory to train on this time
(e.g. with its ids swapped for others, token for token), and ``extra_loss(model)`` adds a term to every
step's loss (e.g. an auxiliary task trained alongside).

Precision. ``compute_dtype`` (``model.dtype``): the forward and backward under ``torch.autocast`` in that dtype over
the model's own (float32) weights and AdamW state, the log-likelihood in float32, as the RL learner does
(``tether.learner.logits``).

Threads. Before each epoch the torch thread count is re-decided from the cores other processes leave
(``tether.threads``: at most the caller's count, which is given back at the end; ``TETHER_THREADS=N`` fixes it).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tether.algo import logprobs_from_logits
from tether.learner.batch import TrainBatch
from tether.learner.logits import autocast
from tether.threads import TorchThreads
from tether.types import Trajectory


def warmup_cosine(opt: torch.optim.Optimizer, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)) * 0.5 * (1 + math.cos(math.pi * min(s / max(steps, 1), 1.0))))


def sft(model: Any, trajectories: Sequence[Trajectory], *, pad_id: int, epochs: int = 3, lr: float = 1e-3,
        batch_size: int = 16, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
        warmup: int = 10, seed: int = 0, augment: Callable[[Trajectory, random.Random], Trajectory] | None = None,
        extra_loss: Callable[[Any], torch.Tensor] | None = None, log: Any = None,
        threads: TorchThreads | None = None, compute_dtype: torch.dtype | None = None) -> list[float]:
    """Train ``model`` in place; AdamW with linear warmup then cosine decay. Returns the per-epoch losses
    (mean negative log-likelihood per trained token, ``extra_loss`` not included). ``threads``: the thread count's
    chooser, re-decided before each epoch (a build shares one across its phases); None = one of its own over the
    caller's count. Either way the caller's count is back on return. ``compute_dtype``: autocast's (None: the
    weights' own dtype)."""
    compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
    threads = threads or TorchThreads(log)
    with threads:
        model.train()
        trained = [p for p in model.parameters() if p.requires_grad]  # model.lora: the adapter only
        opt = torch.optim.AdamW(trained, lr=lr, betas=betas, weight_decay=weight_decay)
        sched = warmup_cosine(opt, epochs * math.ceil(len(trajectories) / batch_size), warmup)
        rng = random.Random(seed)
        order = list(range(len(trajectories)))
        losses = []
        for epoch in range(epochs):
            threads.update()  # contention changes over minutes: the last epoch's decides the next
            rng.shuffle(order)
            total, count = 0.0, 0
            for i in range(0, len(order), batch_size):
                chunk = [trajectories[j] for j in order[i:i + batch_size]]
                if augment is not None:
                    chunk = [augment(t, rng) for t in chunk]
                batch = TrainBatch.from_trajectories(chunk, [0.0] * len(chunk), pad_id=pad_id)
                with autocast(batch.input_ids.device, compute_dtype):
                    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, T, V]
                logp = logprobs_from_logits(logits[:, :-1], batch.input_ids[:, 1:])  # [B, T-1] float32
                mask = batch.loss_mask[:, 1:]
                nll = -(logp * mask).sum() / mask.sum().clamp_min(1.0)
                loss = nll + extra_loss(model) if extra_loss is not None else nll
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                total += float(nll.detach()) * float(mask.sum())
                count += int(mask.sum())
            losses.append(total / max(count, 1))
            if log:
                log(f"sft epoch {epoch + 1}/{epochs}: nll/token {losses[-1]:.4f}")
    model.eval()
    return losses
