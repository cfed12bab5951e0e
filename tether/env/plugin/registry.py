"""Which environment ``environment.name`` selects: a registered name, an import path, an entry point, or tau2.

An environment is a pair ``(make_env(config), list_tasks(split, config))`` — ``config`` is the run's
``RunConfig`` — or anything that yields one: an object with ``make_env`` and ``list_tasks`` methods (a
``ToolEnvironment``), or a function of no arguments returning either. ``environment.name`` is resolved in order:

0. ``openenv:<url | module | file.py | folder>`` — an OpenEnv server, running or started by tether, through
   ``tether.env.openenv.environment(target)``, imported only then (the optional extra ``tether[openenv]``);
1. ``tau2:<domain>`` — tau2-bench's domain through ``tether.env.tau2.environment(domain)``, imported only then
   (the optional extra ``tether[tau2]``);
2. a name in ``ENVIRONMENTS`` (built in: ``customer_service_agent``; ``register(name, env)`` adds one);
3. an import path ``package.module:attribute``; a module not on ``sys.path`` is looked for in the current
   directory (as ``uvicorn`` does) and beside the config files (``search_beside``: the CLI names them), so
   ``tether train examples/custom_env/config.yaml`` finds ``calc_env.py`` from any directory;
4. an entry point of the ``tether.environments`` group, named like the environment — how a third-party package
   registers one (``[project.entry-points."tether.environments"] my_env = "my_pkg.env:environment"``).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tether.types import Task

ENTRY_POINT_GROUP = "tether.environments"
TAU2_PREFIX = "tau2:"
OPENENV_PREFIX = "openenv:"
EnvPair = tuple[Callable[[Any], Any], Callable[[str, Any], list[Task]]]
# name -> an environment, or the import path of one (imported when selected)
ENVIRONMENTS: dict[str, Any] = {"customer_service_agent": "tether.env.customer_service.env:environment"}
# folders an import path's module is looked for in when it is not on sys.path (after the current directory)
_BESIDE: list[str] = []


class EnvironmentNotFound(ValueError):
    """``environment.name`` names nothing that resolves; the message says what was tried."""


def register(name: str, environment: Any) -> None:
    """Make ``environment`` (a pair, a ``ToolEnvironment``, a factory or an import path) selectable by ``name``."""
    if name.startswith((TAU2_PREFIX, OPENENV_PREFIX)) or ":" in name:
        raise ValueError(f"environment name {name!r} must not contain ':' (that form is an import path)")
    ENVIRONMENTS[name] = environment


def as_pair(obj: Any, where: str) -> EnvPair:
    """``obj`` as ``(make_env, list_tasks)``; see the module docstring for what it may be."""
    for attempt in range(2):
        if isinstance(obj, tuple) and len(obj) == 2 and all(callable(x) for x in obj):
            return obj[0], obj[1]
        if callable(getattr(obj, "make_env", None)) and callable(getattr(obj, "list_tasks", None)):
            return obj.make_env, obj.list_tasks
        if attempt == 0 and callable(obj):
            try:
                obj = obj()
            except TypeError as e:
                raise EnvironmentNotFound(f"{where}: calling it with no arguments failed ({e}); an environment is a "
                                          "(make_env, list_tasks) pair, a ToolEnvironment, or a function of no "
                                          "arguments returning one") from None
            continue
        break
    raise EnvironmentNotFound(f"{where} is a {type(obj).__name__}, not an environment: expected a "
                              "(make_env, list_tasks) "
                              "pair, an object with make_env and list_tasks (a ToolEnvironment), or a function of no "
                              "arguments returning one")


def search_beside(config_files: Sequence[str | Path]) -> None:
    """Look for an import path's module beside each of ``config_files`` too (after the current directory), so a
    config naming ``my_env:environment`` finds ``my_env.py`` next to itself wherever the command is run from."""
    for folder in dict.fromkeys(str(Path(f).resolve().parent) for f in config_files):
        if folder not in _BESIDE:
            _BESIDE.append(folder)


def load_import_path(path: str, key: str = "environment.name") -> Any:
    """The attribute ``path`` = ``package.module:attribute`` names, importing its module (from sys.path, else the
    current directory, else beside the config files); errors name ``key``, the config key that gave ``path``."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise EnvironmentNotFound(f"{key} {path!r}: an import path is 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.split(".")[0]
        folders = [d for d in dict.fromkeys([os.getcwd(), *_BESIDE]) if d not in sys.path]
        if e.name != top or not folders:
            raise EnvironmentNotFound(f"{key} {path!r}: cannot import {module_name} ({e})") from e
        for folder in folders:  # the first one that holds the module goes on sys.path, as `python -m` would put it
            if importlib.machinery.PathFinder.find_spec(top, [folder]) is not None:
                sys.path.insert(0, folder)
                break
        else:
            raise EnvironmentNotFound(f"{key} {path!r}: cannot import {module_name} from sys.path, the "
                                      f"current directory or beside the config ({', '.join(folders)})") from e
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e2:
            raise EnvironmentNotFound(f"{key} {path!r}: cannot import {module_name} from {folder} "
                                      f"({e2})") from e2
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EnvironmentNotFound(f"{key} {path!r}: module {module_name} has no {attr!r}") from None
    return obj


def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed ``tether.environments`` entry points by name."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def tau2_environment(name: str) -> EnvPair:
    domain = name[len(TAU2_PREFIX):]
    if not domain:
        raise EnvironmentNotFound(f"environment.name {name!r}: name a tau2 domain, e.g. 'tau2:retail'")
    try:
        tau2 = importlib.import_module("tether.env.tau2")
    except ModuleNotFoundError as e:
        if e.name == "tether.env.tau2":
            raise EnvironmentNotFound(f"environment.name {name!r}: this tether has no tau2 adapter "
                                      "(tether.env.tau2)") from None
        raise EnvironmentNotFound(f"environment.name {name!r} needs tau2-bench, which is not installed ({e}); "
                                  "install the extra: pip install 'tether[tau2]'") from None
    return as_pair(tau2.environment(domain), f"environment.name {name!r}")


def openenv_environment(name: str) -> EnvPair:
    from tether.env import openenv  # noqa: PLC0415 — imports openenv-core only when it is used (make_env)

    if not openenv.available():
        raise EnvironmentNotFound(f"environment.name {name!r} needs openenv-core, which is not installed; "
                                  f"{openenv.INSTALL_HINT}")
    return as_pair(openenv.environment(name[len(OPENENV_PREFIX):]), f"environment.name {name!r}")


def resolve(name: str) -> EnvPair:
    """The ``(make_env, list_tasks)`` pair ``environment.name`` selects (module docstring); raises
    ``EnvironmentNotFound`` naming what was tried."""
    if name.startswith(OPENENV_PREFIX):
        return openenv_environment(name)
    if name.startswith(TAU2_PREFIX):
        return tau2_environment(name)
    if name in ENVIRONMENTS:
        obj = ENVIRONMENTS[name]
        return as_pair(load_import_path(obj) if isinstance(obj, str) else obj, f"environment {name!r}")
    if ":" in name:
        return as_pair(load_import_path(name), f"environment.name {name!r}")
    found = entry_points()
    if name in found:
        try:
            obj = found[name].load()
        except Exception as e:  # a broken third-party package: say which entry point
            raise EnvironmentNotFound(f"environment.name {name!r}: the {ENTRY_POINT_GROUP} entry point "
                                      f"{found[name].value!r} failed to load ({type(e).__name__}: {e})") from e
        return as_pair(obj, f"entry point {name!r} ({found[name].value})")
    raise EnvironmentNotFound(
        f"environment.name {name!r} is not a known environment; registered: {sorted(ENVIRONMENTS)}; installed "
        f"{ENTRY_POINT_GROUP} entry points: {sorted(found) or 'none'}; or give an import path "
        "'package.module:attribute', or 'tau2:<domain>'")
