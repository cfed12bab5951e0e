"""What every command of the ``tether`` CLI shares (``cli.py`` and ``verify/cli.py`` both import it): the option
types, the error exit, loading the configs, the checks of a checkpoint folder and a run directory, how a failed
training run ends (``run_failed``, ``resume_command``), and the last resort for an exception no command caught
(``Group``).

No traceback reaches the terminal. Bad input exits with code 2 and a one-paragraph message on stderr (``fail``);
any other failure exits 1 with one line ``error: <Type>: <message>`` and its traceback written to a file: a run's
``RUN/train.log`` (``tether train``), else a new ``tether-<time>-<pid>.log`` in the temp folder, whose path the line
names. Light on purpose: ``tether --help`` imports this (no torch, no transformers).
"""

from __future__ import annotations

import errno
import inspect
import os
import shlex
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup
from typer.exceptions import TyperException

from tether.config import ConfigError, RunConfig, load_config
from tether.config.io import parse_override, read_yaml
from tether.env.plugin.registry import search_beside
from tether.llm.errors import LLMError
from tether.pipeline.progress import log_failure
from tether.pipeline.run_lock import RunDirInUse
from tether.secrets import looks_secret, redacted

Files = Annotated[list[Path], typer.Argument(help="YAML config files, merged in order (later wins).")]
Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override one key, e.g. --set learner.batch_size=32 (value parsed as YAML)."),
]


def say(message: str) -> None:
    """One line on stderr before a slow phase of a command (loading a model, replaying demonstrations, a short
    run), so that a newcomer never watches a silent terminal; stdout stays the command's result."""
    typer.echo(message, err=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` to stderr as an error and return the Exit to raise."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def is_bad_input(error: BaseException) -> bool:
    """Whether a failure is the input's fault (exit 2) rather than the run's (exit 1): a config error, a ValueError
    (what the run's checks of its run directory, tasks, environment and checkpoints raise), a missing file, a feature
    the config asks for that is not built, an endpoint key that is missing or malformed (nothing was sent)."""
    return (isinstance(error, ConfigError | ValueError | FileNotFoundError | NotImplementedError)
            or (isinstance(error, LLMError) and error.config_fault))


def save_traceback(error: BaseException, log: Path | None = None, what: str = "the command failed") -> Path | None:
    """Append ``error``'s traceback to ``log`` (a run's train.log), or to a new file in the temp folder when there is
    no log or it cannot be written (a full disk); returns the file, None when none could be written."""
    temp = Path(tempfile.gettempdir()) / f"tether-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for path in (log, temp):
        if path is not None:
            try:
                log_failure(path, error, what)
                return path
            except OSError:
                continue
    return None


def crash(error: BaseException) -> typer.Exit:
    """An exception no command caught, as one line: bad input exits 2; anything else exits 1 naming the file that
    holds its traceback."""
    if is_bad_input(error):
        return fail(str(error))
    where = save_traceback(error)
    return fail(f"{type(error).__name__}: {error} (traceback: {where or 'not saved: the temp folder is not writable'})",
                code=1)


def resume_command(files: list[Path], overrides: list[str] | None, run_dir: Path) -> str:
    """The ``tether train … --resume`` that continues ``run_dir`` (a literal secret among the overrides shown as …)."""
    shown = []
    for o in overrides or ():
        key, _, value = o.partition("=")
        if looks_secret(key) and redacted(value) != value:  # a literal secret is never echoed; a ${VAR} may be
            o = f"{key}=…"
        shown.append(o)
    return " ".join(["tether train", *(shlex.quote(str(f)) for f in files), *(f"--set {shlex.quote(o)}" for o in shown),
                     f"--run-dir {shlex.quote(str(run_dir))}", "--resume"])


def stamp(path: Path) -> tuple[int, int] | None:
    """``path``'s inode and mtime (None: absent): whether a run rewrote its config.yaml."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def run_failed(error: Exception, resume: str, run_dir: Path, last: Path | None, *, wrote: bool,
                fresh: bool) -> typer.Exit:
    """How a failed run ends. Bad input (a ConfigError, a ValueError, a missing key variable) exits 2 with its one
    line, and a refusal before the run wrote anything writes nothing; once the run has written (``wrote``: its
    config.yaml), its traceback is appended to RUN/train.log, and a run this call started (``fresh``) gets the
    command that resumes it. Any other failure (an endpoint lost, a full disk, every episode failing, a bug) exits 1
    with ``error: <Type>: <message>``, the last complete checkpoint and the resume command, its traceback in
    RUN/train.log (or, with no run directory or a full disk, a file in the temp folder that the first line names).
    A run refused because another holds the directory writes nothing there. No traceback reaches the terminal."""
    log = run_dir / "train.log" if run_dir.is_dir() else None
    if isinstance(error, RunDirInUse):  # the directory and its train.log are another live run's: write nothing
        return fail(str(error))
    if is_bad_input(error):
        if wrote:
            save_traceback(error, log, "the run failed")
        return fail(str(error) + (f"\n{run_dir} holds this run now: after the fix, resume with: {resume}"
                                  if wrote and fresh else ""))
    where = save_traceback(error, log, "the run failed")
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:  # the last complete checkpoint stands
        said = f"no space left on the device of {run_dir} ({error.filename or 'while writing'}); free space"
    else:
        said = f"{type(error).__name__}: {error}"
    said += f" (traceback: {where or 'not saved: nowhere to write it'})"
    if not (run_dir / "config.yaml").is_file():  # failed before the run wrote anything: nothing to resume
        return fail(said, code=1)
    return fail(f"{said}\nlast complete checkpoint: {last or 'none'}\nresume with: {resume}", code=1)


class Group(TyperGroup):
    """The ``tether`` app's command group: every command runs inside the last resort (``crash``), and every help
    text is reflowed (``reflow``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        reflow(self)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (TyperException, typer.Exit, typer.Abort):  # usage errors, exits, aborts: typer shows them
            raise
        except Exception as e:  # noqa: BLE001 — the last resort: one line on the terminal, the traceback in a file
            raise crash(e) from None


def reflow(group: TyperGroup) -> None:
    """Join the lines of each paragraph of the help of ``group`` and of its commands (and sub-groups'), in place.
    Typer's rich help keeps a docstring's line breaks, so a paragraph broken at the source's 120 columns came out
    broken mid-sentence, between lines the terminal had wrapped already; rich wraps the joined paragraph itself."""
    for command in (group, *group.commands.values()):
        if command.help:
            command.help = "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(command.help).split("\n\n"))
        if isinstance(command, TyperGroup) and command is not group:
            reflow(command)


def load_or_exit(files: list[Path], overrides: list[str] | None) -> RunConfig:
    """The merged config, or exit 2 with the error (for every command that takes configs). An import path the
    config names (``environment.name: my_env:environment``) is looked for beside these files too.

    Before any file is read, each ``--set`` must be ``key=value``: ``--set KEY VALUE`` (a space for the ``=``)
    makes VALUE a config file, and VALUE may be a key. The only config file empty is refused (the run would be all
    defaults); an empty one among several is allowed (an overlay left empty)."""
    try:
        for text in overrides or ():
            parse_override(text)
        if len(files) == 1 and not read_yaml(files[0]):
            raise ConfigError(f"{files[0]} is empty: it sets no key, so every key would take its default; write "
                              "the config in it, or give the config files you meant")
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
    """Exit 2 unless ``checkpoint`` is a Hugging Face model folder, or a LoRA checkpoint (an adapter in peft's
    format: ``adapter_config.json``), with readable weights."""
    if not (checkpoint / "config.json").is_file() and not (checkpoint / "adapter_config.json").is_file():
        raise fail(f"{checkpoint} is not a checkpoint folder (no config.json or adapter_config.json); {hint}")
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
