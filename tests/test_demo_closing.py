"""``make demo``'s last lines (examples/customer_service/demo.py, ``closing``): the before → after figures, each run's
report, and the two commands to run next, on a real (small) run directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_module():
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "customer_service" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_ends_with_the_figures_the_report_and_what_to_run_next(small_run):
    _, _, run_dir = small_run("demo-like")
    result = {"seed": 0, "sft_success": 0.359, "rl_success": 0.812, "gain": 0.453, "total_s": 196.0,
              "run_dir": str(run_dir)}
    lines = demo_module().closing([result, {**result, "seed": 1, "gain": 0.253}])
    text = "\n".join(lines)
    assert "seed 0: 35.9% after SFT → 81.2% after RL (+45.3 points, RL in 196 s)" in text
    assert "mean gain over 2 seeds: +35.3 points" in text
    reports = [line.rsplit(": ", 1)[1] for line in lines if line.startswith("[demo] report of seed")]
    assert len(reports) == 2 and all(Path(r).is_file() and r.endswith("index.html") for r in reports)
    assert f"tether verify optim {run_dir}" in text
    assert f"tether eval {run_dir / 'checkpoints' / 'step_3'} --config " in text  # SMALL_RUN saves at step 3
