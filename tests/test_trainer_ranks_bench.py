"""``benchmarks/trainer_ranks.py --tiny``: the learner on 1 and 2 trainer ranks (gloo; rank 1 spawned, running
``follow``) gives a table with both rank counts and finite figures, and sharding halves the AdamW moments per rank."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from conftest import REPO


def test_tiny_run_measures_one_and_two_ranks(tmp_path):
    out = tmp_path / "ranks.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "trainer_ranks.py"), "--tiny", "--models", "demo",
                           "--cores", "2", "--json", str(out)], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    results = json.loads(out.read_text())
    assert [(r["model"], r["ranks"], [p["rank"] for p in r["per_rank"]]) for r in results] == [
        ("demo", 1, [0]), ("demo", 2, [0, 1])]
    assert [p["threads"] for r in results for p in r["per_rank"]] == [2, 1, 1]  # the same 2 cores either way
    for r in results:
        numbers = r["step_s"] + r["push_s"] + r["losses"] + r["grad_norms"]
        numbers += [v for p in r["per_rank"] for k, v in p.items() if k != "rank"]
        assert len(r["step_s"]) == 2 and all(math.isfinite(v) for v in numbers)
        assert all(p["peak_rss_mb"] >= p["rss_before_mb"] > 0 for p in r["per_rank"])
    one, two = results
    # AdamW's two moments of every parameter, split over the ranks (a shard rounds up: within 5 %)
    assert all(abs(p["adamw_mb"] / (one["per_rank"][0]["adamw_mb"] / 2) - 1) < 0.05 for p in two["per_rank"])
    assert math.isclose(one["losses"][0], two["losses"][0], rel_tol=1e-4)  # the same first step
    lines = proc.stdout.splitlines()
    assert any(line.split()[:5] == ["model", "params", "ranks", "rank", "threads"] for line in lines)
    assert lines[-1].startswith("2 ranks ÷ 1 rank") and "demo step" in lines[-1]
