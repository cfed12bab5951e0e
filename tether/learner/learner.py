"""The learner: one trainer step = the policy-gradient updates on one batch of trajectories.

Batch vocabulary (``learner`` section; every unit is *trajectories*):

    batch_size                   trajectories per trainer step (``train_step`` must receive exactly this many)
    mini_batch_size              trajectories per optimizer update → batch_size / mini_batch_size updates per pass
    gradient_accumulation_steps  micro-batches per mini-batch → micro-batch = mini_batch_size / accumulation
    update_frequency             passes (PPO epochs) over the batch per trainer step; 1 = each trajectory is
                                 trained on once. Every pass reuses the behaviour logprobs as old_logp.

One optimizer update: for each micro-batch, forward the policy, take log_softmax(logits / T) of the sampled
tokens (T = ``engine.temperature``, the rollout engine's definition; T = 0, greedy, is scored at T = 1 as the
engine does), and back-propagate

    loss = agg(policy_loss_fn(logp, old_logp, A, mask)) − entropy_coef · agg(H) + kl_coef · agg(KL̂(π_θ ‖ π_ref))

where every ``agg`` divides by the *whole mini-batch's* denominator (``tether.algo.loss_denominator`` summed over
its micro-batches), so micro-batch × accumulation gives the same gradient as one pass over the mini-batch.
Then clip, and step AdamW unless something was non-finite (``optim.PolicyOptimizer``).

Mini-batches are taken in the order the trajectories were given (no shuffling), so a group stays together
and a run is reproducible. ``policy_loss_fn``, ``kl_coef`` and ``loss_agg_mode`` are plain attributes: an
off-policy correction or loss variant replaces ``policy_loss_fn`` (any ``tether.algo.PolicyLossFn``), an
adaptive KL controller sets ``kl_coef`` between steps.

Metrics of a step (returned and recorded):
    optim/loss             mean over updates of the mini-batch loss (pg − entropy + KL terms)
    optim/grad_norm        mean over *applied* updates of the pre-clip global norm (NaN if all were skipped)
    optim/entropy          mean per-token entropy (nats, at T) over the model tokens of the step
    optim/kl_divergence    mean per-token value of the configured estimator (k1/k2/k3) of KL(π_θ ‖ π_ref) over
                           the model tokens; absent when KL is off
    optim/kl_coef          the coefficient used (0 when KL is off)
    optim/clip_ratio_low   fraction of model tokens whose clip was active (r < 1 − ε_low, A < 0), and
    optim/clip_ratio_high  (r > 1 + ε_high, A > 0), as ``clipped_surrogate`` counts them
    optim/lr               the lr of the step's last update
    optim/skipped_steps    updates skipped for a non-finite loss/gradient, cumulative over the run
    perf/tokens_per_s      non-pad tokens forwarded and back-propagated (× passes) / wall time of the step
Per-token metrics are averaged over micro-batches weighted by their model-token counts.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence

import torch

from tether.algo import (
    PolicyLossFn,
    aggregate,
    clipped_surrogate,
    entropy_bonus,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    loss_denominator,
)
from tether.algo.aggregation import AggMode
from tether.config import RunConfig
from tether.learner.batch import TrainBatch
from tether.learner.optim import PolicyOptimizer
from tether.metrics import record_metric
from tether.types import Trajectory

log = logging.getLogger(__name__)

_LAST = {"optim/lr", "optim/kl_coef", "optim/skipped_steps"}  # metrics that are a state, not an average


class Learner:
    """The policy (trained), a frozen reference (when KL is on), the optimizer, and ``train_step``.

    ``ref_model``: the KL reference; None = a deep copy of ``model`` as given. Unused (dropped) when
    ``kl_control.type`` is "none". ``version`` counts completed trainer steps, skipped updates included.
    """

    def __init__(self, model: torch.nn.Module, ref_model: torch.nn.Module | None, cfg: RunConfig):
        lc, po = cfg.learner, cfg.policy_optimization
        self.model = model
        self.batch_size = lc.batch_size
        self.mini_batch_size = lc.mini_batch_size
        self.gradient_accumulation_steps = lc.gradient_accumulation_steps
        self.epochs = lc.update_frequency
        self.temperature = cfg.engine.temperature if cfg.engine.temperature > 0 else 1.0
        self.entropy_coef = po.exploration.entropy_coef
        self.loss_agg_mode: AggMode = "token_mean"
        self.norm_len: int | None = None  # Dr. GRPO's constant; None = longest response of the step
        self.policy_loss_fn: PolicyLossFn = functools.partial(
            clipped_surrogate, clip_low=lc.off_policy_correction.clip_ratio, clip_high=po.exploration.clip_higher
        )
        kl_on = po.kl_control.type != "none"
        self.kl_estimator = po.kl_control.estimator
        self.kl_coef = po.kl_control.init_coef if kl_on else 0.0
        self.ref_model = None
        if kl_on:
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
            self.ref_model.requires_grad_(False).eval()
        self.optimizer = PolicyOptimizer.from_config(model.parameters(), po.optimizer)
        self.pad_id = _pad_id(model)
        self.version = 0  # trainer steps completed
        log.info("learner: %s", self.describe())

    # ------------------------------------------------------------------------------------------ totals

    @property
    def updates_per_pass(self) -> int:
        return self.batch_size // self.mini_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.mini_batch_size // self.gradient_accumulation_steps

    def describe(self) -> str:
        """One line with the derived totals, e.g. ``batch 64 traj/step = 8 updates × (2 micro × 4 traj), 1 epoch``."""
        u, e = self.updates_per_pass, self.epochs
        line = (f"batch {self.batch_size} traj/step = {u} update{'s' * (u > 1)} × "
                f"({self.gradient_accumulation_steps} micro × {self.micro_batch_size} traj), {e} epoch{'s' * (e > 1)}")
        return line if e == 1 else f"{line} → {u * e} optimizer updates/step"

    # ------------------------------------------------------------------------------------------ step

    def train_step(self, trajectories: Sequence[Trajectory],
                   advantages: Sequence[float] | torch.Tensor) -> dict[str, float]:
        """Train on exactly ``batch_size`` trajectories (one advantage each); returns and records the metrics."""
        if len(trajectories) != self.batch_size:
            raise ValueError(f"train_step got {len(trajectories)} trajectories; learner.batch_size is "
                             f"{self.batch_size} (a trainer step takes exactly that many)")
        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        batch = TrainBatch.from_trajectories(trajectories, advantages, pad_id=self.pad_id)
        norm_len = self.norm_len or max(len(t.response_ids) for t in trajectories) or 1
        acc: dict[str, list[tuple[float, float]]] = defaultdict(list)  # name -> [(value, weight)]
        self.model.train()
        for _ in range(self.epochs):
            for mini in batch.split(self.updates_per_pass):
                self._update(mini, device, norm_len, acc)
        self.version += 1
        elapsed = time.perf_counter() - t0

        metrics = {name: _weighted_mean(vals) for name, vals in acc.items()}
        metrics.setdefault("optim/grad_norm", math.nan)  # every update of the step was skipped
        metrics["optim/kl_coef"] = float(self.kl_coef)
        metrics["optim/skipped_steps"] = float(self.optimizer.skipped_steps)
        metrics["perf/tokens_per_s"] = batch.num_tokens * self.epochs / max(elapsed, 1e-9)
        for name, value in metrics.items():
            record_metric(name, value, reduce="last" if name in _LAST else "mean")
        return metrics

    def _update(self, mini: TrainBatch, device: torch.device, norm_len: int,
                acc: dict[str, list[tuple[float, float]]]) -> None:
        """One optimizer update on a mini-batch, accumulated over its micro-batches."""
        micros = [_to(mb, device) for mb in mini.split(self.gradient_accumulation_steps)]
        # Global denominator: the loss positions of the whole mini-batch, in the units of the aggregation mode.
        denom = sum(loss_denominator(mb.loss_mask[:, 1:], self.loss_agg_mode) for mb in micros)
        self.optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for mb in micros:
            loss, tok_metrics = self._micro_loss(mb, denom, norm_len)
            loss.backward()
            total += loss.detach()
            n_tok = float(mb.loss_mask.sum())
            for name, value in tok_metrics.items():
                acc[name].append((float(value), n_tok))
        result = self.optimizer.update(loss_is_finite=bool(torch.isfinite(total)))
        acc["optim/loss"].append((float(total), 1.0))
        acc["optim/lr"] = [(result.lr, 1.0)]
        if result.applied:  # the mean grad norm is over applied updates; a skipped one shows in skipped_steps
            acc["optim/grad_norm"].append((result.grad_norm, 1.0))

    def _micro_loss(self, mb: TrainBatch, denom: torch.Tensor,
                    norm_len: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the mini-batch loss, and its per-token metrics."""
        ids = mb.input_ids[:, 1:]  # [b, T-1] targets: logits at t-1 predict token t
        mask = mb.loss_mask[:, 1:]  # [b, T-1]
        old_logp = mb.old_logp[:, 1:]  # [b, T-1]
        logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        logits = logits[:, :-1]  # [b, T-1, V]
        logp = logprobs_from_logits(logits, ids, self.temperature)  # [b, T-1]
        agg = dict(mode=self.loss_agg_mode, denom=denom,
                   norm_len=norm_len if self.loss_agg_mode == "seq_mean_token_sum_norm" else None)

        pg_tok, m_pg = self.policy_loss_fn(logp, old_logp, mb.advantages, mask)  # [b, T-1]
        loss = aggregate(pg_tok, mask, **agg)
        metrics = {f"optim/{k}": m_pg[k] for k in ("clip_ratio_low", "clip_ratio_high") if k in m_pg}

        with torch.set_grad_enabled(self.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits, self.temperature)  # [b, T-1]
        ent_term, m_ent = entropy_bonus(entropy, mask, coef=self.entropy_coef, **agg)
        metrics["optim/entropy"] = m_ent["entropy"]
        if self.entropy_coef > 0:
            loss = loss + ent_term

        if self.ref_model is not None:
            with torch.no_grad():
                ref_logits = self.ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                            use_cache=False).logits[:, :-1]
                ref_logp = logprobs_from_logits(ref_logits, ids, self.temperature)  # [b, T-1]
            kl_term, m_kl = kl_penalty(logp, ref_logp, mask, coef=self.kl_coef, kind=self.kl_estimator, **agg)
            loss = loss + kl_term
            metrics["optim/kl_divergence"] = m_kl["kl"]
        return loss, metrics

    # ------------------------------------------------------------------------------------------ weights

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """A detached copy of the policy's weights (a copy, so further training does not change what was pushed)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _pad_id(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0  # any id works: padding is masked out of attention and of the loss


def _to(mb: TrainBatch, device: torch.device) -> TrainBatch:
    return TrainBatch(mb.input_ids.to(device), mb.attention_mask.to(device), mb.loss_mask.to(device),
                      mb.old_logp.to(device), mb.advantages.to(device))


def _weighted_mean(values: list[tuple[float, float]]) -> float:
    weight = math.fsum(w for _, w in values)
    if weight == 0:  # e.g. per-token metrics of a step with no model tokens
        return math.fsum(v for v, _ in values) / len(values)
    return math.fsum(v * w for v, w in values) / weight
