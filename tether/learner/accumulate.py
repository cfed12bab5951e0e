"""One optimizer update, its gradient summed micro-batch by micro-batch as the data arrives: ``Accumulation``.

Every aggregation mode divides a sum over tokens (or sequences) by a denominator of the whole mini-batch
(``tether.algo.aggregation``). The micro-batch losses are back-propagated *undivided* (denominator 1) and the
summed gradient is divided once, before clipping, by the denominator of everything that was added:

    ∇ (Σ_micro Σ_tok ℓ) / D  =  ∇ Σ_micro (Σ_tok ℓ / D)

so the update is the one-pass update over the mini-batch (to float rounding), and D need not be known before the
last micro-batch. That is what lets the trainer start on a step's first groups while the rollout still generates the
others (``tether.pipeline.streaming``): the learner's forward and backward overlap generation instead of following
it. A micro-batch holds at most ``micro_batch_size`` trajectories; the trajectories of one ``add`` are split into
near-equal micro-batches, so a group added on its own is one micro-batch (its episodes share their whole first
prompt, which ``token_logits`` then runs once).

A micro-batch goes model → ``LossInputs`` (``inputs``: the policy's forward, π_prox, the entropy, the reference's
log-probabilities, the teacher's tensors) → ``loss_fn`` (``loss.py``, a pure function of tensors) → backward.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tether.algo import loss_denominator, mismatch_metrics
from tether.learner.batch import TrainBatch
from tether.learner.logits import forward
from tether.learner.loss import LossInputs, loss_fn
from tether.threads import torch_threads
from tether.types import Trajectory

if TYPE_CHECKING:
    from tether.learner.learner import Learner

Pairs = dict[str, list[tuple[float, float]]]  # metric -> [(value, weight)]
Part = tuple[Sequence[Trajectory], torch.Tensor]  # trajectories and their advantages [n]


class Accumulation:
    """The gradient of one optimizer update, built from any number of ``add`` calls; ``apply`` steps once.

    ``prox_from_forward``: the weights are those of the step's start, so π_prox is each micro-batch's own forward
    (detached). ``at_start``: the forwards run on the step's starting weights (its first update), so where those are
    the weights last pushed to the engine they measure the train–inference mismatch. ``add`` calls may overlap
    where ``Learner.concurrent_adds`` allows (``add_parts``: each thread forwards and back-propagates its own
    micro-batches, autograd sums their gradients under its per-parameter lock, what is kept here is merged under a
    lock); ``apply`` follows them all. Metrics are kept here and recorded by the learner.
    """

    def __init__(self, learner: Learner, *, prox_from_forward: bool, at_start: bool = False):
        self.learner, self.prox_from_forward = learner, prox_from_forward
        pushed = learner.pushed
        # the param version whose weights this update's forwards run on (None: weights the engine never had)
        self.engine_version = pushed[1] if at_start and pushed is not None and pushed[0] == learner.version else None
        self.device = next(learner.model.parameters()).device
        self.denom = torch.zeros((), device=self.device)  # Σ loss_denominator of every micro-batch added
        self.loss = torch.zeros((), device=self.device)  # Σ undivided micro-batch losses
        self.tokens: Pairs = defaultdict(list)  # per-token metrics, weighted by model tokens
        self.trajectories = self.forwarded_tokens = 0
        self.busy_s = 0.0  # wall time spent in add (add_parts: its own wall time, not its threads' sum)
        self._merge = threading.Lock()  # what concurrent adds keep here
        self.trained_tokens = 0.0  # model tokens this rank back-propagated (its shares; a weight-0 stand-in adds none)
        learner.optimizer.zero_grad()
        learner.model.train()

    def add_trajectories(self, trajectories: Sequence[Trajectory], advantages: Sequence[float] | torch.Tensor) -> None:
        """Forward and back-propagate ``trajectories`` (one advantage each) now."""
        self.add(self.learner.batch_of(trajectories, advantages))

    def add(self, batch: TrainBatch) -> None:
        """Forward and back-propagate ``batch`` now, in micro-batches of at most ``micro_batch_size`` trajectories."""
        t0 = time.perf_counter()
        learner = self.learner
        n = batch.num_trajectories
        for mb in batch.split(-(-n // learner.micro_batch_size)):
            mb = mb.to(self.device)
            denom = loss_denominator(mb.loss_mask[:, 1:], learner.objective.agg_mode)  # the whole micro-batch's
            mine, weight = learner.ranks.share(mb)  # this rank's trajectories of it (all of them in one process)
            inputs = self.inputs(mine)
            out = loss_fn(inputs, learner.objective, entropy_coef=learner.entropy_coef,
                          kl_coef=learner.kl_coef, kl_estimator=learner.kl_estimator, distill=learner.distill)
            if out.loss.requires_grad:  # a micro-batch without one model token has a constant loss: no gradient
                (out.loss if weight == 1.0 else out.loss * weight).backward()
            n_tok = float(mine.loss_mask.sum()) * weight
            pairs = [(name, (float(value), n_tok)) for name, value in out.metrics.items()]
            pairs += self._mismatch(mine, weight, inputs.logp.detach())
            with self._merge:
                self.denom += denom
                self.loss += out.loss.detach() * weight
                self.trained_tokens += n_tok
                for name, pair in pairs:
                    self.tokens[name].append(pair)
        with self._merge:
            self.trajectories += n
            self.forwarded_tokens += batch.num_tokens
            self.busy_s += time.perf_counter() - t0

    def add_parts(self, parts: Sequence[Part], workers: int, threads: int) -> None:
        """``add_trajectories`` of each part; with ``workers`` > 1 (where ``Learner.concurrent_adds``) that many
        at once, each thread on ``threads`` torch threads. On a CPU two threads that each forward and back-propagate
        their own group beat one OpenMP team of two on small work items (``tether.pipeline.streaming``)."""
        if workers <= 1 or len(parts) < 2 or not self.learner.concurrent_adds:
            for trajectories, advantages in parts:
                self.add_trajectories(trajectories, advantages)
            return

        todo, lock = list(parts), threading.Lock()
        errors: list[BaseException] = []  # the first one stops every thread after its current part
        caller, busy, t0 = torch.get_num_threads(), self.busy_s, time.perf_counter()

        def drain() -> None:
            while not errors:
                with lock:
                    if not todo:
                        return
                    part = todo.pop(0)
                self.add_trajectories(*part)

        def guarded() -> None:
            try:
                drain()
            except BaseException as e:  # noqa: BLE001 — raised below, in the caller's thread
                errors.append(e)

        def helper() -> None:
            torch.set_num_threads(threads)  # this thread's OpenMP team (and the default of threads started later)
            try:
                guarded()
            finally:
                torch.set_num_threads(caller)

        helpers = [threading.Thread(target=helper, name="tether-learner", daemon=True)
                   for _ in range(min(workers, len(parts)) - 1)]
        for t in helpers:
            t.start()
        try:
            with torch_threads(threads):  # the caller adds parts too
                guarded()
        finally:
            for t in helpers:
                t.join()
            self.busy_s = busy + time.perf_counter() - t0  # (perf/tokens_per_s divides by it)
        if errors:
            raise errors[0]

    def _mismatch(self, mb: TrainBatch, weight: float, train_logp: torch.Tensor
                  ) -> list[tuple[str, tuple[float, float]]]:
        """The train–inference mismatch on ``mb``'s tokens that the engine sampled with the weights the learner
        scored them under (``tether.algo.mismatch_metrics``), as token-weighted (metric, pair)s: π_prox where it was
        scored under the pushed weights (DetachActorWorker's, or the step's start while it still equals them), else
        this forward's own logp at the step's start (``train_logp`` [b, T-1], detached). Every rank adds the same
        names (a share with no such token weighs 0), so ranks merge alike."""
        learner = self.learner
        if mb.versions is None:
            return []
        scored_at_sync = (mb.prox_logp is not None and not self.prox_from_forward
                          and learner.worker.name != "ActorWorker")  # DetachActorWorker: the pushed weights
        version = learner.pushed[1] if scored_at_sync and learner.pushed is not None else self.engine_version
        if version is None:
            return []
        mask = mb.loss_mask[:, 1:] * (mb.versions[:, 1:] == version)  # [b, T-1]
        train = mb.prox_logp[:, 1:] if scored_at_sync and mb.prox_logp is not None else train_logp
        m = mismatch_metrics(train, mb.old_logp[:, 1:], mask)
        n = float(m["mismatch_tokens"]) * weight
        return [(f"rollout/{name}", (float(m[name]), n)) for name in ("logp_abs_diff_mean", "mismatch_kl")]

    def inputs(self, mb: TrainBatch) -> LossInputs:
        """The micro-batch's ``LossInputs``: the policy's forward at the loss positions (with grad), π_prox (this
        forward's own, detached, when ``prox_from_forward``; else the scored one, or None = π_behav), the entropy, and
        the reference's and the teacher's log-probabilities where those terms are on."""
        learner = self.learner
        sel = mb.loss_mask[:, 1:] > 0  # [b, T-1] the positions the loss reads; logits are computed there only
        policy = forward(learner.model, mb.input_ids, mb.attention_mask, sel, learner.temperature,
                         learner.autocast)  # logp [b, T-1] float32 whatever the compute dtype
        prox_logp: torch.Tensor | None
        if self.prox_from_forward:
            prox_logp = policy.logp.detach()  # [b, T-1] π_prox = the step's starting weights, this very forward
        else:
            prox_logp = mb.prox_logp[:, 1:] if mb.prox_logp is not None else None  # [b, T-1]
        distill = learner.distill.inputs(policy, mb) if learner.distill is not None else None
        with torch.set_grad_enabled(learner.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = policy.entropy()  # [b, T-1]
        ref_logp = None
        with learner.reference() as ref, torch.no_grad():  # model.lora: the policy with its adapter off
            if ref is not None:
                ref_logp = forward(ref, mb.input_ids, mb.attention_mask, sel, learner.temperature,
                                   learner.autocast).logp  # the reference computes as the policy does
        return LossInputs(logp=policy.logp, prox_logp=prox_logp, behav_logp=mb.old_logp[:, 1:],
                          advantages=mb.advantages, mask=mb.loss_mask[:, 1:], entropy=entropy, ref_logp=ref_logp,
                          distill=distill)

    def apply(self, acc: Pairs) -> float | None:
        """Divide the summed gradient by the denominator, clip and step (or skip when non-finite); add the metrics
        to ``acc``. Returns the KL to the reference the update measured (None when KL is off or it was skipped)."""
        learner = self.learner
        # every rank added the whole micro-batches (each back-propagated its share), so the denominator is global
        denom = self.denom.clamp_min(1.0)  # as aggregate clamps: all masked → loss 0, not NaN
        for p in learner.optimizer.params:
            if p.grad is not None:
                p.grad.div_(denom.to(p.grad.device))
        tokens = learner.ranks.merge(self.tokens)  # over the ranks: every rank sees the same metrics, KL and loss
        for name, values in tokens.items():
            if name.startswith("rollout/") and not math.fsum(w for _, w in values):
                continue  # the mismatch: no token of the pushed version in this update
            acc[name].extend(values)
        total = learner.ranks.sum(self.loss) / denom
        trained = learner.ranks.sum(torch.tensor(self.trained_tokens, dtype=torch.float64))  # every rank's shares
        acc["optim/trained_tokens"].append((float(trained), 1.0))  # summed over the step's updates (Learner._finish)
        result = learner.optimizer.update(loss_is_finite=bool(torch.isfinite(total)))
        acc["optim/loss"].append((float(total), 1.0))
        acc["optim/lr"] = [(result.lr, 1.0)]
        if result.applied:  # the mean grad norm is over applied updates; a skipped one shows in skipped_steps
            acc["optim/grad_norm"].append((result.grad_norm, 1.0))
        kl = tokens.get("optim/kl_divergence", [])
        return weighted_mean(kl) if kl and result.applied else None  # a skipped update moved nothing


def weighted_mean(values: list[tuple[float, float]]) -> float:
    weight = math.fsum(w for _, w in values)
    if weight == 0:  # e.g. per-token metrics of a step with no model tokens
        return math.fsum(v for v, _ in values) / len(values)
    return math.fsum(v * w for v, w in values) / weight
