"""Exclusive locks on files that go with their holder: ``flock(2)`` on a file the holder removes when it is done.

The kernel releases a ``flock`` when its holder dies, however it dies, so a file left behind is never a stale lock.
A clean holder removes its file before unlocking; a waiter that had opened the file by then holds a lock on a file
no longer at the path, so ``lock_file`` retries until the file it locked is the one at the path. Used by the run
directory's lock (``tether.pipeline.run_lock``) and the preset cache (``tether.runtime.cached_build``).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path


def lock_file(path: Path, *, on_wait: Callable[[], object] | None = None) -> int:
    """An exclusive lock on ``path`` (created if missing); returns its descriptor. Held by another process:
    ``on_wait`` None raises ``BlockingIOError`` at once, else it is called once and the lock waited for. Other
    ``OSError``s (a file system without locks: ENOLCK, EOPNOTSUPP …) are the caller's to judge."""
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is None:
                    raise
                if not waited:
                    on_wait()
                    waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        if same_file(fd, path):
            return fd
        os.close(fd)  # the holder removed the file as it finished: lock the file that is there now


def unlock_file(fd: int, path: Path) -> None:
    """Remove ``path`` when it is still the locked file (before unlocking: a waiter then finds it gone and
    retries), then unlock and close ``fd``."""
    try:
        if same_file(fd, path):
            path.unlink()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is the file at ``path`` now."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
