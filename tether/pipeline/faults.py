"""Fault injection for crash tests: ``TETHER_FAULT=POINT@STEP`` kills the process (SIGKILL, no clean-up) when
the run reaches POINT at trainer step STEP — the way a lost node or the OOM killer would.

Points, in the order a step passes them (``trainer.py``):

    batch    the step's groups have been delivered, nothing trained yet
    update   the learner has updated, the weights are not synced yet
    sync     the weights are synced (or the step was not a sync step)
    eval     held-out evaluation of the step is done (only on evaluation steps)
    metrics  the step's metrics row is written, the checkpoint is not
    save     the checkpoint of the step is written (only on save steps)

and, in the producer (any mode), ``produce@S``: the first group of task step S has just finished
generating — in the async modes, typically while the trainer is in the middle of an earlier step.

Unset (the default), ``fault`` is a dictionary lookup and a comparison.
"""

from __future__ import annotations

import os
import signal

POINTS = ("batch", "update", "sync", "eval", "metrics", "save", "produce")


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("TETHER_FAULT")
    if not spec:
        return None
    point, _, step = spec.partition("@")
    if point not in POINTS or not step.isdigit():
        raise ValueError(f"TETHER_FAULT={spec!r}: expected POINT@STEP with POINT one of {', '.join(POINTS)}")
    return point, int(step)


def fault(point: str, step: int) -> None:
    """Kill this process now if ``TETHER_FAULT`` names this point and step."""
    if _target() == (point, step):
        os.kill(os.getpid(), signal.SIGKILL)
