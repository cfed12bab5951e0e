"""tether report: PNGs and one self-contained HTML page from a run's metrics.jsonl — finished or in progress —
opened in a real headless browser where one is installed; and `tether train` prints the page's path."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess

import pytest
from PIL import Image
from typer.testing import CliRunner

from conftest import SMALL_RUN, read_rows
from tether.cli import _print_report, app
from tether.report import FIG_PX, PLOTS, build_report, read_metrics

SYNC_FIGURES = ["success_reward", "learning_signal", "kl_entropy", "staleness", "idle", "reward_components",
                "monitors"]  # a sync run records no queue/* counters and has no monitor/*; its hacking flags plot


def report(*args: str):
    return CliRunner().invoke(app, ["report", *map(str, args)], catch_exceptions=False)


def figures_in_page(page: str) -> dict[str, bytes]:
    """figure id -> the PNG bytes its <img> embeds."""
    found = re.findall(r'<figure id="([a-z_]+)"><img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    return {name: base64.b64decode(data) for name, data in found}


def check_pngs(out, names):
    assert sorted(p.name for p in out.glob("*.png")) == sorted(f"{n}.png" for n in names)
    for name in names:
        path = out / f"{name}.png"
        assert path.stat().st_size > 10_000, path  # a drawn figure, not an empty canvas
        with Image.open(path) as im:
            assert (im.format, im.size) == ("PNG", FIG_PX)
            im.verify()  # the whole file decodes
    page = (out / "index.html").read_text(encoding="utf-8")
    embedded = figures_in_page(page)
    assert list(embedded) == names  # one <img> per PNG, in the order of PLOTS
    assert all(embedded[n] == (out / f"{n}.png").read_bytes() for n in names)  # self-contained: the same bytes
    assert "src=\"http" not in page and "<link" not in page and "<script" not in page  # nothing fetched
    return page


@pytest.mark.slow
def test_train_prints_the_report_and_tether_report_rebuilds_it(tiny_model, tmp_path):
    (tmp_path / "run.yaml").write_text(SMALL_RUN)
    run_dir = tmp_path / "sync"
    trained = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml"), "--set", f"model.path={tiny_model}",
                                       "--set", "trainer.eval_every=1", "--run-dir", str(run_dir)],
                                 catch_exceptions=False)
    assert trained.exit_code == 0, trained.output
    assert trained.output.splitlines()[-1] == f"report: {run_dir / 'report' / 'index.html'}"  # the last line
    check_pngs(run_dir / "report", SYNC_FIGURES)
    shutil.rmtree(run_dir / "report")
    result = report(run_dir)
    assert result.exit_code == 0, result.output
    assert f"report: {run_dir / 'report' / 'index.html'}" in result.output
    page = check_pngs(run_dir / "report", SYNC_FIGURES)
    rows = read_rows(run_dir)
    success = [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r]
    best = max(success, key=lambda p: p[1])
    assert "<th>steps</th><td>3 of 3</td>" in page
    assert f"<th>held-out success, final</th><td>{success[-1][1]:.1%} (step 3)</td>" in page
    assert f"<th>held-out success, best</th><td>{best[1]:.1%} (step {best[0]})</td>" in page
    for step in range(4):  # evaluated at every step: each validation file is linked from the page
        assert f'href="../validation/step_{step}.jsonl"' in page
    # --out elsewhere: the same figures, the validation links still reach the run
    other = run_dir.parent / "elsewhere"
    assert report(run_dir, "--out", other).exit_code == 0
    assert 'href="../sync/validation/step_3.jsonl"' in check_pngs(other, SYNC_FIGURES)


def test_figures_follow_the_metrics_present_and_a_run_in_progress_reads(tmp_path):
    (tmp_path / "config.yaml").write_text("trainer: {total_steps: 10}\nrollout: {mode: fully_async}\n")
    rows = [{"step": 0, "eval/success_rate": 0.25}, {"step": 1, "reward/mean": 0.5, "queue/size": 3.0,
                                                     "queue/total_produced": 8.0},
            {"step": 2, "reward/mean": float("nan"), "queue/size": 1.0, "queue/total_produced": 16.0}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "reward/me'  # a torn last line: still writing
    (tmp_path / "metrics.jsonl").write_text(text)
    assert [r["step"] for r in read_metrics(tmp_path).rows] == [0, 1, 2]
    stale = tmp_path / "report" / "kl_entropy.png"  # a figure of an earlier report whose metrics are gone
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    result = report(tmp_path)
    assert result.exit_code == 0, result.output
    assert "note: metrics.jsonl: skipped the last line (still being written?)" in result.output
    page = check_pngs(tmp_path / "report", ["success_reward", "queue"])
    assert "<th>steps</th><td>2 of 10 (in progress, or stopped)</td>" in page
    assert "<th>held-out success, final</th><td>25.0% (step 0)</td>" in page
    assert "skipped the last line" in page


def test_every_plot_draws_from_its_own_metrics(tmp_path):
    """One row holding a metric of each figure draws them all (the patterns match the names the code records)."""
    keys = ["eval/success_rate", "optim/advantage_std", "optim/kl_divergence", "rollout/policy_version_lag_max",
            "queue/size", "perf/trainer_idle_ratio", "reward/efficiency", "monitor/entropy_collapse"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **{k: 0.5 * s for k in keys}}) + "\n"
                                                    for s in range(3)))
    built = build_report(tmp_path)
    assert [p.stem for p in built.figures] == [p.name for p in PLOTS]
    assert len(PLOTS) == len(keys)


def test_not_a_run_directory_is_bad_input(tmp_path):
    result = report(tmp_path)
    assert result.exit_code == 2
    assert "metrics.jsonl does not exist" in result.output
    (tmp_path / "metrics.jsonl").write_text("")
    assert "holds no step yet" in report(tmp_path).output


def test_a_failing_report_does_not_fail_training(tmp_path, monkeypatch, capsys):
    _print_report(tmp_path)  # no metrics.jsonl: the report cannot be built
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "warning: no report (ReportError:" in captured.err and f"tether report {tmp_path}" in captured.err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/success_rate": 0.5}\n')
    _print_report(tmp_path)
    assert capsys.readouterr().out == f"report: {tmp_path / 'report' / 'index.html'}\n"


# -- in a real browser ---------------------------------------------------------------------------------------

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                 if shutil.which(n)), None)

# Appended to a copy of the page (never to the report itself): after the load event, each image's state.
PROBE = """<script>window.addEventListener("load", () => {
  const seen = [...document.images].map(i => ({id: i.closest("figure").id, complete: i.complete,
                                              width: i.naturalWidth, height: i.naturalHeight}));
  const pre = document.createElement("pre"); pre.id = "probe"; pre.textContent = JSON.stringify(seen);
  document.body.appendChild(pre);
});</script>"""


def browser_images(page_text: str, tmp_path) -> list[dict]:
    """Load ``page_text`` (a file:// page) in headless Chromium; every image's id, completeness and natural size."""
    probe = tmp_path / "probe.html"
    probe.write_text(page_text.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    return json.loads(found.group(1).replace("&quot;", '"'))


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium); the page's "
                                             "structure is still checked without a browser")
def test_the_page_loads_every_figure_in_a_headless_browser(small_run, tmp_path):
    _, _, run_dir = small_run("async", "rollout.mode=fully_async", "rollout.scheduler.max_staleness=2",
                              "trainer.eval_every=2")
    result = report(run_dir)
    assert result.exit_code == 0, result.output
    names = [*SYNC_FIGURES[:4], "queue", *SYNC_FIGURES[4:]]  # async: the queue counters too
    page = check_pngs(run_dir / "report", names)
    seen = browser_images(page, tmp_path)
    assert seen == [{"id": n, "complete": True, "width": FIG_PX[0], "height": FIG_PX[1]} for n in names]
    # the probe tells a broken image from a loaded one: one figure's data cut short shows as not loaded
    broken = re.sub(r'(<figure id="queue"><img src="data:image/png;base64,)[A-Za-z0-9+/]{200}', r"\1", page)
    assert [s["width"] for s in browser_images(broken, tmp_path) if s["id"] == "queue"] == [0]
