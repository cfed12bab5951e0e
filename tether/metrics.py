"""Metrics are one call from anywhere: ``record_metric("reward/mean", value, reduce="mean")``.

Values recorded during a trainer step are reduced when the step is flushed and written to every sink.
``make_sinks(run_dir, ...)`` builds them from the ``metrics`` section: ``RUN/metrics.jsonl`` always,
TensorBoard events under ``RUN/tensorboard`` (``metrics.tensorboard``), and a Weights & Biases run
(``metrics.wandb``, project ``metrics.wandb_project`` or "tether") whose local files go under ``RUN/wandb``.
With no active recorder ``record_metric`` is a no-op, so library code can record unconditionally.
Non-finite values are kept (as ``NaN``/``inf`` in JSON) rather than dropped: a run that goes non-finite must
show it.

W&B. The package is the optional extra ``tether[wandb]``; ``metrics.wandb: true`` without it fails at start,
naming the key and the extra. W&B's own environment variables choose where the run goes:
``WANDB_MODE=offline`` writes everything under ``RUN/wandb/offline-run-*`` with no network (``wandb sync``
uploads it later), ``WANDB_MODE=disabled`` turns it off, and online runs read the key from ``WANDB_API_KEY`` /
``wandb login`` — tether never reads, passes or logs it. The run's config is ``RunConfig.redacted_dict()``
(secrets as ``***`` or ``${VAR}``), and W&B's run metadata is off (``x_disable_meta``: no command line, which
may carry ``--set …api_key=…``, no git state, host or program path), as are console capture and code saving.
System metrics (CPU/GPU use) stay on.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

from tether.errors import ConfigError

Reduce = Literal["mean", "sum", "max", "min", "last"]


class Sink(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per flushed step, always with ``step``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, step: int, values: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": step, **values}, allow_nan=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _wait_past_existing_events(log_dir: Path) -> None:
    """TensorBoard reads a folder's event files in name order, and a file's name is ``events.out.tfevents.<whole
    seconds>.<host>.<pid>...``: a writer started in the same second as an earlier one (a resume in the second of a
    fast run's kill) sorts by pid, which can put its steps before the killed run's and undo the purge. Wait until
    the clock is past the newest existing file's second: at most a second, and only then (a file stamped later
    still, written under a clock ahead of this one, is not waited for)."""
    names = [p.name.split(".") for p in log_dir.glob("events.out.tfevents.*")]
    stamps = [int(parts[3]) for parts in names if len(parts) > 3 and parts[3].isdigit()]
    if stamps and (wait := max(stamps) + 1 - time.time()) > 0:
        time.sleep(min(wait, 1.0))


class TensorBoardSink:
    """``purge_step``: on resume, the events a killed run wrote at or after this step are discarded by
    TensorBoard, so a resumed run shows every step once."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 — tensorboard only when metrics.tensorboard

        _wait_past_existing_events(Path(log_dir))
        self._w = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self._w.add_scalar(k, v, global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """One W&B run; ``write`` logs a flushed step at ``step`` (W&B drops a step lower than one already logged).

    ``close`` finishes the run; wandb-core may still be writing its local file then — it is complete when the
    process exits or after ``wandb.teardown()``."""

    def __init__(self, project: str | None, config: dict[str, Any] | None = None, *,
                 run_dir: str | Path | None = None, name: str | None = None):
        try:
            import wandb  # noqa: PLC0415 — the wandb extra, only when metrics.wandb
        except ImportError:
            raise ConfigError("`metrics.wandb` is true but the `wandb` package is not installed: install the extra "
                              "(pip install 'tether[wandb]') or set metrics.wandb: false") from None
        if run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", x_disable_meta=True, disable_git=True, disable_code=True,
                                  save_code=False)
        self._run = wandb.init(project=project, config=config, dir=None if run_dir is None else str(run_dir),
                               name=name, settings=settings, reinit="create_new")

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def make_sinks(run_dir: str | Path, *, tensorboard: bool = True, wandb: bool = False, wandb_project: str | None = None,
               config: dict[str, Any] | None = None, resume_step: int | None = None) -> list[Sink]:
    """The sinks the ``metrics`` section asks for (its keys as arguments), writing under ``run_dir`` (module
    docstring); ``config``: the run's redacted config, W&B's run config; ``resume_step``: the checkpoint a resumed
    run continues from (later TensorBoard events are purged)."""
    run_dir = Path(run_dir)
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl")]
    try:
        if tensorboard:
            purge = resume_step + 1 if resume_step is not None else None
            sinks.append(TensorBoardSink(run_dir / "tensorboard", purge_step=purge))
        if wandb:
            sinks.append(WandbSink(wandb_project or "tether", config or {}, run_dir=run_dir,
                                   name=run_dir.resolve().name))
    except BaseException:
        for sink in sinks:  # a failed start leaves no open file behind
            sink.close()
        raise
    return sinks


class BusyClock:
    """Wall time during which at least one job is in flight (thread-safe): ``enter`` / ``leave`` around each job.
    The rollouter's busy time (``perf/rollouter_idle_ratio``) and a remote engine's ``busy_s`` are this clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._total += time.perf_counter() - self._since

    @property
    def busy_s(self) -> float:
        """Busy seconds so far, the running stretch included."""
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._in_flight else 0.0)


def read_jsonl_rows(path: str | Path) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """The rows of a ``metrics.jsonl``-style file, one JSON object with a ``step`` a line, in file order, and the
    lines that are not (``(line number, text)``): a torn last line left by a kill or a full disk, or damage.
    Callers decide what a bad line means (the resume drops a torn last one, a report skips it, verify refuses)."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    rows: list[dict[str, Any]] = []
    bad: list[tuple[int, str]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            row["step"] = int(row["step"])
        except (ValueError, KeyError, TypeError):
            bad.append((n, line))
            continue
        rows.append(row)
    return rows, bad


class MetricsRecorder:
    """Accumulates values between flushes; thread-safe (rollouts record from worker threads)."""

    def __init__(self, sinks: list[Sink] | None = None):
        self.sinks = list(sinks or [])
        self._lock = threading.Lock()
        self._values: dict[str, list[float]] = defaultdict(list)
        self._reduce: dict[str, Reduce] = {}
        self.history: list[dict[str, float]] = []  # every flushed row, for reports and tests

    def record(self, name: str, value: float, reduce: Reduce = "mean") -> None:
        with self._lock:
            prev = self._reduce.setdefault(name, reduce)
            if prev != reduce:
                raise ValueError(f"metric {name!r} recorded with reduce={reduce!r} after reduce={prev!r}")
            self._values[name].append(float(value))

    def peek(self) -> dict[str, float]:
        """The row ``flush`` would write now, without writing it."""
        with self._lock:
            return {k: _reduce(v, self._reduce[k]) for k, v in self._values.items() if v}

    def flush(self, step: int) -> dict[str, float]:
        with self._lock:
            row = {k: _reduce(v, self._reduce[k]) for k, v in self._values.items() if v}
            self._values.clear()
        self.history.append({"step": step, **row})
        for s in self.sinks:
            s.write(step, row)
        return row

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def _reduce(values: list[float], how: Reduce) -> float:
    if how == "mean":
        return math.fsum(values) / len(values)
    if how == "sum":
        return math.fsum(values)
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return values[-1]


_active: MetricsRecorder | None = None


def set_recorder(recorder: MetricsRecorder | None) -> MetricsRecorder | None:
    """Make ``recorder`` the target of ``record_metric``; returns the previous one."""
    global _active
    prev, _active = _active, recorder
    return prev


def record_metric(name: str, value: float, reduce: Reduce = "mean") -> None:
    if _active is not None:
        _active.record(name, value, reduce)


@contextlib.contextmanager
def timer(name: str, reduce: Reduce = "sum") -> Iterator[None]:
    """Record the wall time of the block in seconds under ``name``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        record_metric(name, time.perf_counter() - t, reduce)
