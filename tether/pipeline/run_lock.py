"""One run per directory: an exclusive lock on ``RUN/.lock``, held for the whole run by the process that writes it
(``Run.build`` takes it before anything is written, ``Run.close`` releases it; under ``backend: ray`` that is
the trainer actor, wherever it runs).

The lock is ``flock(2)``, not the existence of a file: the kernel releases it when its holder dies, however it
dies (kill -9, the OOM killer, a lost Ray actor), so a file left behind is never a stale lock — whoever can take
the lock owns the directory, and a second run is refused only while the holder lives. The PID, host and start
time written into the file serve the refusal's message and nothing else: a dead PID never blocks (and a PID on
another host could not be checked anyway).

A clean release removes the file; a process that opened it just before locks the file there then
(``tether.locks``).

Limits: ``flock`` holds on local file systems and on NFSv4 (Linux emulates it with byte-range locks); where the
file system refuses locks the run goes on unlocked with a warning. The descriptor is close-on-exec, so programs a
run starts (tools, servers) do not inherit the lock; a child made by a bare ``fork()`` would share it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

from tether.locks import lock_file, unlock_file

LOCK_FILE = ".lock"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked (the message says why and what to do)."""


class RunDirInUse(RunDirError):
    """Another live process holds the run directory's lock: the refused process must write nothing there (not even
    its failure into train.log, which is the holder's)."""


class RunLock:
    """The lock of one run directory, held from ``acquire`` until ``release``."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.warning: str | None = None  # set when the file system would not lock: the run goes on unlocked
        self._fd: int | None = None
        self._created: list[Path] = []  # the folders acquire made, removed again by release(remove_created=True)

    def acquire(self) -> RunLock:
        """Take the lock (making the run directory if needed), or raise ``RunDirError`` naming the live holder."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(f"--run-dir {self.run_dir} is a file, not a directory; choose another --run-dir")
        missing = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._created = missing
        try:
            fd = lock_file(self.path)
        except BlockingIOError:
            raise RunDirInUse(f"--run-dir {self.run_dir} is in use by another run ({_holder(self.path)}, "
                              f"{self.path}); wait for it to end or stop it, or choose another --run-dir (nothing "
                              "was written)") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            self.warning = (f"the file system of {self.run_dir} does not support locks ({e.strerror}): nothing "
                            "stops a second run from writing into this directory at the same time")
            return self
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n").encode())
        return self

    def release(self, *, remove_created: bool = False) -> None:
        """Remove the lock file and unlock (idempotent); ``remove_created``: also remove the folders ``acquire``
        made, where they are empty (a run refused before it wrote anything leaves nothing behind)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            unlock_file(fd, self.path)
        for folder in self._created if remove_created else ():
            try:
                folder.rmdir()
            except OSError:  # not empty (or not ours any more): it stays
                break
        self._created = []


def _holder(path: Path) -> str:
    """The holder as its lock file names it: "PID 123 on host h since …" (retried briefly: the holder writes it
    just after taking the lock)."""
    for _ in range(20):
        try:
            info = json.loads(path.read_text(encoding="utf-8", errors="replace"))
            return f"PID {info['pid']} on host {info['host']}, since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return "a process that did not write its PID and host"
