"""``tether report RUN_DIR``: the run's metrics as plots a person would rather look at than read.

Reads ``RUN/metrics.jsonl`` (one row per step) and writes one PNG per figure under ``RUN/report/`` and one
self-contained page, ``RUN/report/index.html`` (the PNGs embedded as base64, so the page can be mailed or
attached alone), with a summary table and the validation generations of ``RUN/validation/`` listed.

A figure is drawn only when one of its metrics was recorded (no queue counters in ``sync`` mode, no
``monitor/*`` without monitors). A run still in progress is fine: the last line of its metrics.jsonl may be
half written, and is skipped with a note, as is any other line that is not a JSON row with a step.

Plots use matplotlib's object API (``matplotlib.figure.Figure``, rendered by the Agg canvas), never pyplot: no
global backend is chosen, no display is needed, and building a report inside a training process leaves no
state behind.
"""

from __future__ import annotations

import base64
import html
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from tether.metrics import read_jsonl_rows

FIG_INCHES, DPI = (10.0, 4.0), 100
FIG_PX = (int(FIG_INCHES[0] * DPI), int(FIG_INCHES[1] * DPI))  # (width, height) of every PNG


class ReportError(ValueError):
    """A run directory a report cannot be built from (the message says why)."""


@dataclass
class RunMetrics:
    """The rows of a metrics.jsonl, the notes on lines skipped, and the run's recorded config (may be empty)."""

    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return sorted({k for r in self.rows for k in r if k != "step"})

    def matching(self, pattern: str) -> list[str]:
        """The recorded keys that ``pattern`` (a regular expression) matches in full."""
        return [k for k in self.keys if re.fullmatch(pattern, k)]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that hold ``key``; a non-finite value becomes a gap (NaN)."""
        steps, values = [], []
        for r in self.rows:
            if isinstance(r.get(key), int | float):
                steps.append(int(r["step"]))
                values.append(float(r[key]) if math.isfinite(r[key]) else math.nan)
        return steps, values

    def setting(self, dotted: str) -> Any:
        """A value of the recorded config.yaml by its dotted key, or None."""
        node: Any = self.config
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node


def read_metrics(run_dir: str | Path) -> RunMetrics:
    """The metrics of ``run_dir``; a line that is not a JSON row with a step is skipped and noted."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist: is {run_dir} a run directory (tether train --run-dir)?")
    rows, bad = read_jsonl_rows(path)
    last = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
    notes = [f"metrics.jsonl: skipped {'the last line (still being written?)' if n == last else f'line {n}'}, "
             f"not a JSON row with a step ({line[:60]!r})" for n, line in bad]
    config: dict[str, Any] = {}
    if (run_dir / "config.yaml").is_file():

        try:
            config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        except yaml.YAMLError as e:
            notes.append(f"config.yaml: unreadable, left out ({str(e).splitlines()[0]})")
    return RunMetrics(sorted(rows, key=lambda r: int(r["step"])), notes, config)


# -- figures -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plot:
    """One figure: side-by-side axes, each drawing the recorded metrics its regular expressions match."""

    name: str  # the PNG's file name, without .png
    title: str
    axes: tuple[tuple[str, tuple[str, ...]], ...]  # (axes title, metric patterns)
    caption: str  # what to look for, in a sentence
    refs: tuple[tuple[str, float | str], ...] = ()  # (label, a constant or a config key): dashed lines, first axes
    histogram: str | None = None  # a metric whose per-step values also get a histogram (integer bins)


PLOTS = (
    Plot("success_reward", "Success and reward",
         (("success rate", (r"eval/success_rate", r"rollout/success_rate")),
          ("held-out success rate by task kind", (r"eval/success_rate/.+",)),
          ("reward", (r"reward/mean", r"eval/reward_mean"))),
         "Held-out success (eval, at each evaluation) should rise with the training reward; reward up while "
         "success stays flat is the mark of reward hacking. A kind stuck at 0 is a skill the policy lacks."),
    Plot("learning_signal", "Learning signal",
         (("advantage std", (r"optim/advantage_std.*", r"optim/.*reward_std.*")),
          ("degenerate group ratio", (r"optim/degenerate_group_ratio.*",))),
         "Advantage std near 0 or a degenerate ratio near 1: the groups' rollouts all score alike and there is "
         "nothing to learn from (raise min_reward_std / resample_attempts, or the tasks are too easy or too hard).",
         refs=(("tether verify optim threshold", 0.1),)),
    Plot("kl_entropy", "KL and entropy",
         (("KL divergence (nats / token)", (r"optim/kl_divergence",)), ("entropy", (r"optim/entropy",))),
         "KL climbing towards max_kl: the policy drifts too fast (lower the learning rate, tighten clip_ratio). "
         "Entropy collapsing early: exploration is gone.",
         refs=(("max_kl", "policy_optimization.kl_control.max_kl"),)),
    Plot("staleness", "Staleness",
         (("policy version lag", (r"rollout/policy_version_lag_mean", r"rollout/policy_version_lag_max")),),
         "How many weight versions behind the learner the trained tokens were sampled; it must stay within "
         "rollout.scheduler.max_staleness.", refs=(("max_staleness", "rollout.scheduler.max_staleness"),),
         histogram="rollout/policy_version_lag_max"),
    Plot("queue", "Queue counters", (("samples", (r"queue/.+",)),),
         "Produced = consumed + dropped + stale + queued; a growing queue means the trainer cannot keep up."),
    Plot("idle", "Idle ratios", (("fraction of step time idle", (r"perf/trainer_idle_ratio",
                                                                 r"perf/rollouter_idle_ratio")),),
         "Both sides should be busy: a trainer idle most of the step waits on rollouts (add workers or raise "
         "staleness), a rollouter idle most of the step waits on the trainer."),
    Plot("reward_components", "Reward components",
         (("mean per trajectory", (r"reward/(?!mean$|std$)[^/]+",)),),
         "The verifier's components (weighted into the reward): which part of the task the policy learns."),
    Plot("monitors", "Monitor events",
         (("monitors", (r"monitor/.+",)), ("anti-hacking flags per step", (r"reward/hacking/.+",))),
         "The training monitors' metrics and the anti-hacking detectors' flags: any rise deserves a look at the "
         "validation generations of that step."),
)


def _draw(m: RunMetrics, plot: Plot) -> Figure | None:
    present = [(title, [k for p in pats for k in m.matching(p)]) for title, pats in plot.axes]
    present = [(title, keys) for title, keys in present if keys]
    if not present:
        return None
    hist = [v for v in m.series(plot.histogram)[1] if not math.isnan(v)] if plot.histogram else []
    fig = Figure(figsize=FIG_INCHES, dpi=DPI, layout="constrained")
    wide = len(present) + bool(hist)
    for i, (title, keys) in enumerate(present):
        ax = fig.add_subplot(1, wide, i + 1)
        for key in keys:
            steps, values = m.series(key)
            ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, linewidth=1.2,
                    label=key)
        for label, ref in plot.refs if i == 0 else ():
            value = m.setting(ref) if isinstance(ref, str) else ref
            if isinstance(value, int | float):
                ax.axhline(value, color="red", linestyle="--", linewidth=1, label=f"{label} {value:g}")
        if all(re.search(r"(success|idle|degenerate_group)_ratio|success_rate", k) for k in keys):
            ax.set_ylim(-0.03, 1.03)  # a fraction: the whole range, so 0.50 → 0.52 does not look like a leap
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    if hist:
        ax = fig.add_subplot(1, wide, wide)
        ax.hist(hist, bins=[b - 0.5 for b in range(int(max(hist)) + 2)], color="tab:purple", edgecolor="white")
        ax.set_title(f"steps by {plot.histogram}", fontsize=10)
        ax.set_xlabel("value")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("steps")
    fig.suptitle(plot.title)
    return fig


def _save_png(fig: Figure, path: Path) -> None:
    _atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=DPI))


# -- the page ----------------------------------------------------------------------------------------------

def summary(m: RunMetrics) -> list[tuple[str, str]]:
    """The summary table's rows: steps, final and best held-out success, last reward, status."""
    out = []
    last = int(m.rows[-1]["step"]) if m.rows else 0
    total = m.setting("trainer.total_steps")
    done = isinstance(total, int) and last >= total
    out.append(("steps", f"{last}" + (f" of {total}" if isinstance(total, int) else "")
                + ("" if done or not isinstance(total, int) else " (in progress, or stopped)")))
    steps, success = m.series("eval/success_rate")
    pairs = [(s, v) for s, v in zip(steps, success) if not math.isnan(v)]
    if pairs:
        first, final = pairs[0], pairs[-1]
        best = max(pairs, key=lambda p: p[1])
        out.append(("held-out success, first", f"{first[1]:.1%} (step {first[0]})"))
        out.append(("held-out success, final", f"{final[1]:.1%} (step {final[0]})"))
        out.append(("held-out success, best", f"{best[1]:.1%} (step {best[0]})"))
    steps, reward = m.series("reward/mean")
    if steps:
        out.append(("train reward, last step", f"{reward[-1]:.3f} (step {steps[-1]})"))
    if mode := m.setting("rollout.mode"):
        out.append(("rollout.mode", str(mode)))
    return out


@dataclass
class Report:
    index: Path
    figures: list[Path]
    notes: list[str]


def build_report(run_dir: str | Path, out: str | Path | None = None) -> Report:
    """Write the PNGs and index.html of ``run_dir``'s report into ``out`` (default RUN/report)."""
    run_dir = Path(run_dir)
    m = read_metrics(run_dir)
    if not m.rows:
        raise ReportError(f"{run_dir / 'metrics.jsonl'} holds no step yet; nothing to plot")
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    figures, sections = [], []
    for plot in PLOTS:
        fig = _draw(m, plot)
        path = out / f"{plot.name}.png"
        if fig is None:
            path.unlink(missing_ok=True)  # left by an earlier report of this folder
            continue
        _save_png(fig, path)
        figures.append(path)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        sections.append(f'<figure id="{plot.name}"><img src="data:image/png;base64,{data}" alt="{plot.title}" '
                        f'width="{FIG_PX[0]}" height="{FIG_PX[1]}"><figcaption>{html.escape(plot.caption)}'
                        "</figcaption></figure>")
    index = out / "index.html"
    page = _page(run_dir, m, sections, _validation_files(run_dir, out))
    _atomic_write(index, lambda f: f.write(page.encode("utf-8")))
    return Report(index, figures, m.notes)


def _validation_files(run_dir: Path, out: Path) -> list[tuple[str, str]]:
    """(step name, link relative to the page) of each RUN/validation/step_N.jsonl, in step order."""
    files = sorted((run_dir / "validation").glob("step_*.jsonl"), key=lambda p: int(p.stem.partition("_")[2]))
    return [(p.stem, os.path.relpath(p, out)) for p in files if p.stem.partition("_")[2].isdigit()]


def _page(run_dir: Path, m: RunMetrics, sections: list[str], validation: list[tuple[str, str]]) -> str:
    esc = html.escape
    table = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in summary(m))
    notes = "".join(f"<li>{esc(n)}</li>" for n in m.notes)
    links = ", ".join(f'<a href="{esc(href)}">{esc(name)}</a>' for name, href in validation)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>tether report: {esc(run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: {FIG_PX[0] + 40}px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
figure {{ margin: 0 0 2em 0; }} img {{ max-width: 100%; height: auto; }}
figcaption {{ color: #555; font-size: 0.9em; }}
</style></head><body>
<h1>tether report</h1><p>{esc(str(run_dir))}</p>
<table>{table}</table>
{f"<p>Notes:</p><ul>{notes}</ul>" if notes else ""}
{f"<p>Validation generations (held-out rollouts, JSONL): {links}</p>" if links else ""}
{chr(10).join(sections) if sections else "<p>No metric of any figure was recorded yet.</p>"}
</body></html>
"""


def _atomic_write(path: Path, write: Callable[[Any], object]) -> None:
    """Write through a temporary file and a rename, so a reader (a browser refreshing) never sees half a file."""
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("wb") as f:
        write(f)
    os.replace(tmp, path)
