"""N trainer ranks behind one learner: ``LearnerGroup`` on rank 0, where the pipeline uses a ``Learner``, and
``follow`` on ranks 1..N-1.

    # rank 0: the pipeline's process                      # ranks 1..N-1 (tether.learner.spawn, torchrun, actors)
    group = LearnerGroup(sharded_learner(model, ranks, …))   follow(sharded_learner(model, ranks, …))
    group.train_step(trajectories, advantages)               # runs what rank 0 sends until close
    group.worker.on_sync(group.version)
    weights = group.state_dict_for_engine()
    group.close()

FSDP2 needs every rank to run the same forwards, backwards and collectives in the same order, and the pipeline talks
to one learner. So every call that touches the model is a command: rank 0 broadcasts ``(name, args)``
(``broadcast_object_list`` on a gloo group of its own; the trajectories as plain data, the fields the learner reads),
every rank (rank 0 too) runs the same ``_Commands`` method on its own Learner, and a barrier ends the command: one
code path on every rank, so the collectives line up by construction. What only reads state (``describe``,
``streams``, ``version``, ``kl_coef``) is not sent: every rank ran the same commands, so rank 0's is every rank's.

The surface: every ``Learner`` member that ``tether/pipeline`` and ``learner/checkpoint.py`` use — ``train_step``,
``skip_step``, ``streams`` / ``begin_step`` → ``add_trajectories`` → ``finish_step`` (``pipeline/streaming.py``'s
group-by-group update), ``state_dict_for_engine`` / ``weight_buckets`` (a gather per bucket), ``worker.on_sync``,
``describe``, ``version``, ``kl_coef``, ``kl_guard_stops``, ``model``, and with ``model.lora`` ``lora_scaling`` /
``adapter_for_engine`` (A and B alone gathered, rank 0 pushes them: ``WeightSync.push``; the merged weights for the
whole-weights paths); and for the functions the pipeline calls on
``learner.model`` that gather shards, the group's own: ``save_checkpoint`` / ``load_checkpoint``
(``learner/checkpoint.py``'s) and ``unsharded_model``.

What a rank trains. Every rank holds the whole batch and trains its share of every micro-batch
(``tether.learner.ranks``), its loss over the whole micro-batch's denominator, the gradients summed by FSDP: N ranks
train what one trains. Per micro-batch, not per step: a step-level split would give ranks different numbers of
forwards (FSDP needs the same) and no rank the global loss denominator. By default the shares are balanced by padded
tokens (``ranks.balanced_parts``: the trajectories sorted by length, cut into runs of near-equal rows × longest row)
rather than consecutive near-equal counts (``balanced=False``): FSDP makes every rank wait for the slowest at each
layer and a share pads to its longest row, so a micro-batch costs its largest share's padded tokens. Measured on 45
groups of the demo (8 steps of its config, tiny-sft model): never more (0 of 201 micro-batch × rank-count cases) but
little less there — 0 % streamed (a group's 8 rows differ by < 20 %: the ~320-token prompt dominates, equal counts
already pad equally), 0.3–0.8 % at 2, 4, 8 ranks in ``train_step``'s micro-batches of 16, against 4.5–10 % above an
even split of the real tokens; 2.7 % on the test's trajectories of 1–4 turns (``perf/rank_imbalance`` 1.070 →
1.041). Kept for lengths that spread more than the demo's; π_prox scoring (``Learner.score``) shares consecutive rows.

Metrics. The learner's are equal on every rank already (per-token metrics all-reduced, the loss summed, the global
grad norm, ``optim/trained_tokens`` summed over the ranks' shares); the group adds one, recorded on rank 0 only
(``follow`` runs with no recorder):
    perf/rank_imbalance    Σ over micro-batches of the largest share's padded tokens / the mean share's (1 = even)

Errors. A command that raises on rank r > 0 writes its traceback to the process group's store and leaves the group:
rank 0's pending collective fails at once ("connection closed by peer") and rank 0 raises one ``RankError`` naming r,
with r's traceback. A rank that stops answering leaves rank 0 waiting at most the process group's timeout
(``spawn_ranks(timeout_s=…)``), then the same error. After an error every call raises it again. Rank 0's own errors
are raised as they are. Between commands ranks 1..N-1 wait with a long timeout (rank 0 rolls out and evaluates in
between); when rank 0's process ends, the connection closes and they stop.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tether.learner import fsdp
from tether.learner.buckets import cut_buckets
from tether.learner.checkpoint import load_checkpoint, save_checkpoint, save_sharded_checkpoint, temp_dir
from tether.learner.learner import Learner, engine_copy
from tether.learner.ranks import Ranks, TalliedRanks, full_tensor
from tether.learner.spawn import DEFAULT_TIMEOUT_S, Spawned
from tether.metrics import record_metric, set_recorder
from tether.types import Trajectory

IDLE_WAIT_S = 24 * 3600.0  # ranks 1..N-1 wait this long for rank 0's next command
REPORT_WAIT_S = 5.0  # after a failed collective, how long rank 0 waits for the failed rank's report to arrive
_SERIAL = itertools.count()  # groups made by this process; every rank makes them in the same order


class RankError(RuntimeError):
    """A learner command failed on other trainer ranks than this one. ``reports``: rank → its traceback (or what is
    known of its end)."""

    def __init__(self, command: str, reports: dict[int, str]):
        self.command, self.reports = command, reports
        first = {r: text.strip().splitlines()[-1] if text.strip() else "no report" for r, text in reports.items()}
        ranks = ", ".join(str(r) for r in sorted(reports))
        head = f"trainer rank{'s' * (len(reports) > 1)} {ranks} failed in {command}: " + "; ".join(
            f"rank {r}: {line}" for r, line in sorted(first.items()))
        super().__init__(head)  # one line for the terminal; each rank's traceback goes with the error's own
        self.add_note("".join(f"--- trainer rank {r} ---\n{text.rstrip()}\n" for r, text in sorted(reports.items())))


class _Commands:
    """What each command does on one rank, rank 0 and the others alike (their results are used on rank 0 only)."""

    NAMES = frozenset({"hello", "train_step", "skip_step", "begin_step", "add_trajectories", "finish_step",
                       "gather", "merged", "adapter", "on_sync", "on_push", "save_checkpoint", "load_checkpoint",
                       "unsharded_model"})

    def __init__(self, learner: Learner):
        ranks = learner.ranks
        self.learner, self.lead = learner, ranks.rank == 0
        learner.ranks = self.ranks = TalliedRanks(ranks.rank, ranks.world)
        self.update: Any = None  # the streamed step's Accumulation

    def hello(self, described: str, balanced: bool) -> None:
        """Check this rank built the learner rank 0 did; take rank 0's way of sharing a micro-batch."""
        mine = self.learner.describe()
        if mine != described:
            raise ValueError(f"rank {self.ranks.rank} built another learner than rank 0: {mine!r} vs {described!r}")
        self.learner.ranks = self.ranks = TalliedRanks(self.ranks.rank, self.ranks.world, balanced=balanced)

    def train_step(self, trajectories: Sequence[Trajectory], advantages: Any) -> dict[str, float]:
        return self._reduced(self.learner.train_step(trajectories, advantages))

    def skip_step(self) -> None:
        self.learner.skip_step()

    def begin_step(self) -> None:
        self.update = self.learner.begin_step()

    def add_trajectories(self, trajectories: Sequence[Trajectory], advantages: Any) -> None:
        if self.update is None:
            raise RuntimeError("add_trajectories before begin_step")
        self.update.add_trajectories(trajectories, advantages)

    def finish_step(self) -> dict[str, float]:
        if self.update is None:
            raise RuntimeError("finish_step before begin_step")
        update, self.update = self.update, None
        return self._reduced(self.learner.finish_step(update))

    def gather(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The whole tensors ``names`` of the model's state dict, copied (in ``dtype``: ``engine_copy``), on rank 0;
        the other ranks take part in each gather and keep nothing."""
        state, out = self.learner.model.state_dict(), {}
        for name in names:
            whole = full_tensor(state[name])
            if self.lead:
                out[name] = engine_copy(whole, dtype)
        return out

    def merged(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``model.lora``: the base's whole weights with the adapter merged in (``Learner.state_dict_for_engine``), on
        rank 0; every rank gathers alike."""
        out = self.learner.state_dict_for_engine(dtype)
        return out if self.lead else {}

    def adapter(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``model.lora``: the adapter's whole A and B (``Learner.adapter_for_engine``), on rank 0; the base is not
        gathered."""
        out = self.learner.adapter_for_engine(dtype)
        return out if self.lead else {}

    def on_sync(self, version: int) -> None:
        self.learner.worker.on_sync(version)  # DetachActorWorker: each rank keeps its own shards

    def on_push(self, param_version: int) -> None:
        self.learner.on_push(param_version)  # and DetachActorWorker's on_sync, each rank its own shards

    def save_checkpoint(self, path: str, tmp: str, tokenizer: Any = None,
                        extra: dict[str, Any] | None = None) -> Path | None:
        """Every rank writes its shards into ``tmp``, rank 0 the rest (its ``tokenizer`` and ``extra`` are not
        sent); in a group of one, ``save_checkpoint`` as a plain learner saves."""
        if not self.ranks.sharded:
            return save_checkpoint(path, self.learner, tokenizer, extra)
        return save_sharded_checkpoint(path, tmp, self.learner, tokenizer, extra)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return load_checkpoint(path, self.learner)  # every rank reads the files and keeps its shards

    def unsharded_model(self) -> Any:
        if self.learner.lora_scaling is not None:  # model.lora: the adapter merged in (gathered on every rank)
            from tether.learner import lora  # noqa: PLC0415 — peft, with model.lora only

            if self.lead:
                return lora.merged_copy(self.learner.model)
            lora.merged_state_dict(self.learner.model)  # merged_copy's only collectives
            return None
        if self.lead:
            return fsdp.unsharded(self.learner.model)
        fsdp.full_state_dict(self.learner.model)  # unsharded's only collective
        return None

    def _reduced(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics plus the group's ``perf/rank_imbalance``, recorded (on rank 0: the others have no
        recorder)."""
        slowest, mean = self.ranks.tally.take()
        imbalance = slowest / mean if mean else 1.0
        record_metric("perf/rank_imbalance", imbalance, "last")
        return {**metrics, "perf/rank_imbalance": imbalance}


class _Channel:
    """Rank 0 → the others: one command at a time on a gloo group of its own, a barrier after each, and the error
    reports in the default process group's store."""

    def __init__(self, ranks: Ranks, timeout_s: float):
        self.ranks, self.timeout = ranks, timedelta(seconds=timeout_s)
        self.group: Any = None
        self.store: Any = None
        if ranks.sharded:
            if not dist.is_initialized() or dist.get_world_size() != ranks.world:
                raise RuntimeError(f"a learner group of {ranks.world} ranks needs a process group of {ranks.world} "
                                   "(spawn_ranks, init_ranks under torchrun)")
            serial = next(_SERIAL)
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_WAIT_S))
            default_store = dist.distributed_c10d._get_default_store()
            self.store = dist.PrefixStore(f"tether/learner_group/{serial}/", default_store)

    def send(self, command: tuple[str, tuple]) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> tuple[str, tuple]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Every rank has finished the command; names the ranks that did not arrive within the timeout."""
        dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)

    def report(self, command: str, error: BaseException) -> None:
        text = f"in {command}:\n" + "".join(traceback.format_exception(error))
        try:
            self.store.set(f"error/{self.ranks.rank}", text[-20_000:])
        except Exception:  # noqa: BLE001 — rank 0 (the store's host) is gone: nobody left to tell
            pass

    def reports(self, wait_s: float, ended: Callable[[], dict[int, int]]) -> dict[int, str]:
        """The other ranks' error reports, waiting up to ``wait_s`` for a first one (not once every other rank has
        ended: a rank writes its report before it exits); ``ended()``: the ranks known to have exited (rank → exit
        code), named even without a report."""
        deadline = time.monotonic() + wait_s
        while True:
            found = {r: self.store.get(f"error/{r}").decode() for r in range(1, self.ranks.world)
                     if self.store.check([f"error/{r}"])}
            gone = ended()
            if found or time.monotonic() >= deadline or len(gone) == self.ranks.world - 1:
                break
            time.sleep(0.05)
        for r, code in gone.items():
            if code != 0 and r not in found:
                found[r] = f"exited with code {code} without a report (killed, or out of memory?)"
        return found


class StreamedStep:
    """``LearnerGroup.begin_step``'s update: ``add_trajectories`` on every rank; ``finish_step`` closes it."""

    def __init__(self, group: LearnerGroup):
        self.group = group

    def add_trajectories(self, trajectories: Sequence[Trajectory], advantages: Sequence[float] | torch.Tensor) -> None:
        self.group._call("add_trajectories", self.group._plain(trajectories), advantages)

    @property
    def trajectories(self) -> int:
        update = self.group._local.update
        return update.trajectories if update is not None else 0


class _Worker:
    """``LearnerGroup.worker``: ``on_sync`` on every rank (``DetachActorWorker`` keeps each rank's shards)."""

    def __init__(self, group: LearnerGroup):
        self.group = group
        self.name = group.learner.worker.name

    def on_sync(self, version: int) -> None:
        self.group._call("on_sync", version)


class LearnerGroup:
    """The trainer's ranks as one learner, on rank 0 (see the module docstring). ``learner``: rank 0's (sharded over
    its ``ranks``; a plain learner makes a group of one, with nothing to send); ``balanced``: each micro-batch shared
    by padded tokens (``ranks.balanced_parts``), False: in consecutive near-equal counts (``Ranks.share``);
    ``timeout_s``: the barrier's after each command (the process group's own timeout bounds its collectives);
    ``spawned``: the ranks ``spawn_ranks`` started, whose exit codes name a rank that died without a report."""

    def __init__(self, learner: Learner, *, balanced: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                 spawned: Spawned | None = None):
        if learner.ranks.rank != 0:
            raise ValueError(f"LearnerGroup runs on rank 0; rank {learner.ranks.rank} calls follow(learner)")
        self.learner, self.spawned = learner, spawned
        self._channel = _Channel(learner.ranks, timeout_s)
        self._local = _Commands(learner)
        self._lock = threading.Lock()  # one command at a time (the streamed update's worker thread, the trainer's)
        self._error: BaseException | None = None
        self._closed = False
        self.worker = _Worker(self)
        self._call("hello", learner.describe(), balanced)

    # -- what reads rank 0's state (the same on every rank) --------------------------------------------------
    @property
    def ranks(self) -> TalliedRanks:
        return self._local.ranks

    @property
    def model(self) -> Any:
        """Rank 0's model (its shards when sharded: gathering them is a collective, ``unsharded_model``)."""
        return self.learner.model

    @property
    def version(self) -> int:
        return self.learner.version

    @property
    def kl_coef(self) -> float:
        return self.learner.kl_coef

    @property
    def kl_guard_stops(self) -> int:
        return self.learner.kl_guard_stops

    def describe(self) -> str:
        line = self.learner.describe()
        return line if not self.ranks.sharded else f"{line}, on {self.ranks.world} trainer ranks"

    @property
    def streams(self) -> bool:
        return self.learner.streams

    @property
    def lora_scaling(self) -> float | None:
        """``model.lora``'s alpha / rank (None: full weights): a weight sync sends ``adapter_for_engine``."""
        return self.learner.lora_scaling

    # -- commands ----------------------------------------------------------------------------------------
    def train_step(self, trajectories: Sequence[Trajectory],
                   advantages: Sequence[float] | torch.Tensor) -> dict[str, float]:
        return self._call("train_step", self._plain(trajectories), advantages)

    def skip_step(self) -> None:
        self._call("skip_step")

    def begin_step(self) -> StreamedStep:
        if not self.streams:
            raise RuntimeError(f"this learner's step cannot be fed as its data arrives ({self.describe()})")
        self._call("begin_step")
        return StreamedStep(self)

    def finish_step(self, update: StreamedStep) -> dict[str, float]:
        if update.group is not self:
            raise ValueError("finish_step: that update belongs to another learner group")
        if not update.trajectories:
            raise ValueError("finish_step: no trajectories were added")
        return self._call("finish_step")

    def on_push(self, param_version: int) -> None:
        """Every rank's ``Learner.on_push``: the weights are the engine's ``param_version``."""
        self._call("on_push", param_version)

    def state_dict_for_engine(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0 (``Learner.state_dict_for_engine``; ``model.lora``: merged), in one command."""
        if self.lora_scaling is not None:
            return self._call("merged", dtype)
        return self._call("gather", list(self.learner.model.state_dict()), dtype)

    def adapter_for_engine(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``model.lora``: the adapter's A and B on rank 0 (``Learner.adapter_for_engine``), gathered in one command:
        what a weight sync sends (``WeightSync.push``, rank 0 to the engine)."""
        if self.lora_scaling is None:
            raise ValueError("adapter_for_engine: this learner trains full weights (model.lora is not set)")
        return self._call("adapter", dtype)

    def weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """``Learner.weight_buckets``: one command per bucket, so rank 0 holds one gathered bucket beside its shards
        while a consumer sends and drops each (``RolloutHandle.update_weights_from_buckets``). ``model.lora``: the
        merged weights, computed whole in one command, then cut."""
        if self.lora_scaling is not None:
            merged = self.state_dict_for_engine(dtype)
            for names in cut_buckets(merged, bucket_bytes):
                yield {k: merged[k] for k in names}
            return
        for names in cut_buckets(self.learner.model.state_dict(), bucket_bytes):
            yield self._call("gather", names, dtype)

    def save_checkpoint(self, path: str | Path, tokenizer: Any, extra: dict[str, Any] | None = None) -> Path:
        """A checkpoint of the group: ``tether.learner.checkpoint.save_sharded_checkpoint`` on every rank (the shards
        of the weights and AdamW state, and rank 0 the consolidated weights and trainer state)."""
        return self._call("save_checkpoint", str(path), str(temp_dir(path)),
                          lead=dict(tokenizer=tokenizer, extra=extra))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """``tether.learner.checkpoint.load_checkpoint`` on every rank; returns the checkpoint's ``extra``."""
        return self._call("load_checkpoint", str(path))

    def unsharded_model(self) -> Any:
        """``fsdp.unsharded(model)``: the whole weights in a plain model, on rank 0."""
        return self._call("unsharded_model")

    def close(self) -> None:
        """Tell ranks 1..N-1 to return from ``follow`` (not after an error: they have left)."""
        with self._lock:
            if not self._closed and self._error is None and self.ranks.sharded:
                self._channel.send(("stop", ()))
            self._closed = True

    def __enter__(self) -> LearnerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, name: str, *args: Any, lead: dict[str, Any] | None = None) -> Any:
        """Run command ``name`` on every rank: ``args`` sent to all, ``lead`` (keyword arguments) to rank 0's only."""
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"the learner group stopped at an earlier error: {self._error}") from self._error
            if self._closed:
                raise RuntimeError("the learner group is closed")
            try:
                if self.ranks.sharded:
                    self._channel.send((name, args))
                result = getattr(self._local, name)(*args, **(lead or {}))
                if self.ranks.sharded:
                    self._channel.barrier()
                return result
            except BaseException as e:  # the other ranks may be inside the command: no later command can line up
                error = self._failure(name, e) if isinstance(e, Exception) else e
                self._error = error
                if error is e:
                    raise
                raise error from e

    def _plain(self, trajectories: Sequence[Trajectory]) -> Sequence[Trajectory]:
        """The trajectories as the learner reads them, to send: the readable conversation and a pending judge left
        behind (as they are in a group of one: nothing is sent)."""
        if not self.ranks.sharded:
            return trajectories
        return [dataclasses.replace(t, messages=[], pending_judge=None) for t in trajectories]

    def _failure(self, name: str, error: Exception) -> Exception:
        """A ``RankError`` when other ranks reported (or ended), else ``error`` (rank 0's own)."""
        if not self.ranks.sharded:
            return error
        spawned = self.spawned
        ended = spawned.exitcodes if spawned is not None else dict  # () → rank: exit code, read when asked
        collective = bool(ended()) or isinstance(error, dist.DistError) or any(word in str(error) for word in (
            "gloo", "NCCL", "Connection closed", "Connection reset", "peer", "Timed out", "monitoredBarrier"))
        # a rank that ended, or a failed collective: its report, or its exit, may be on its way
        reports = self._channel.reports(REPORT_WAIT_S if collective else 0.0, ended)
        if not reports and collective:  # no rank said anything: name them all, with what the collective said
            reports = {r: f"no report; rank 0's collective failed: {str(error).splitlines()[0]}"
                       for r in range(1, self.ranks.world)}
        return RankError(name, reports) if reports else error


def follow(learner: Learner, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Run rank 0's commands on this rank's ``learner`` (sharded over its ``ranks``, rank > 0) until rank 0's group
    closes; returns how many it ran. On an error: report it to rank 0, leave the process group, raise it."""
    if learner.ranks.rank == 0:
        raise ValueError("follow runs on ranks 1..N-1; rank 0 makes a LearnerGroup")
    channel = _Channel(learner.ranks, timeout_s)
    commands, count, name = _Commands(learner), 0, "the first command"
    previous = set_recorder(None)  # rank 0 records the metrics
    try:
        while True:
            name, args = channel.receive()
            if name == "stop":
                return count
            if name not in _Commands.NAMES:
                raise ValueError(f"unknown learner command {name!r}")
            getattr(commands, name)(*args)
            channel.barrier()
            count += 1
    except BaseException as e:
        channel.report(name, e)
        if dist.is_initialized():
            dist.destroy_process_group()  # rank 0's pending collective fails now instead of at its timeout
        raise
    finally:
        set_recorder(previous)
