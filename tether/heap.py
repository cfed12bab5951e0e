"""A run's long-lived objects kept out of the garbage collector's full passes (``freeze``).

CPython's collection of its oldest generation walks every tracked object in the process. With a model, its
tokenizer, the environments and the engine built, one such pass took 170-320 ms on a 2-core host (measured with
``gc.callbacks`` in ``tether serve`` under ``benchmarks/serve_load.py`` and in a demo training run), and it holds the
GIL all that time: the engine thread, the event loop and the learner stop together. Under load the server's small
requests saw it as a 350 ms stall in every other round; an 8-step demo run (~20 s of steps) paid two, of 228 and
321 ms.

``gc.freeze()`` moves every object alive at that moment into a permanent generation that collections skip; objects
made later are collected as before, and a frozen object whose last reference goes is still freed at once (reference
counting). What freezing gives up is the collection of *cycles* among frozen objects, so the freeze is undone when
they are let go (a run's close): ``gc.unfreeze()`` hands them back to the oldest generation. Freezes nest (runs
built inside a process that already froze, tests): the heap is unfrozen when the last one is undone.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

_lock = threading.Lock()
_depth = 0  # freezes not yet undone


def freeze(collect: bool = False) -> Callable[[], None]:
    """Freeze what is alive now; returns the undo (idempotent). ``collect``: a full collection first, so that
    garbage alive now is not kept with the rest (for a process that never undoes the freeze, e.g. a server)."""
    global _depth
    with _lock:
        if collect:
            gc.collect()
        gc.freeze()
        _depth += 1
    undone = False

    def unfreeze() -> None:
        global _depth
        nonlocal undone
        with _lock:
            if undone:
                return
            undone = True
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()

    return unfreeze
