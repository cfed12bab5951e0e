"""A criterion checked on every row of a run's ``metrics.jsonl``, and the report of a set of them.

Shared by ``verify optim`` and ``verify async``: each builds ``Criterion``s (what must hold, as a predicate on
one number per step), fills their values from the rows, and ``render`` prints the table of pass/fail counts, the
steps that failed and, for each failed criterion, its diagnosis and the config keys that remedy it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tether.metrics import read_jsonl_rows

Rows = dict[int, dict[str, float]]  # step → that step's metrics row


class VerifyInputError(ValueError):
    """The run directory or config cannot be verified (missing or unreadable files): exit 2."""


@dataclass
class Criterion:
    """``holds(value)`` must be true for each step's value (``on_mean``: for the mean over the steps); with a
    ``tolerance``, the criterion still passes when at most that fraction of the checked steps fail."""

    name: str  # as printed, e.g. "optim/grad_norm in [0.1, 10]"
    holds: Callable[[float], bool]  # NaN fails every comparison, so a NaN value fails
    diagnosis: str  # what a failure means
    remedy: str  # the config keys (and actions) that address it
    on_mean: bool = False
    tolerance: float = 0.0
    values: dict[int, float] = field(default_factory=dict)  # step → value, only the steps it was checked on
    note: str = ""  # why it was not checked, when it was not

    @property
    def mean(self) -> float:
        return math.fsum(self.values.values()) / len(self.values) if self.values else math.nan

    @property
    def failed_steps(self) -> list[int]:
        if self.on_mean:
            return [] if not self.values or self.holds(self.mean) else sorted(self.values)
        return [s for s, v in sorted(self.values.items()) if not self.holds(v)]

    @property
    def passed(self) -> bool:
        return len(self.failed_steps) <= self.tolerance * len(self.values)

    def fill(self, rows: Rows, key: str) -> None:
        """The values of metric ``key`` on the rows that have it."""
        self.values = {s: float(r[key]) for s, r in rows.items() if key in r}
        if not self.values and not self.note:
            self.note = f"no row has {key}"


@dataclass
class Report:
    title: str
    criteria: list[Criterion]
    notes: list[str] = field(default_factory=list)  # printed under the table (context, not verdicts)

    @property
    def checked(self) -> list[Criterion]:
        return [c for c in self.criteria if c.values]

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self.criteria)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def read_rows(run_dir: Path, steps: int | None = None) -> Rows:
    """The training rows of ``run_dir/metrics.jsonl`` (steps ≥ 1, the last row of a step when a resumed run
    wrote it twice), the first ``steps`` steps only when given."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise VerifyInputError(f"{path} does not exist: give a run directory (`tether train --run-dir DIR`)")
    read, bad = read_jsonl_rows(path)
    if bad:
        n, line = bad[0]
        raise VerifyInputError(f"{path}:{n} is not a metrics row (a JSON object with a step): {line[:80]}")
    rows: Rows = {}
    for row in read:
        step = row.pop("step")
        if step >= 1 and (steps is None or step <= steps):
            rows[step] = row
    if not rows:
        raise VerifyInputError(f"{path} has no training step" + (f" within the first {steps}" if steps else ""))
    return rows


def _steps(steps: list[int], most: int = 12) -> str:
    shown = ", ".join(map(str, steps[:most]))
    return shown + (f", … (+{len(steps) - most})" if len(steps) > most else "")


def render(report: Report, console: Console | None = None) -> None:
    """Print the table, the notes, a diagnosis and remedy per failed criterion, and the verdict."""
    if console is None:
        console = Console(soft_wrap=True, highlight=False)
        if not console.is_terminal:  # piped or captured: a width the table fits, not 80 columns
            console.width = 160
    table = Table(title=report.title, title_justify="left")
    for col in ("criterion", "steps", "pass", "fail", "failed steps"):
        table.add_column(col)
    for c in report.criteria:
        if not c.values:
            table.add_row(escape(c.name), "0", "-", "-", escape(f"not checked: {c.note}"))
            continue
        failed = c.failed_steps
        detail = _steps(failed) if failed else ""
        if c.on_mean:
            detail = f"mean {c.mean:.3g} over the steps" + (" (fails)" if failed else "")
        elif failed and c.tolerance:
            detail += f" ({'within' if c.passed else 'above'} the {c.tolerance:.0%} of steps allowed)"
        table.add_row(escape(c.name), str(len(c.values)), str(len(c.values) - len(failed)), str(len(failed)),
                      escape(detail))
    console.print(table)
    for note in report.notes:
        console.print(escape(note))
    bad = [c for c in report.criteria if not c.passed]
    for c in bad:
        worst = ", ".join(f"step {s}: {c.values[s]:.3g}" for s in c.failed_steps[:3])
        console.print(f"[bold red]✗ {escape(c.name)}[/] ({escape(worst)})\n  diagnosis: {escape(c.diagnosis)}\n"
                      f"  remedy: {escape(c.remedy)}")
    n = len(report.checked)
    if report.ok:
        console.print(f"[bold green]ok:[/] all {n} criteria checked hold")
    else:
        console.print(f"[bold red]failed:[/] {len(bad)} of {n} criteria checked do not hold")
