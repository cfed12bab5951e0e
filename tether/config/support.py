"""Keys whose feature is not built yet: refused at load, naming the key, the file and what is missing.

Every key of the seed configs has a typed field (so ``tether config --explain`` can describe it and the
builder of the feature finds its shape ready), but a key that would change nothing must not be accepted
silently: a user who sets ``actor_worker.strategy: megatron`` and gets FSDP2 has been lied to. A refused
key is one *set* in a file or by ``--set``; its default is harmless and stays in ``RunConfig`` (dumps leave out
the sections refused whole, so a dumped config loads back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Key = tuple[Any, ...]


@dataclass(frozen=True)
class NotBuilt:
    key: Key
    """The key path, e.g. ("engine", "type")."""
    reason: str
    """What is not built, in words (completes "not supported yet — ...")."""
    refuses: Callable[[Any], bool] | None = None
    """Which values of the key are refused; None = every value (a section: any key set in it)."""


UNSUPPORTED: tuple[NotBuilt, ...] = (
    NotBuilt(("actor_worker", "strategy"), "the trainer shards its model with FSDP2 only (tether.learner.fsdp); "
                                           "use `actor_worker.strategy: fsdp2` (or `fsdp`, the same) or `none`",
             lambda v: v in ("veOmni", "megatron")),
)

REFUSED_SECTIONS: frozenset[str] = frozenset(n.key[0] for n in UNSUPPORTED if len(n.key) == 1 and n.refuses is None)
"""Top-level sections refused whole: dumps leave them out, so that a dumped config loads back."""


def not_built(key: Key) -> NotBuilt | None:
    """The table entry that covers ``key`` (the key itself or a section above it), if any."""
    return next((n for n in UNSUPPORTED if key[: len(n.key)] == n.key), None)


def refusals(data: dict[Any, Any], origins: dict[Key, str]) -> list[str]:
    """One line per refused entry that the merged ``data`` sets: the keys, who set them, what is missing.

    ``origins`` maps each leaf key set by a file or ``--set`` to its source (``tether.config.io``)."""
    lines = []
    for entry in UNSUPPORTED:
        keys = [k for k in origins if k[: len(entry.key)] == entry.key]
        if not keys:
            continue
        if entry.refuses is not None:
            value = _get(data, entry.key)
            if entry.key not in origins or not entry.refuses(value):
                continue
            shown = f"`{_dotted(entry.key)}` = {value!r} ({origins[entry.key]})"
        else:  # the keys grouped by the file that set them
            by_source: dict[str, list[str]] = {}
            for k in keys:
                by_source.setdefault(origins[k], []).append(f"`{_dotted(k)}`")
            shown = "; ".join(f"{', '.join(ks)} ({source})" for source, ks in by_source.items())
        lines.append(f"{shown}: not supported yet — {entry.reason}")
    return lines


def _get(data: Any, key: Key) -> Any:
    for part in key:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _dotted(key: Key) -> str:
    return ".".join(str(p) for p in key)
