"""Preemption: SIGTERM (a scheduler taking the node back) or SIGINT (Ctrl-C) finishes the current step, writes a
checkpoint of it, says where it is and how to resume, and exits with 128 + the signal's number (143 for
SIGTERM, 130 for SIGINT) — the code a shell reports for a process ended by that signal, so job schedulers read it
as "preempted", not "failed". A second signal exits at once (no checkpoint of the current step; the previous
one stands).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType


class Preempted(Exception):
    """The run stopped on a signal after saving ``checkpoint`` (step ``step``)."""

    def __init__(self, signame: str, signum: int, step: int, checkpoint: str):
        super().__init__(f"stopped by {signame} after step {step}; checkpoint: {checkpoint}")
        self.signame, self.exit_code, self.step, self.checkpoint = signame, 128 + signum, step, checkpoint


class PreemptionGuard:
    """``with PreemptionGuard() as stop:`` — ``stop.requested`` is the first signal received (or None).

    Handlers are installed only in the main thread (Python delivers signals there); elsewhere this is inert."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.requested is not None:
            print(f"\n{sig.name} again: exiting now, without a checkpoint of the current step", file=sys.stderr)
            os._exit(128 + signum)
        self.requested = sig
        print(f"\n{sig.name}: finishing the current step, then saving a checkpoint "
              f"(send {sig.name} again to exit at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
