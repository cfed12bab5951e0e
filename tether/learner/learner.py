"""The learner: one trainer step = the policy-gradient updates on one batch of trajectories.

Batch vocabulary (``learner`` section; every unit is *trajectories*):

    batch_size                   trajectories per trainer step (``train_step`` takes any number: the degenerate-group
                                 filter can drop groups and adaptive allocation varies group sizes; the number of
                                 updates is then ceil(n / mini_batch_size): mini-batches of mini_batch_size in
                                 order, the last one the remainder, as verl cuts them)
    mini_batch_size              trajectories per optimizer update → batch_size / mini_batch_size updates per pass
    gradient_accumulation_steps  micro-batches per mini-batch → micro-batch = mini_batch_size / accumulation
    update_frequency             passes (PPO epochs) over the batch per trainer step; 1 = each trajectory is
                                 trained on once. Every pass reuses the behaviour logprobs as old_logp.

One optimizer update: for each micro-batch, forward the policy, take log_softmax(logits / T) of the sampled
tokens (T = ``engine.temperature``, the rollout engine's definition; T = 0, greedy, is scored at T = 1 as the
engine does; ``logits.forward``), and back-propagate ``loss_fn`` (``loss.py``, a pure function of ``LossInputs``)

    loss = agg(policy_loss(logp, prox_logp, A, mask, weights=w)) − entropy_coef · agg(H)
           + kl_coef · agg(KL̂(π_θ ‖ π_ref))
           + teacher.coef · agg(ℓ_distill)   (with a teacher; alone when teacher.rl_loss is false: ``distill.py``)

where the loss, its aggregation and the off-policy correction w come from the ``Objective`` (``objective.py``): with a
correction, π_prox is the policy at the start of the step and w = f(π_prox / π_behav) corrects for the engine's
behaviour policy; without one, prox_logp = the behaviour logprobs. π_prox of the first mini-batch is the detached
logp of its own first forward (the weights have not moved yet: the demo's one update per step needs no extra pass);
the other mini-batches are scored by one forward without grad before the first update. With several passes
(``update_frequency`` > 1) or dropout in the model, every mini-batch is scored first.

Logits are formed only where the loss reads them (``token_logits``): at the positions that predict a model-sampled
token (loss mask 1), through the backbone's hidden states and the LM head. Prompt, tool and user tokens still go
through the layers (they are the context) but never through the [·, V] head, its log-softmax or their backward.
The leading tokens that every row of a micro-batch shares (the system prompt and tool list; a group's whole prompt)
go through the layers once, as a batch of one whose keys and values the rows attend to (``shared_prefix``).

where every ``agg`` divides by the *whole mini-batch's* denominator (``tether.algo.loss_denominator`` summed over
its micro-batches), so micro-batch × accumulation gives the same gradient as one pass over the mini-batch: the
micro-batch losses are back-propagated undivided and the summed gradient is divided once (``accumulate.py``). A
step of one pass can also be fed group by group as the rollout delivers them (``begin_step``, ``add_trajectories``,
``finish_step``; ``tether.pipeline.streaming``): one ``Accumulation``, or ``StreamedUpdates`` applying an update as
each mini-batch fills.
Then clip, and step AdamW unless something was non-finite (``optim.PolicyOptimizer``).

Mini-batches are taken in the order the trajectories were given (no shuffling), so a group stays together
and a run is reproducible. ``objective`` is a plain attribute (``dataclasses.replace(learner.objective,
policy_loss=fn)``: any ``tether.algo.PolicyLossFn`` may replace the loss). ``kl_coef`` is the KL controller's
value: fixed, or steered towards ``kl_control.target_kl`` after every step (``tether.algo.kl_control``); once an
update of a step measures a KL above ``kl_control.max_kl`` the step's remaining updates are skipped
(``optim/kl_guard_stops``).

Metrics of a step (returned and recorded):
    optim/loss             mean over updates of the mini-batch loss (pg − entropy + KL terms)
    optim/grad_norm        mean over *applied* updates of the pre-clip global norm (NaN if all were skipped)
    optim/entropy          mean per-token entropy (nats, at T) over the model tokens of the step
    optim/kl_divergence    mean per-token value of the configured estimator (k1/k2/k3) of KL(π_θ ‖ π_ref) over
                           the model tokens; absent when KL is off
    optim/kl_coef          the coefficient used (0 when KL is off)
    optim/is_ratio_mean    mean π_prox/π_behav over the model tokens (≈ 1 in expectation whatever the gap),
    optim/is_log_ratio_abs mean |log π_prox − log π_behav| over the model tokens (the gap's size), and
    optim/is_masked_fraction  the fraction the correction masked out (only with a correction)
    optim/clip_ratio_low   fraction of model tokens whose clip was active (r < 1 − ε_low, A < 0), and
    optim/clip_ratio_high  (r > 1 + ε_high, A > 0), as ``clipped_surrogate`` counts them
    optim/dual_clip_ratio  fraction whose dual clip was active (r > c, A < 0; 0 when ``clip_ratio_c`` is None)
    optim/lr               the lr of the step's last update
    optim/skipped_steps    updates skipped for a non-finite loss/gradient, cumulative over the run
    optim/kl_guard_stops   steps cut short by the max-KL guard, cumulative over the run
    perf/tokens_per_s      non-pad tokens forwarded and back-propagated (× passes) / wall time of the step
Per-token metrics are averaged over micro-batches weighted by their model-token counts.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import FSDPModule

from tether.algo.kl_control import exceeds_max_kl, kl_controller
from tether.config.policy import PolicyOptimConfig
from tether.config.sections import LearnerConfig
from tether.config.teacher import TeacherConfig
from tether.learner.accumulate import Accumulation, weighted_mean
from tether.learner.batch import TrainBatch
from tether.learner.buckets import cut_buckets
from tether.learner.detach import make_worker
from tether.learner.distill import Distillation
from tether.learner.logits import forward
from tether.learner.objective import Objective
from tether.learner.optim import PolicyOptimizer
from tether.learner.ranks import Ranks, full_tensor
from tether.learner.updates import StreamedUpdates
from tether.metrics import record_metric
from tether.types import Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

# metrics that are a state, not an average
_LAST = {"optim/lr", "optim/kl_coef", "optim/skipped_steps", "optim/kl_guard_stops", "optim/trained_tokens"}


class Learner:
    """The policy (trained), a frozen reference (when KL is on), the optimizer, and ``train_step``.

    ``ref_model``: the KL reference; None = a deep copy of ``model`` as given, or for a peft LoRA model
    (``model.lora``, ``tether.learner.lora.wrap``) no copy: the policy with its adapter off (``reference``); then
    ``lora_scaling`` is alpha / rank and a weight sync sends ``adapter_for_engine``. Unused (dropped) when
    ``kl_control.type`` is "none". ``version`` counts completed trainer steps, skipped updates included.

    ``lc``: the ``learner`` section (batching, off-policy correction); ``po``: ``policy_optimization``;
    ``temperature``: ``engine.temperature``, the sampling one; ``max_response_tokens``: the plan's (Dr. GRPO's
    constant length); ``teacher``: the ``teacher`` section (None or disabled: no distillation); ``worker``:
    ``actor_worker.class``.

    ``compute_dtype`` (``model.dtype``; None = float32): the dtype of the forward and backward. The model's
    parameters are the master weights and AdamW's moments follow them (float32 in a run: ``tether.runtime``
    loads the policy in float32 whatever ``model.dtype`` says); in bfloat16 the policy's and the reference's
    forwards run under ``torch.autocast`` (``logits.forward``; a model sharded by FSDP2 casts its parameters
    itself: ``fsdp.shard_model(param_dtype=...)``), while the log-probabilities, entropy, KL and the loss are
    float32, as verl and TRL do. Not bfloat16 weights: AdamW's updates of lr × ~1 at lr 1e-6..1e-4 are below
    bfloat16's resolution (2^-8 relative) for most weights and would round to nothing.
    """

    def __init__(self, model: PreTrainedModel, ref_model: PreTrainedModel | None, lc: LearnerConfig,
                 po: PolicyOptimConfig, *, temperature: float, max_response_tokens: int,
                 teacher: TeacherConfig | None = None, worker: str = "ActorWorker",
                 compute_dtype: torch.dtype | None = None):
        self.model = model
        self.compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
        # the dtype the forwards autocast to: None when FSDP2's mixed-precision policy casts the parameters itself
        self.autocast = None if sharded(model) else self.compute_dtype
        self.batch_size = lc.batch_size
        self.mini_batch_size = lc.mini_batch_size
        self.gradient_accumulation_steps = lc.gradient_accumulation_steps
        self.epochs = lc.update_frequency
        self.temperature = temperature if temperature > 0 else 1.0
        self.entropy_coef = po.exploration.entropy_coef
        self.objective = Objective.from_config(po, lc.off_policy_correction, max_response_tokens)
        self.distill = Distillation.from_config(teacher) if teacher is not None else None  # the teacher's term
        kc = po.kl_control
        kl_on = kc.type != "none"
        self.kl_estimator = kc.estimator
        self.kl_control = kl_controller(adaptive=kc.adaptive and kl_on, init_coef=kc.init_coef if kl_on else 0.0,
                                        target_kl=kc.target_kl, horizon=kc.horizon)
        self.max_kl = kc.max_kl if kl_on else None
        self.kl_guard_stops = 0
        self.ref_model = None
        # model.lora: the model is a peft model (tether.learner.lora), its base frozen; the KL reference is the same
        # model with the adapter switched off (``reference``), so no copy is made
        self.lora_scaling: float | None = _lora_scaling(model)
        if kl_on and self.lora_scaling is None:
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
            self.ref_model.requires_grad_(False).eval()
        self.kl_on = kl_on
        self.optimizer = PolicyOptimizer.from_config(model.parameters(), po.optimizer)  # those requiring grad only
        self.pad_id = _pad_id(model)
        # π_prox from the first update's own forward (one fewer pass) when that forward is the eval one
        self.prox_from_forward = _no_dropout(model)
        # off_policy_correction.proximal: update_start = π_prox under each update's own starting weights
        self.prox_per_update = lc.off_policy_correction.proximal == "update_start"
        self.version = 0  # trainer steps completed
        self.ranks = Ranks()  # one process; tether.learner.fsdp.sharded_learner sets this rank's place among several
        # actor_worker.class: DetachActorWorker keeps π_prox at the last sync's weights (tether.learner.detach);
        # the initial weights are those the rollout engine starts from
        self.worker = make_worker(worker, model, self.optimizer)
        self.worker.on_sync(self.version)
        # (trainer version, param_version) of the weights the rollout engine holds: the initial ones at first
        self.pushed: tuple[int, int] | None = (0, 0)
        log.info("learner: %s", self.describe())

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module | None]:
        """The KL reference for the block: the frozen copy, the policy with its adapter off (``model.lora``), or None
        when KL is off."""
        if self.lora_scaling is None or not self.kl_on:
            yield self.ref_model
            return
        from tether.learner import lora  # noqa: PLC0415 — peft, with model.lora only

        with lora.reference(self.model) as base:
            yield base

    @property
    def kl_coef(self) -> float:
        return self.kl_control.value

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:  # a checkpoint restores the controller's state
        self.kl_control.value = float(value)

    def on_push(self, param_version: int) -> None:
        """The current weights were pushed to the rollout engine as ``param_version``: DetachActorWorker keeps them
        (π_prox until the next sync), and tokens of that version are the ones whose train–inference mismatch the
        learner can measure (``rollout/logp_abs_diff_mean``, ``rollout/mismatch_kl``) while it holds these weights."""
        self.pushed = (self.version, param_version)
        self.worker.on_sync(self.version)

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
        line = line if e == 1 else f"{line} → {u * e} optimizer updates/step"
        if self.compute_dtype is None:
            return line
        master = next(self.model.parameters()).dtype
        return f"{line}; {_short(self.compute_dtype)} compute, {_short(master)} master weights"

    # ------------------------------------------------------------------------------------------ step

    def skip_step(self) -> None:
        """A trainer step with nothing to train on (every group dropped): counted, no update."""
        self.version += 1
        record_metric("optim/empty_steps", 1, "sum")

    def batch_of(self, trajectories: Sequence[Trajectory], advantages: Sequence[float] | torch.Tensor) -> TrainBatch:
        """The batch tensors of ``trajectories`` (one advantage each), with the teacher's scores where the run
        distils (before any split)."""
        batch = TrainBatch.from_trajectories(trajectories, advantages, pad_id=self.pad_id)
        if self.distill is not None:
            self.distill.attach(batch, trajectories)
        return batch

    def kl_stops(self, kl: float | None) -> bool:
        """The max-KL guard: whether an update that measured ``kl`` (None: not measured) ends its step's updates."""
        return self.max_kl is not None and kl is not None and exceeds_max_kl(kl, self.max_kl)

    def train_step(self, trajectories: Sequence[Trajectory],
                   advantages: Sequence[float] | torch.Tensor) -> dict[str, float]:
        """Train on ``trajectories`` (one advantage each; nominally ``batch_size``); returns and records the metrics."""
        if not trajectories:
            raise ValueError("train_step got no trajectories")
        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        batch = self.batch_of(trajectories, advantages)
        minis = batch.chunks(self.mini_batch_size)  # rows = segments; cut between trajectories, the last the remainder
        # π_prox of the first mini-batch is its own first forward (the weights have not moved yet); only the
        # others, when there are any, need a scoring pass before the first update. With proximal update_start every
        # update's π_prox is its own first forward (or, with dropout, a scoring pass just before it).
        fresh_first = self.objective.needs_prox and self._prox_is_own_forward
        per_update = self.prox_each_update
        if self.objective.needs_prox and not per_update:
            with self.worker.prox_weights(self.version):  # DetachActorWorker: the last sync's weights
                batch.prox_logp = self.score(batch, device, skip=len(minis[0]) if fresh_first else 0)
            minis = batch.chunks(self.mini_batch_size)  # the mini-batches again, now holding π_prox
        acc: dict[str, list[tuple[float, float]]] = defaultdict(list)  # name -> [(value, weight)]
        kl_coef = self.kl_coef
        self.model.train()
        updates = (mini for _ in range(self.epochs) for mini in minis)
        stopped = False
        for k, mini in enumerate(updates):
            own = (fresh_first and k == 0) or (per_update and self.prox_from_forward)
            if per_update and not self.prox_from_forward:
                mini.prox_logp = self.score(mini, device)  # dropout: the update's own weights, scored in eval mode
            kl = self._update(mini, acc, prox_from_forward=own, at_start=k == 0)
            if self.kl_stops(kl):
                stopped = True  # the max-KL guard: skip the step's remaining updates
                break
        return self._finish(acc, kl_coef, stopped, len(trajectories), batch.num_tokens * self.epochs,
                            time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------------ streamed step

    @property
    def streams(self) -> bool:
        """Whether a step can be trained as its groups arrive (``begin_step``): one pass (``update_frequency`` 1)
        whose first forward is π_prox where the objective needs one (``_prox_is_own_forward``). A step of several
        updates (``mini_batch_size`` < ``batch_size``) with such an objective also keeps the step's starting weights
        for the groups that arrive after its first update (``StreamedUpdates``). Every rank is fed the same groups
        (``tether.learner.group``)."""
        if self.prox_each_update:
            return self.epochs == 1 and self.prox_from_forward
        return self.epochs == 1 and (not self.objective.needs_prox or self._prox_is_own_forward)

    @property
    def concurrent_adds(self) -> bool:
        """Whether an update's groups may be added from several threads at once (``Accumulation.add_parts``): on a
        CPU, in one process, not sharded by FSDP2 (its hooks gather and free the parameters around each forward), the
        KL reference a model of its own (not the policy with its adapter switched off, ``model.lora``) and no teacher
        term."""
        on_cpu = next(self.model.parameters()).device.type == "cpu"
        alone = not self.ranks.sharded and not sharded(self.model)
        return on_cpu and alone and self.lora_scaling is None and self.distill is None

    @property
    def prox_each_update(self) -> bool:
        """Whether every update takes its own π_prox (``off_policy_correction.proximal: update_start`` with an
        objective that needs one): no step-start weights are kept and nothing is scored for later updates."""
        return self.objective.needs_prox and self.prox_per_update

    @property
    def _prox_is_own_forward(self) -> bool:
        """Whether an update's first forward is π_prox: one pass (``update_frequency`` 1), no dropout, and the
        current weights are the step's start (not DetachActorWorker, which scores under the last sync's)."""
        return self.prox_from_forward and self.epochs == 1 and self.worker.name == "ActorWorker"

    def begin_step(self) -> Accumulation | StreamedUpdates:
        """A step's updates, to be fed with ``add_trajectories`` (group by group, as the groups arrive) and closed by
        ``finish_step``; the updates ``train_step`` makes (``streams`` says when this may be used): one
        ``Accumulation`` when the step is one update, else ``StreamedUpdates`` (an update applied as each
        mini-batch fills)."""
        if not self.streams:
            raise RuntimeError(f"this learner's step cannot be fed as its data arrives ({self.describe()})")
        if self.mini_batch_size < self.batch_size:
            return StreamedUpdates(self)
        return Accumulation(self, prox_from_forward=self.objective.needs_prox, at_start=True)

    def finish_step(self, update: Accumulation | StreamedUpdates) -> dict[str, float]:
        """Apply the step's (last) update; returns and records the metrics, as ``train_step`` does."""
        if not update.trajectories:
            raise ValueError("finish_step: no trajectories were added")
        t0, kl_coef = time.perf_counter(), self.kl_coef
        if isinstance(update, StreamedUpdates):
            acc, stopped = update.close()
        else:
            acc = defaultdict(list)
            kl = update.apply(acc)
            stopped = self.kl_stops(kl)  # as train_step
        return self._finish(acc, kl_coef, stopped, update.trajectories, update.forwarded_tokens,
                            update.busy_s + time.perf_counter() - t0)

    def _finish(self, acc: dict[str, list[tuple[float, float]]], kl_coef: float, stopped: bool, trajectories: int,
                tokens: int, elapsed: float) -> dict[str, float]:
        """Close a step: version, KL controller, the step's metrics (returned and recorded)."""
        self.kl_guard_stops += stopped
        self.version += 1
        if isinstance(self.ref_model, FSDPModule):  # FSDP2 leaves a root unit gathered after a forward (it expects the
            self.ref_model.reshard()  # backward to follow); the reference has none: back to its shards until needed
        trained = math.fsum(v for v, _ in acc.pop("optim/trained_tokens", []))  # every update and pass of the step
        metrics = {name: weighted_mean(vals) for name, vals in acc.items()}
        metrics["optim/trained_tokens"] = trained
        metrics.setdefault("optim/grad_norm", math.nan)  # every update of the step was skipped
        metrics["optim/kl_coef"] = float(kl_coef)
        metrics["optim/kl_guard_stops"] = float(self.kl_guard_stops)
        metrics["optim/skipped_steps"] = float(self.optimizer.skipped_steps)
        if math.isfinite(metrics.get("optim/kl_divergence", math.nan)):  # β for the next step
            self.kl_control.update(metrics["optim/kl_divergence"], n_steps=trajectories)
        metrics["perf/tokens_per_s"] = tokens / max(elapsed, 1e-9)
        for name, value in metrics.items():
            record_metric(name, value, reduce="last" if name in _LAST else "mean")
        return metrics

    def score(self, batch: TrainBatch, device: torch.device, skip: int = 0) -> torch.Tensor:
        """log π(token t) under the current weights, [B, T] laid out as ``old_logp`` (0 where the mask is 0), for
        rows ``skip:`` (the first ``skip`` rows stay 0: their π_prox comes from their first update's forward)."""
        out = torch.zeros_like(batch.old_logp)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(skip, len(batch), self.micro_batch_size):
                lo, hi = self.ranks.rows(start, min(start + self.micro_batch_size, len(batch)))  # this rank's share
                # a rank with no rows here scores a stand-in row (FSDP needs the same forwards on every rank)
                mb = (batch.slice(lo, hi) if hi > lo else batch.slice(start, start + 1)).to(device)
                sel = mb.loss_mask[:, 1:] > 0  # [b, t-1]
                logp = forward(self.model, mb.input_ids, mb.attention_mask, sel, self.temperature,
                               self.autocast).logp  # [b, t-1]
                out[lo:hi, 1:mb.input_ids.shape[1]] = logp.float().cpu()
        self.model.train(was_training)
        return self.ranks.sum(out)  # every rank's rows (out itself in one process)

    def _update(self, mini: TrainBatch, acc: dict[str, list[tuple[float, float]]],
                prox_from_forward: bool = False, at_start: bool = False) -> float | None:
        """One optimizer update on a mini-batch, accumulated over its micro-batches; returns the KL to the
        reference that it measured, None when KL is off or the update was skipped. ``prox_from_forward``: the
        weights are those of the step's start, so π_prox is this forward's own logp (detached); ``at_start``: the
        step's first update (its forward runs on the step's starting weights)."""
        update = Accumulation(self, prox_from_forward=prox_from_forward, at_start=at_start)
        update.add(mini)
        return update.apply(acc)

    # ------------------------------------------------------------------------------------------ weights

    def state_dict_for_engine(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A detached copy of the policy's weights (a copy, so further training does not change what was pushed);
        ``dtype``: the engine's (``model.dtype``), the floating tensors cast in the copy (None: the master weights').
        With ``model.lora``: the base's weights with the adapter merged in, under the base's names (what an engine
        that takes whole weights needs; ``adapter_for_engine`` is the adapter alone)."""
        if self.lora_scaling is not None:
            from tether.learner import lora  # noqa: PLC0415 — peft, with model.lora only

            return lora.merged_state_dict(self.model, dtype)
        return {k: engine_copy(full_tensor(v), dtype) for k, v in self.model.state_dict().items()}  # gathers shards

    def adapter_for_engine(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``model.lora``: copies of the adapter's A [r, in] and B [out, r] keyed ``<layer>.lora_A`` / ``.lora_B`` by
        the base's layer names (``tether.learner.lora.adapter_for_engine``); with ``lora_scaling`` the engine forms
        W_base + s · B @ A. Megabytes where the whole weights are gigabytes."""
        if self.lora_scaling is None:
            raise ValueError("adapter_for_engine: this learner trains full weights (model.lora is not set)")
        from tether.learner import lora  # noqa: PLC0415 — as above

        return lora.adapter_for_engine(self.model, dtype)

    def weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """``state_dict_for_engine`` in buckets of at most ``bucket_bytes`` bytes of master weights
        (``tether.learner.buckets``), each gathered and copied when it is asked for: a consumer that sends and drops
        each bucket never holds more than one beside the model."""
        if self.lora_scaling is not None:  # merged: computed whole, then cut
            merged = self.state_dict_for_engine(dtype)
            for names in cut_buckets(merged, bucket_bytes):
                yield {k: merged[k] for k in names}
            return
        state = self.model.state_dict()
        for names in cut_buckets(state, bucket_bytes):
            yield {k: engine_copy(full_tensor(state[k]), dtype) for k in names}


def engine_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A detached copy of a weight for the engine, in ``dtype`` when it is a floating one (one copy: cast, not cloned
    then cast)."""
    if dtype is None or not tensor.is_floating_point():
        return tensor.detach().clone()
    return tensor.detach().to(dtype, copy=True)


def sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``tether.learner.fsdp.shard_model``); a peft LoRA model when its base
    model is (the base is what is sharded: ``fsdp.sharded_learner``)."""
    base: Any = getattr(model, "get_base_model", lambda: model)()
    return isinstance(base, FSDPModule)


def _lora_scaling(model: torch.nn.Module) -> float | None:
    """alpha / rank of a peft LoRA model (``tether.learner.lora.wrap``), None for a plain one."""
    if not hasattr(model, "peft_config"):
        return None
    from tether.learner import lora  # noqa: PLC0415 — as above

    return lora.scaling(model)


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def _no_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward computes what an eval-mode one does (no dropout anywhere)."""
    config = getattr(model, "config", None)
    if any(float(getattr(config, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "hidden_dropout", "dropout")):
        return False
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def _pad_id(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0  # any id works: padding is masked out of attention and of the loss
