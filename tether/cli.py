"""The ``tether`` command line. Each command is a function on ``app``; add one with ``@app.command()``.

Bad input (a config error) exits with code 2 and a one-paragraph message on stderr, never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax

from tether.config import ConfigError, RunConfig, load_config

app = typer.Typer(
    help="Agentic RL for tool-using LLMs that tells you whether the run is learning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Files = Annotated[list[Path], typer.Argument(help="YAML config files, merged in order (later wins).")]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override one key, e.g. --set learner.batch_size=32 (value parsed as YAML)."),
]


@app.callback()
def main() -> None:
    """tether: train, evaluate and verify tool-using agents."""  # keeps `tether CMD` form with one command


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` to stderr as an error and return the Exit to raise."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def load_or_exit(files: list[Path], overrides: list[str] | None) -> RunConfig:
    """The merged config, or exit 2 with the error (for every command that takes configs)."""
    try:
        return load_config(files, overrides or ())
    except ConfigError as e:
        raise fail(str(e)) from None


@app.command()
def config(files: Files, set_: Overrides = None) -> None:
    """Validate and merge config FILES, then print the resolved config as YAML (secrets redacted)."""
    cfg = load_or_exit(files, set_)
    keys = [s.partition("=")[0] for s in set_ or ()]  # values could be secrets: never echo them
    header = f"# resolved from: {', '.join(map(str, files))}" + "".join(f" --set {k}" for k in keys)
    derived = ", ".join(f"{k}={v}" for k, v in cfg.derived().items())
    text = f"{header}\n# derived: {derived}\n{cfg.to_yaml()}"
    console = Console(soft_wrap=True)
    if console.is_terminal:
        console.print(Syntax(text, "yaml", background_color="default", word_wrap=False))
    else:  # piped: plain text that loads back as YAML
        typer.echo(text, nl=False)
