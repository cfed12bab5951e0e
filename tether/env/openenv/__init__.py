"""OpenEnv environments (the optional extra ``tether[openenv]``: PyPI ``openenv-core==0.3.0``).

``environment.name: openenv:<target>`` drives an OpenEnv server: the one running at a URL, or servers tether starts
from an app (a module, a ``.py`` file or an OpenEnv environment folder: ``target``) and stops when the run ends.
Configured by ``environment.openenv`` (``tether.config.openenv``). Files: ``target.py`` (what the name names),
``server.py`` (one server process), ``pool.py`` (the servers, the clients' event loop, faults and their metrics),
``env.py`` (an episode: the ``Env`` protocol over a WebSocket session, MCP tools as tool calls).

Tasks are seeds given to the server's ``reset``: ``seed-0`` … for ``train`` (``environment.num_train_tasks`` of
them), ``seed-1000000`` … for ``eval`` (``num_eval_tasks``), so the two splits never share a seed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from tether.types import Task

INSTALL_HINT = "install the extra: pip install 'tether[openenv]' (openenv-core==0.3.0)"
EVAL_SEED_BASE = 1_000_000
# environment keys an OpenEnv environment reads (the rest must stay at their defaults)
READ = ("name", "openenv", "num_train_tasks", "num_eval_tasks", "state.context_window")


def available() -> bool:
    return importlib.util.find_spec("openenv") is not None


def unread_keys(environment: Any) -> list[str]:
    """The ``environment`` keys set away from their defaults that an OpenEnv environment does not read."""
    given, default = environment.model_dump(), type(environment)().model_dump()

    def walk(value: Any, base: Any, prefix: str) -> list[str]:
        if isinstance(value, dict) and isinstance(base, dict):
            return [k for key in sorted(set(value) | set(base))
                    for k in walk(value.get(key), base.get(key), f"{prefix}.{key}" if prefix else key)]
        return [] if value == base else [prefix]

    return [f"environment.{k}" for k in walk(given, default, "")
            if not any(k == r or k.startswith(f"{r}.") for r in READ)]


def list_tasks(split: str, cfg: Any = None) -> list[Task]:
    """``seed-N`` tasks of ``split`` (``train``; ``eval`` or ``test``), as many as the config's task counts."""
    environment = getattr(cfg, "environment", None)
    if split == "train":
        count, base = (environment.num_train_tasks if environment is not None else 256), 0
    elif split in ("eval", "test"):
        count, base = (environment.num_eval_tasks if environment is not None else 64), EVAL_SEED_BASE
    else:
        raise ValueError(f"split must be 'train' or 'eval' (or 'test'), got {split!r}")
    return [Task(id=f"seed-{base + i}", split="train" if split == "train" else "eval", kind="openenv",
                 data={"seed": base + i}) for i in range(count)]


def make_env(target: str, cfg: Any = None) -> Any:
    """The first episode of ``target``'s environment (its servers started); the others are ``spawn()``ed from it."""
    if not available():
        raise ValueError(f"environment.name 'openenv:{target}' needs openenv-core, which is not installed; "
                         f"{INSTALL_HINT}")
    from tether.config.openenv import OpenEnvConfig  # noqa: PLC0415 — light, but only when selected
    from tether.env.openenv.env import OpenEnvEpisode  # noqa: PLC0415 — as above
    from tether.env.openenv.pool import ServerPool  # noqa: PLC0415 — as above

    environment = getattr(cfg, "environment", None)
    if environment is not None:
        bad = unread_keys(environment)
        if bad:
            raise ValueError(f"{', '.join(bad)}: not read by OpenEnv environments (environment.name "
                             f"{environment.name!r}); remove them")
    oc = (environment.openenv if environment is not None else None) or OpenEnvConfig()
    return OpenEnvEpisode(ServerPool(target, oc), oc)


def environment(target: str) -> tuple[Callable[[Any], Any], Callable[[str, Any], list[Task]]]:
    """``(make_env(cfg), list_tasks(split, cfg))`` of the OpenEnv environment ``target`` names."""
    if not target:
        raise ValueError("environment.name 'openenv:': name a server URL or an app, e.g. 'openenv:http://host:8000' "
                         "or 'openenv:my_env/server/app.py'")
    return (lambda cfg: make_env(target, cfg)), list_tasks
