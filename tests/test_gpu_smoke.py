"""``benchmarks/gpu_smoke.sh --tiny`` runs on a CPU, so the GPU smoke test cannot rot: the script, the model
build, the local engine, the FSDP2 learner (gloo, one rank), DetachActorWorker and the weight sync, end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO


def test_gpu_smoke_tiny_runs_on_cpu_and_prints_its_numbers():
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_smoke.sh"), "--tiny", "--steps", "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "FSDP2 over 1 rank" in out and out.rstrip().endswith("gpu_smoke: OK")
    steps = re.findall(r"^step (\d): generated (\d+) tokens/s .* trained (\d+) tokens/s .* step time ([\d.]+) s, "
                       r"weight sync ([^\s,]+)", out, re.M)
    assert [s[0] for s in steps] == ["1", "2"]
    assert all(int(s[1]) > 0 and int(s[2]) > 0 and float(s[3]) > 0 for s in steps)
    assert steps[0][4] == "—" and float(steps[1][4]) > 0  # one sync, after step 2 (every 2 steps)
    assert "engine now version 1" in out
    summary = re.search(r"summary .* generated (\d+) tokens/s, trained (\d+) tokens/s, step time ([\d.]+) s, "
                        r"weight sync ([\d.]+) s \(1 syncs\), detach save ([\d.]+) s / restore ([\d.]+) s", out)
    assert summary is not None, out
    assert float(summary.group(6)) > 0  # step 2 scored π_prox under the saved weights, then restored its own


def test_gpu_smoke_without_a_gpu_says_to_use_tiny(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PATH": str(tmp_path)}  # no nvidia-smi on PATH
    done = subprocess.run(["/bin/bash", str(REPO / "benchmarks" / "gpu_smoke.sh")], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 2 and "no NVIDIA GPU found" in done.stderr and "--tiny" in done.stderr
