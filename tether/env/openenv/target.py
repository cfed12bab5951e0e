"""What ``environment.name: openenv:<target>`` names: a running server (``http(s)://`` or ``ws(s)://`` URL) or an app
tether serves itself (``server.AppSpec``):

- ``path/to/file.py`` (or ``file.py:attribute``) — the module of that file, its ``app`` (or ``attribute``);
- ``path/to/folder`` — an OpenEnv environment folder: the ``app:`` of its ``openenv.yaml`` (``openenv init``'s
  layout, ``server.app:app``), else ``server/app.py``'s or ``app.py``'s ``app``, imported from the folder;
- ``package.module`` (or ``package.module:attribute``) — a module importable here, its ``app`` (or ``attribute``).

A relative path is looked for in the current directory, then beside the config files (``tether train
examples/openenv_env/config.yaml`` finds ``guess_server.py`` from any directory), as import paths are
(``tether.env.plugin.registry``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import yaml

from tether.env.openenv.server import AppSpec
from tether.env.plugin.registry import _BESIDE

URL_SCHEMES = ("http://", "https://", "ws://", "wss://")


def is_url(target: str) -> bool:
    return target.startswith(URL_SCHEMES)


def _folders() -> list[Path]:
    return [Path(d) for d in dict.fromkeys([os.getcwd(), *_BESIDE])]


def _find(path: str) -> Path | None:
    p = Path(path).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    for folder in _folders():
        if (folder / p).exists():
            return (folder / p).resolve()
    return None


def _folder_app(folder: Path) -> AppSpec:
    manifest = folder / "openenv.yaml"
    if manifest.is_file():
        app = (yaml.safe_load(manifest.read_text()) or {}).get("app")
        if isinstance(app, str) and ":" in app:
            return AppSpec(app, folder)
    for rel, module in (("server/app.py", "server.app"), ("app.py", "app")):
        if (folder / rel).is_file():
            return AppSpec(f"{module}:app", folder)
    raise ValueError(f"environment.name openenv:{folder}: the folder has no openenv.yaml with an 'app:', no "
                     "server/app.py and no app.py; name the file that creates the OpenEnv app")


def app_spec(target: str) -> AppSpec:
    """The app ``target`` names (module docstring); ValueError saying what was looked for when it names none."""
    base, sep, attr = target.rpartition(":") if target.count(":") == 1 else (target, "", "")
    if not sep:
        base, attr = target, "app"
    if base.endswith(".py") or "/" in base or os.sep in base or base in (".", ".."):
        found = _find(base)
        if found is None:
            raise ValueError(f"environment.name openenv:{target}: {base} is not a file or folder here or beside the "
                             f"config ({', '.join(map(str, _folders()))})")
        if found.is_dir():
            return _folder_app(found)
        return AppSpec(f"{found.stem}:{attr}", found.parent)
    top = base.split(".")[0]
    if importlib.util.find_spec(top) is not None:
        return AppSpec(f"{base}:{attr}", Path(os.getcwd()))
    for folder in _folders():
        if (folder / top).is_dir() or (folder / f"{top}.py").is_file():
            return AppSpec(f"{base}:{attr}", folder)
    raise ValueError(f"environment.name openenv:{target}: no module {top!r} on sys.path, here or beside the config; "
                     "give a URL of a running server, a module, a .py file or an OpenEnv environment folder")
