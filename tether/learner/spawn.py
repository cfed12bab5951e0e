"""Trainer ranks on this machine: ``spawn_ranks(n, fn, *args)`` starts ranks 1..n-1 as processes that join one
process group with this process, rank 0, and run ``fn(ranks, *args)``.

    spawned = spawn_ranks(2, follow_rank, model_dir)   # rank 1 runs follow_rank(Ranks(1, 2), model_dir)
    group = LearnerGroup(sharded_learner(model, spawned.ranks, ...), spawned=spawned)
    ...
    group.close()                                      # rank 1's follow() returns, so does follow_rank
    spawned.close()                                    # waits for it, leaves the process group

This process is rank 0 because the pipeline (rollouts, the engine, the metrics, ``breakpoint()``) lives here; the
others only train (``tether.learner.group.follow``). Under ``torchrun`` (or one Ray actor per rank) the launcher
starts every rank instead and ``tether.learner.fsdp.init_ranks`` joins them; the group code is the same.

A rank is a fresh interpreter (``python -m tether.learner.spawn``) that reads ``fn`` and its arguments, pickled, from
its stdin, with this process's ``sys.path``: unlike ``multiprocessing``'s spawn it does not import the caller's main
module again, so a script without an ``if __name__ == "__main__"`` guard (or a notebook) can start ranks.

Rendezvous: a ``TCPStore`` on 127.0.0.1 that this process hosts on a port the OS picks when it binds (no free-port
race). Each rank says ``ready/<rank>`` in it before joining the group, so a rank that dies while it starts (a spawned
rank imports torch and tether again: ~5 s) is reported with its exit code at once, rather than leaving rank 0 in the
rendezvous until the timeout.

Backend: gloo on CPUs (``fn`` sets each rank's torch threads), NCCL on GPUs (rank r on GPU r). ``timeout_s`` bounds
every collective of the group: a rank that stops answering in the middle of one is an error after that long, never a
hang.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tether.learner.ranks import Ranks

START_TIMEOUT_S = 300.0  # seconds a spawned rank may take to start and join the group
DEFAULT_TIMEOUT_S = 600.0
"""Seconds a collective waits for the other ranks. Between two collectives of one learner command a rank waits for
the others' compute, and, during a checkpoint, for rank 0 writing the weights before the optimizer state is gathered:
minutes for a large model."""


@dataclass
class Spawned:
    """The ranks ``spawn_ranks`` started (rank r is ``processes[r - 1]``) and this process's place among them."""

    ranks: Ranks
    processes: list[subprocess.Popen]
    store: Any = field(repr=False)  # the rendezvous TCPStore; hosted here, so it lives as long as this object

    def exitcodes(self) -> dict[int, int]:
        """The ranks that have ended, and their exit codes (negative: killed by that signal)."""
        return {r: code for r, p in enumerate(self.processes, 1) if (code := p.poll()) is not None}

    def close(self, grace_s: float = 30.0) -> dict[int, int]:
        """Wait up to ``grace_s`` for the ranks to end (``LearnerGroup.close`` tells them to), end any still running
        (SIGTERM, then SIGKILL), and leave the process group; returns the exit codes."""
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            _wait(p, max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
                _wait(p, 5.0)
            if p.poll() is None:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        return self.exitcodes()

    def __enter__(self) -> Spawned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait(p: subprocess.Popen, timeout_s: float) -> None:
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass


def spawn_ranks(n: int, fn: Callable[..., object], *args: Any, backend: str | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> Spawned:
    """Start ranks 1..n-1 running ``fn(Ranks(r, n), *args)`` in a process group of ``n`` ranks with this process as
    rank 0 (joined when this returns). ``fn`` and ``args`` must pickle (a module-level function; a model travels
    better as its folder than as a module). ``backend``: None = NCCL with CUDA, else gloo."""
    if n < 1:
        raise ValueError(f"spawn_ranks needs at least one rank, got {n}")
    if dist.is_initialized():
        raise RuntimeError("this process is in a process group already (torchrun, init_ranks, an earlier "
                           "spawn_ranks not closed): close it first")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, timeout=timeout, wait_for_workers=False)
    spawned = Spawned(Ranks(0, n), [], store)
    try:
        for r in range(1, n):
            p = subprocess.Popen([sys.executable, "-m", "tether.learner.spawn"], stdin=subprocess.PIPE)
            spawned.processes.append(p)
            assert p.stdin is not None
            with p.stdin:  # sys.path first: the rest may name modules only it reaches (a test's, a user's)
                p.stdin.write(pickle.dumps(sys.path) + pickle.dumps((r, n, store.port, backend, timeout_s, fn, args)))
        _wait_ready(store, spawned, max(timeout_s, START_TIMEOUT_S))
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=store, rank=0, world_size=n, timeout=timeout)
    except BaseException:
        spawned.close(grace_s=0.0)
        raise
    return spawned


def _wait_ready(store: Any, spawned: Spawned, timeout_s: float) -> None:
    """Until every started rank has said ready; an exit before that is an error naming the rank."""
    deadline = time.monotonic() + timeout_s
    waiting = set(range(1, len(spawned.processes) + 1))
    while waiting:
        waiting = {r for r in waiting if not store.check([f"ready/{r}"])}
        for r, code in spawned.exitcodes().items():
            if r in waiting:
                raise RuntimeError(f"trainer rank {r} exited with code {code} before joining the process group "
                                   "(its error is above, on stderr)")
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"trainer ranks {sorted(waiting)} did not start within {timeout_s:.0f} s")
        time.sleep(0.02 if waiting else 0)


def _rank_main(rank: int, n: int, port: int, backend: str, timeout_s: float, fn: Callable[..., object],
               args: tuple) -> None:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, n, is_master=False, timeout=timeout)
    store.set(f"ready/{rank}", "1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=timeout)
    try:
        fn(Ranks(rank, n), *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":  # a rank spawn_ranks started: its arguments come pickled on stdin
    sys.path[:] = pickle.load(sys.stdin.buffer)
    _rank_main(*pickle.load(sys.stdin.buffer))
