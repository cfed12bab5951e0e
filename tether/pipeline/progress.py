"""What a person watching a run sees: a rich progress bar (step, reward, success rate, samples/s) and,
at each evaluation, a small table of sample rollouts — and what a person grepping it later reads: the run's log,
``RUN/train.log`` (warnings, monitor findings, one ``parameter sync: param_version=N`` line per weight sync)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from tether.agent.loop import transcript
from tether.types import Task, Trajectory

RUN_LOG = logging.getLogger("tether.run")  # the run's own log: RUN/train.log while a run is open, else nowhere
RUN_LOG.addHandler(logging.NullHandler())
RUN_LOG.propagate = False
RUN_LOG.setLevel(logging.INFO)


LOG_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(message)s")


def log_to_file(path: Path) -> Callable[[], None]:
    """Append the run's log (and the warnings of the rest of tether) to ``path``; returns the undo."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(LOG_FORMAT)
    handler.setLevel(logging.INFO)
    for logger in (RUN_LOG, logging.getLogger("tether")):
        logger.addHandler(handler)

    def close() -> None:
        for logger in (RUN_LOG, logging.getLogger("tether")):
            logger.removeHandler(handler)
        handler.close()
    return close


def log_failure(path: Path, error: BaseException, what: str = "the run failed") -> None:
    """Append ``error`` and its traceback to ``path`` (``RUN/train.log``) in the log's format. The command line
    writes it once the failure has left the run, whose own handler (``log_to_file``) is closed by then; an OSError
    (a full disk) is raised, not swallowed the way a logging handler would (printing its own traceback)."""
    record = logging.LogRecord(RUN_LOG.name, logging.ERROR, __file__, 0, "%s: %s: %s",
                               (what, type(error).__name__, error), (type(error), error, error.__traceback__))
    with path.open("a", encoding="utf-8") as f:
        f.write(LOG_FORMAT.format(record) + "\n")


class Progress:
    def __init__(self, total_steps: int, start: int = 0, *, enabled: bool = True, console: Console | None = None):
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._bar = RichProgress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, disable=not enabled,
        )
        self._task = self._bar.add_task("train", total=total_steps, completed=start, stats="")
        if enabled:
            self._bar.start()

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(f"[dim]{text}[/dim]")

    def warn(self, text: str) -> None:
        """Shown even when the progress bar is off: a warning is for the person running the job. Not wrapped, so
        that a path or key in it stays whole for grep and for copying."""
        self.console.print(f"[bold yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)
        RUN_LOG.warning(text)

    def update(self, step: int, row: dict[str, float]) -> None:
        stats = (f"reward {row.get('reward/mean', float('nan')):.3f}  "
                 f"success {row.get('rollout/success_rate', float('nan')):.2f}  "
                 f"{row.get('perf/samples_per_s', float('nan')):.1f} samples/s")
        self._bar.update(self._task, completed=step, stats=stats)

    def eval_table(self, where: str, metrics: dict[str, float], tasks: list[Task], trajs: list[Trajectory],
                   rows: int = 3) -> None:
        """The held-out figures and the first ``rows`` conversations; ``where``: which weights ("step 8", or the
        checkpoint ``tether eval`` evaluates)."""
        if not self.enabled:
            return
        table = Table(title=f"eval @ {where}: success {metrics['eval/success_rate']:.2%}, "
                            f"reward {metrics['eval/reward_mean']:.3f}", show_lines=True)
        for col in ("task", "kind", "reward", "ok", "end", "conversation"):
            table.add_column(col, overflow="fold")
        for task, tr in list(zip(tasks, trajs))[:rows]:
            convo = transcript(tr).split("\n", 1)[-1]  # drop the system prompt
            table.add_row(task.id, task.kind, f"{tr.reward:.2f}", "✓" if tr.success else "✗", tr.termination,
                          convo[-600:])
        self.console.print(table)

    def close(self) -> None:
        if self.enabled:
            self._bar.stop()
