"""``benchmarks/gpu_smoke.sh --tiny`` runs on a CPU, so the GPU acceptance run cannot rot: the script, the model build,
the device probes, engine and HF ``generate`` decode, the learner probe, the RL loop in miniature (FSDP2 over one gloo
rank, DetachActorWorker, the weight sync) and the table, end to end; a failing section still prints the table and
exits 1; the reference column's formulas are pinned by hand."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "benchmarks" / "gpu_smoke.py")
assert spec is not None and spec.loader is not None
gpu_smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_smoke)
bench = gpu_smoke.bench

ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<value>[^|]+?) \| (?P<unit>[^|]*?) \| (?P<ref>[^|]*?) \|$", re.M)
FIGURES = ["memory bandwidth (copy)", "matmul peak", *(f"{kind}, batch {b}" for b in (1, 4, 8) for kind in (
    "engine decode", "HF generate decode", "bandwidth limit")), "engine prefill, batch 8", "learner", "learner MFU",
    "RL step (median)", "RL generated", "RL trained", "RL loss (last step)", "weight sync (median)", "peak memory"]


def smoke(*args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--tiny", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def table(out: str) -> dict[str, dict[str, str]]:
    return {m["name"]: m.groupdict() for m in ROW.finditer(out) if m["name"] != "figure"}


def number(text: str) -> float:
    return float(text.replace(",", ""))


def test_gpu_smoke_tiny_prints_every_figure_finite():
    done = smoke("--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith("gpu_smoke: OK")
    rows = table(done.stdout)
    assert list(rows) == FIGURES
    values = {name: number(row["value"]) for name, row in rows.items()}
    assert all(math.isfinite(v) for v in values.values())
    assert all(v > 0 for name, v in values.items() if name != "RL loss (last step)")
    # the limit is linear in the batch: batch ÷ (parameter bytes ÷ bandwidth)
    assert values["bandwidth limit, batch 8"] == pytest.approx(8 * values["bandwidth limit, batch 1"], rel=1e-3)
    assert "× HF generate" in rows["engine decode, batch 4"]["ref"]
    assert "1 syncs" in rows["weight sync (median)"]["ref"]  # after step 2 (every 2 steps)
    assert re.search(r"cascade attention over the \d+ prompt tokens all share", rows["RL generated"]["ref"])
    assert "engine now version 1" in done.stderr and "rl step 2:" in done.stderr


def test_a_failing_section_still_prints_the_table_and_exits_1():
    # in bf16, the GPU run's dtype: the engine's weights and the learner's compute (fp32 master weights)
    done = smoke("--steps", "2", "--batches", "1", "--dtype", "bfloat16", GPU_SMOKE_FAIL="learner")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "in bfloat16" in done.stdout
    rows = table(done.stdout)
    assert rows["learner"]["value"] == "missing" and rows["learner MFU"]["value"] == "missing"
    others = {name: number(row["value"]) for name, row in rows.items() if not name.startswith("learner")}
    assert all(math.isfinite(v) for v in others.values())
    assert all(v > 0 for name, v in others.items() if name != "RL loss (last step)")
    last = done.stdout.rstrip().splitlines()[-1]
    assert last.startswith("gpu_smoke: FAILED") and "learner, learner MFU" in last and "GPU_SMOKE_FAIL" in last
    assert "learner: FAILED" in done.stderr


def test_a_hung_run_still_prints_the_table_and_exits_1():
    done = smoke("--batches", "1", "--watchdog-s", "0.5")  # fires while the run is still going
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1] == "gpu_smoke: FAILED — watchdog after 0.5 s"
    assert "| engine decode, batch 1 |" in done.stdout and "most recent call first" in done.stderr  # + the stacks


def test_a_section_past_its_share_of_the_budget_is_skipped_and_a_raising_one_is_kept(capsys):
    ran = []
    report = bench.Report(budget_s=100.0)
    report.t0 -= 40  # 40 s into the run: past the engine's 30 %, within the learner's 70 %
    report.run("engine batch 1", "engine", ran.append, "engine")
    report.run("learner", "learner", ran.append, "learner")
    report.run("rl", "rl", lambda: 1 / 0)
    assert ran == ["learner"]
    assert report.errors == ["rl: ZeroDivisionError: division by zero"]
    # repetitions of a timing: as many as fit in the time left, at least one
    assert (bench.fit(3, 2.0, 5.0), bench.fit(3, 10.0, 5.0), bench.fit(3, 1.0, 100.0)) == (2, 1, 3)
    err = capsys.readouterr().err
    assert "engine batch 1: skipped, past 30% of the 100 s budget" in err and "rl: FAILED" in err


def test_missing_or_non_finite_figures_are_bad_and_the_references_hold_the_formulas():
    sizes = bench.Sizes(**{**bench.CPU_TINY.__dict__, "batches": (1, 4)})
    report = bench.Report(60.0)
    gpu_smoke.declare(report, sizes)
    report.put("engine decode, batch 4", 20.0)  # tokens/s
    report.put("HF generate decode, batch 4", 8.0)
    report.put("learner", 1000.0)  # tokens/s
    report.put("RL loss (last step)", math.nan)
    # 10 GB/s over 1 GB of weights: 10 steps/s, so 40 tokens/s at batch 4. The learner probe's tokens are 3/4
    # response (16 + 48): 1e6 layer params + 4e6/3 LM-head params × 3/4 = 2e6 params a token, 6 × 2e6 × 1000 tokens/s
    # = 1.2e10 FLOP/s of a 2e10 FLOP/s peak = 60 % MFU
    gpu_smoke.add_references(report, sizes, dict(bw=10e9, peak=2e10, param_bytes=1e9, body_params=1e6,
                                                 head_params=4e6 / 3))
    assert report.get("bandwidth limit, batch 4") == pytest.approx(40.0)
    assert report.get("bandwidth limit, batch 1") == pytest.approx(10.0)
    assert report.rows["engine decode, batch 4"].ref == "2.50× HF generate, 50.0% of bandwidth limit"
    assert report.rows["HF generate decode, batch 4"].ref == "20.0% of bandwidth limit"
    assert report.get("learner MFU") == pytest.approx(60.0)
    bad = report.bad()
    assert "RL loss (last step)" in bad and "engine decode, batch 1" in bad and "learner MFU" not in bad
    assert "| engine decode, batch 1 | missing | tokens/s |  |" in report.markdown()


def test_gpu_smoke_without_a_gpu_says_to_use_tiny(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PATH": str(tmp_path)}  # no nvidia-smi on PATH
    done = subprocess.run(["/bin/bash", str(REPO / "benchmarks" / "gpu_smoke.sh")], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 2 and "no NVIDIA GPU found" in done.stderr and "--tiny" in done.stderr
