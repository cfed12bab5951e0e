"""What every command of the ``tether`` CLI shares (``cli.py`` and ``verify/cli.py`` both import it): the option
types, the error exit, loading the configs, the checks of a checkpoint folder and a run directory.

Bad input exits with code 2 and a one-paragraph message on stderr (``fail``), never a traceback. Light on
purpose: ``tether --help`` imports this (no torch, no transformers).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from tether.config import ConfigError, RunConfig, load_config
from tether.env.plugin.registry import search_beside

Files = Annotated[list[Path], typer.Argument(help="YAML config files, merged in order (later wins).")]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override one key, e.g. --set learner.batch_size=32 (value parsed as YAML)."),
]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` to stderr as an error and return the Exit to raise."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def load_or_exit(files: list[Path], overrides: list[str] | None) -> RunConfig:
    """The merged config, or exit 2 with the error (for every command that takes configs). An import path the
    config names (``environment.name: my_env:environment``) is looked for beside these files too."""
    try:
        cfg = load_config(files, overrides or ())
    except ConfigError as e:
        raise fail(str(e)) from None
    search_beside(files)
    return cfg


def check_weights(folder: Path) -> None:
    """Exit 2 naming the first ``*.safetensors`` file of ``folder`` whose header cannot be read (a torn or
    corrupt checkpoint), instead of a traceback from deep inside ``from_pretrained``."""
    from safetensors import safe_open  # noqa: PLC0415 — only commands that load weights pay for it

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 — SafetensorError, OSError: all mean "this file is unusable"
            raise fail(f"{path} is not a readable safetensors file ({e}); the checkpoint is corrupt or "
                       f"incomplete") from None


def check_checkpoint(checkpoint: Path, hint: str = "pass RUN/checkpoints/step_N") -> None:
    """Exit 2 unless ``checkpoint`` is a Hugging Face model folder with readable weights."""
    if not (checkpoint / "config.json").is_file():
        raise fail(f"{checkpoint} is not a checkpoint folder (no config.json); {hint}")
    check_weights(checkpoint)


def check_run_dir(run_dir: Path) -> None:
    """Exit 2 when ``run_dir`` is a file or cannot be written (checked before anything is written)."""
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise fail(f"--run-dir {run_dir}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise fail(f"--run-dir {run_dir} is not writable ({probe}: permission denied or a read-only file system)")
