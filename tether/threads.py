"""How many torch threads a CPU-bound phase should use now: one per core that other processes leave this one.

Why. An OpenMP team waits at every barrier for its slowest thread, so a thread whose core another busy process
holds stalls the whole team. Measured (``benchmarks/contention.py``: forward + backward + AdamW of the tiny-sft
model, batch 8 × 400 tokens, 2 cores, medians of 3-4 runs): quiet, 1 thread 0.47-0.58 s a step and 2 threads
0.27-0.33 s; beside one CPU-bound process, 1 thread 0.49-0.58 s and 2 threads 0.72-1.03 s (1.44-1.79× slower than
one); beside two busy cores (other jobs on the machine), 2 threads took 4.8-5.5 s, 9-10× one thread's 0.52-0.59 s.
A tiny-sft build (80 demonstrations, 50 copy-task steps, 4 epochs) from 2 threads: quiet 15-18 s fixed or adaptive;
beside a busy process 204 s fixed, 26-31 s adaptive (1 thread).

What is measured. The cores other processes kept busy over a window: the busy jiffies of this process's CPUs
(``os.sched_getaffinity``) in ``/proc/stat`` (all but idle and iowait; steal counts as busy), less this process's
own CPU time (``time.process_time``, every thread) over the same window. The window is the previous epoch or step:
nothing to wait for, and this process's own threads (an async rollout's engine) are not taken for contention; a
training run marks its start (``CpuMeter.mark``), so its first step reads the window since then; when the last look
is missing or over ``MAX_WINDOW_S`` old, ``SAMPLE_S`` is sampled now. Then

    available = min(len(affinity) − others, cgroup CPU quota)
    threads   = clamp(floor(available + 1/2), 1, ceiling)         (``decide``)

Beside a busy process a window over 2 threads reads 0.68-0.84 of a core (the scheduler gives it 2/3 of one: 3
threads on 2 cores), over 1 thread 0.94-1.08: 1 thread either way. Beside one busy half the time, 0.23-0.38 over 2
threads (2 kept) and 0.45-0.58 over 1 thread (1 or 2). The threshold (the last thread kept while others use at most
half a core) lies nearer the cheaper error: 2 threads beside a busy process cost 1.44-1.79×, 1 beside a half-busy
one 1.17-1.28×. Rejected: ``procs_running`` (runnable threads, an instant: beside a half-busy process it reads 1, 2
or 3, and it counts this process's own); the idle share sampled while this process waits (exact: 0.51-0.53 and
1.00-1.01 of a core, but ``SAMPLE_S`` of waiting at every decision, and a busy thread of this process's own counts
as contention).

``ceiling`` is the caller's ``torch.get_num_threads()`` (``OMP_NUM_THREADS``, ``torch.set_num_threads``): the choice
only ever lowers it. Without ``/proc/stat`` (not Linux) the ceiling is kept. ``TETHER_THREADS=N`` fixes N threads
instead (no measurement, no ceiling).

Reproducibility. A CPU result can change in its last bits with the thread count (a product or reduction split by
thread). Measured on the tiny-sft model (4 layers, hidden 128): the preset built on 1 thread and on 2 differs by up
to 2e-5 in the weights (40 demonstrations, one epoch a phase), one RL learner step (8 × 400 tokens) by 4.5e-7; the
tests' 1-layer recipe (``SMALL``) is the same bits on both, and a build at a fixed count repeats bit for bit. A
quiet machine gets the ceiling, so there nothing changes; under load the count, and so the bits, follow the load.
``TETHER_THREADS=N`` makes SFT and the preset build reproducible (the build records every count it decided in its
``tether_warmstart.json``: counts all N are reproduced by ``TETHER_THREADS=N``); ``trainer.deterministic`` pins the
training run's counts (``docs/determinism.md``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ENV = "TETHER_THREADS"
SAMPLE_S = 0.2  # a fresh sample: ±1 jiffy (10 ms) is ±0.05 of a core
MIN_WINDOW_S = 0.1  # a shorter window is waited out to this
MAX_WINDOW_S = 60.0  # an older reading says little about now: sample afresh
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def decide(available: float, ceiling: int) -> int:
    """Threads for ``available`` cores (possibly fractional): the nearest whole number, a half rounded up, at least
    1 and at most ``ceiling``. A core other processes use half of still pays for its own thread."""
    return max(1, min(ceiling, math.floor(available + 0.5)))


def fixed_threads() -> int | None:
    """``TETHER_THREADS`` as a count, or None when unset or empty; anything but a positive integer is an error."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV}={value!r}: expected a positive number of torch threads")
    return int(value)


def parse_cpu_max(text: str) -> float | None:
    """Cores of a cgroup v2 ``cpu.max`` (``"200000 100000"`` → 2.0; ``"max 100000"`` → None)."""
    quota, _, period = text.strip().partition(" ")
    return None if quota == "max" else int(quota) / int(period or 100000)


def quota_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None without one.
    Reads the namespace's root cgroup, which is the container's own under Docker and Kubernetes."""
    try:
        if (root / "cpu.max").is_file():
            return parse_cpu_max((root / "cpu.max").read_text())
        for v1 in (root / "cpu", root / "cpu,cpuacct"):
            if (v1 / "cpu.cfs_quota_us").is_file():
                quota = int((v1 / "cpu.cfs_quota_us").read_text())
                return None if quota < 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None


def _affinity() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def available_cores() -> int:
    """The CPUs this process may run on: its affinity mask (every CPU where the platform has none). Neither the
    cgroup quota (``quota_cores``) nor what other processes keep busy (``CpuMeter``) is taken off."""
    return len(_affinity())


@dataclass(frozen=True)
class CpuReading:
    """One look at the CPUs: when, their busy seconds (all processes), and this process's CPU seconds."""

    t: float  # time.monotonic()
    busy: float  # busy seconds of this process's CPUs, since boot
    own: float  # this process's CPU seconds (every thread), since it started


def read_cpus(cpus: set[int], stat: Path = Path("/proc/stat")) -> CpuReading | None:
    """A reading of ``cpus`` from ``stat``; None where it cannot be read (not Linux)."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            fields = [int(f) for f in rest.split()] + [0] * 8  # an older kernel has fewer columns
            user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
            busy += user + nice + system + irq + softirq + steal  # guest time is inside user already
    return CpuReading(time.monotonic(), busy / _CLK_TCK, time.process_time())


def others_busy(before: CpuReading, after: CpuReading) -> float:
    """Cores that other processes kept busy between two readings (at least 0)."""
    return max(0.0, (after.busy - before.busy - (after.own - before.own)) / max(after.t - before.t, 1e-9))


class CpuMeter:
    """The cores other processes leave this one, over the window since its previous look (see the module
    docstring). One meter per decision site: a second user of it would shorten its windows."""

    def __init__(self, stat: Path = Path("/proc/stat"), quota: Callable[[], float | None] = quota_cores):
        self.stat, self.quota = stat, quota
        self.cpus = _affinity()
        self._last: CpuReading | None = None

    def mark(self) -> None:
        """Start a window now without waiting: the next ``look`` reads the cores since this moment (a run marks its
        start, so that its first step's look is not a fresh ``SAMPLE_S`` of waiting)."""
        self.cpus = _affinity()
        self._last = read_cpus(self.cpus, self.stat)

    def look(self) -> tuple[float, float] | None:
        """(cores available to this process, cores other processes kept busy), or None without ``/proc/stat``."""
        if (cpus := _affinity()) != self.cpus:  # another set of CPUs: the last reading is not comparable
            self.cpus, self._last = cpus, None
        now = read_cpus(self.cpus, self.stat)
        if now is None:
            return None
        last = self._last
        if last is None or now.t - last.t > MAX_WINDOW_S:
            last, wait = now, SAMPLE_S
        else:
            wait = MIN_WINDOW_S - (now.t - last.t)
        if wait > 0:
            time.sleep(wait)
            now = read_cpus(self.cpus, self.stat)
            if now is None:
                return None
        self._last = now
        others = others_busy(last, now)
        available = len(self.cpus) - others
        quota = self.quota()
        return (available if quota is None else min(available, quota)), others


@dataclass(frozen=True)
class Choice:
    """A thread count and the reason, as the log line gives it."""

    threads: int
    why: str


def choose(ceiling: int, meter: CpuMeter) -> Choice:
    """The torch threads for the next stretch of CPU-bound work: ``TETHER_THREADS``, else ``decide`` on what
    ``meter`` sees (no look when ``ceiling`` is 1: nothing to lower), else ``ceiling``."""
    fixed = fixed_threads()
    if fixed is not None:
        return Choice(fixed, f"{ENV}={fixed}")
    if ceiling <= 1:
        return Choice(1, "one thread asked for")
    seen = meter.look()
    if seen is None:
        return Choice(ceiling, "the CPU load is unknown here (no /proc/stat)")
    available, others = seen
    why = f"about {others:.1f} of {len(meter.cpus)} cores are busy with other processes"
    if available < len(meter.cpus) - others:
        why += f", and a CPU quota allows {available:.1f}"
    return Choice(decide(available, ceiling), why)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """``torch.set_num_threads(n)`` for the block; this thread's count before it back after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class TorchThreads:
    """torch's thread count for a long CPU-bound job (an SFT run, the preset build). ``update()`` at each boundary
    (an epoch, a phase) re-decides it (``choose``, at most the count torch had when this was made) and logs a line
    when the decision changes; as a context manager it gives the caller's count back on exit. ``counts`` lists every
    count decided, in order."""

    def __init__(self, log: Callable[[str], Any] | None = None, ceiling: int | None = None):
        self.log = log
        self.ceiling = ceiling or torch.get_num_threads()
        self.meter = CpuMeter()
        self.counts: list[int] = []
        self._saved: list[int] = []

    def update(self) -> int:
        """Decide and apply the count for what follows; returns it."""
        choice, current = choose(self.ceiling, self.meter), torch.get_num_threads()
        previous = self.counts[-1] if self.counts else current  # a phase begun at the caller's count: no new line
        if choice.threads != previous and self.log is not None:
            self.log(f"{previous} → {choice.threads} torch threads: {choice.why}")
        if choice.threads != current:
            torch.set_num_threads(choice.threads)
        self.counts.append(choice.threads)
        return choice.threads

    def __enter__(self) -> TorchThreads:
        self._saved.append(torch.get_num_threads())
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self._saved.pop())
