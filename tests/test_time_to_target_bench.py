"""``benchmarks/time_to_target.py``'s summary: each target read from ``targets`` (the first one's CPU time on the CPU
line), an older run's single ``target`` read the same way, and runs of different ``--target`` lists refused by name."""

from __future__ import annotations

import importlib.util
import math

import pytest

from conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("time_to_target", REPO / "benchmarks" / "time_to_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(seed: int, targets: dict[str, tuple[float, float, int | None]]) -> dict:
    evals = [{"step": 0, "success": 0.4, "train_wall_s": 0.0, "train_cpu_s": 0.0, "eval_wall_s": 1.0},
             {"step": 16, "success": 0.8, "train_wall_s": 40.0, "train_cpu_s": 50.0, "eval_wall_s": 1.0}]
    return {"seed": seed, "evals": evals, "eval_s": 2.0, "train_s": 40.0, "train_cpu_s": 50.0, "final_success": 0.8,
            "final_step": 16, "generated_per_trained": 2.0,
            "targets": {t: {"time_to_target_s": w, "cpu_to_target_s": c, "step_to_target": s}
                        for t, (w, c, s) in targets.items()}}


def test_summary_reads_every_target_and_the_first_ones_cpu():
    bench = _bench()
    a = _result(0, {"0.75": (20.0, 30.0, 8), "0.85": (math.inf, math.inf, None)})
    b = _result(1, {"0.75": (24.0, 34.0, 10), "0.85": (40.0, 50.0, 16)})
    old = {**_result(2, {}), "target": 0.75, "time_to_target_s": 30.0, "cpu_to_target_s": 40.0, "step_to_target": 12}
    del old["targets"]
    lines = bench.summarise([a, b]).splitlines()
    assert lines[-3].startswith("CPU time to target (median): 32 s;")  # (30 + 34) / 2
    assert lines[-2:] == ["time to 75% = 22 s (median of 2 seeds)", "time to 85% = not reached (median of 2 seeds)"]
    assert bench.summarise([old]).splitlines()[-1] == "time to 75% = 30 s (median of 1 seeds)"


def test_combining_runs_of_other_targets_is_refused():
    bench = _bench()
    a = _result(0, {"0.75": (20.0, 30.0, 8)})
    b = _result(1, {"0.75": (24.0, 34.0, 10), "0.85": (40.0, 50.0, 16)})
    with pytest.raises(ValueError, match=r"seed 1 was run for targets \[0.75, 0.85\], seed 0 for \[0.75\]"):
        bench.summarise([a, b])
