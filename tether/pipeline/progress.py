"""What a person watching a run sees: a rich progress bar (step, reward, success rate, samples/s) and, at each
evaluation, two lines (held-out success, and what the policy did on the first task) or, asked for, a table of sample
rollouts — and what a person grepping it later reads: the run's log, ``RUN/train.log`` (warnings, monitor findings,
one ``parameter sync: param_version=N`` line per weight sync). Every conversation of an evaluation is in
``RUN/validation/step_N.jsonl`` (``validation.py``), so the terminal shows only enough to see that the run moves."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

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
    """``samples``: the conversations shown at each evaluation — 0: two lines, the figures and the first task's
    actions; N: a table of the first N (``show_eval``)."""

    def __init__(self, total_steps: int, start: int = 0, *, enabled: bool = True, console: Console | None = None,
                 samples: int = 0):
        self.enabled, self.samples = enabled, samples
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
            self.console.print(f"[dim]{escape(text)}[/dim]", soft_wrap=True)  # the terminal wraps it, between words

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

    def eval_table(self, where: str, metrics: dict[str, float], tasks: list[Task], trajs: list[Trajectory]) -> None:
        """One evaluation as ``samples`` asks (``show_eval``); ``where``: which weights ("step 8")."""
        if self.enabled:
            show_eval(self.console, where, metrics, tasks, trajs, self.samples)

    def close(self) -> None:
        if self.enabled:
            self._bar.stop()


def show_eval(console: Console, where: str, metrics: dict[str, float], tasks: list[Task], trajs: list[Trajectory],
              rows: int = 0) -> None:
    """The held-out figures of one evaluation of the weights ``where`` ("step 8", a checkpoint), then its first
    ``rows`` conversations as a table; with 0 rows, one line of the first task's instead: its outcome and the
    policy's side of the conversation, cut to the terminal's width — the first task every time, so that successive
    evaluations show the same task changing."""
    headline = (f"eval @ {where}: success {metrics['eval/success_rate']:.1%} ({sum(t.success for t in trajs)}/"
                f"{len(trajs)}), reward {metrics['eval/reward_mean']:.3f}")
    if rows > 0:
        table = Table(title=headline, show_lines=True)
        for col in ("task", "kind", "reward", "ok", "end", "conversation"):
            table.add_column(col, overflow="fold")
        for task, tr in list(zip(tasks, trajs))[:rows]:
            convo = transcript(replace(tr, messages=[m for m in tr.messages if m.get("role") != "system"]))
            table.add_row(task.id, task.kind, f"{tr.reward:.2f}", "✓" if tr.success else "✗", tr.termination,
                          convo[-600:])
        console.print(table)
        return
    console.print(Text(headline), soft_wrap=True)
    if tasks and trajs:
        task, tr = tasks[0], trajs[0]
        acts = " → ".join(_act(m) for m in tr.messages if m.get("role") == "assistant") or "(no reply)"
        line = (f"  e.g. {task.id} ({task.kind}) {'✓' if tr.success else '✗'} {tr.reward:.2f}, "
                f"{tr.termination or 'ended'}: {acts}")
        console.print(Text(line, style="dim"), no_wrap=True, overflow="ellipsis")


@contextmanager
def sft_bar(total: int, console: Console | None = None
            ) -> Iterator[tuple[Callable[[Trajectory, object], Trajectory], Callable[[str], None]]]:
    """A bar on stderr counting the demonstrations ``sft`` trains on (``total``: epochs × demonstrations), and the
    log for its epoch lines, printed above the bar. Yields ``(seen, log)`` for ``sft(augment=seen, log=log)``:
    ``sft`` (tether.learner.sft) has no per-batch callback, and its ``augment`` hook sees each demonstration as it
    is batched — ``seen`` counts it and returns it unchanged, drawing nothing from the generator, so the run is
    the one without it."""
    console = console or Console(stderr=True)
    bar = RichProgress(TextColumn("[bold]sft"), MofNCompleteColumn(), TextColumn("demonstrations"), BarColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True)
    task = bar.add_task("sft", total=total)

    def seen(traj: Trajectory, _rng: object) -> Trajectory:
        bar.advance(task)
        return traj

    with bar:
        yield seen, lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)


def _act(message: dict) -> str:
    """One assistant turn in a few words: its tool calls as ``name({arguments})``, then its text quoted."""
    parts = [f"{c['function']['name']}({json.dumps(c['function']['arguments'], ensure_ascii=False)})"
             for c in message.get("tool_calls") or []]
    text = (message.get("content") or "").strip()
    if text or not parts:
        parts.append(json.dumps(text, ensure_ascii=False))
    return " ".join(parts)
