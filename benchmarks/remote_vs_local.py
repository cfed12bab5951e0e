"""Does the remote engine learn like the local one? The demo's RL phase from the tiny-sft warm start, twice:
``engine.type: local`` (the in-process engine) and ``engine.type: remote`` against ``tether serve`` on loopback
(a separate process, started here over the same warm start with the demo's config).

    python benchmarks/remote_vs_local.py [--steps 16] [--eval-every 4] [--seed 0] [--run-dir runs/remote_vs_local]

The warm start is the ``model.preset: tiny-sft`` of examples/customer_service/config.yaml, built once into the
cache (``$TETHER_CACHE``; minutes the first time). Both runs train the same steps from it with the same seed and
are evaluated every ``--eval-every`` steps on the 64 held-out tasks. The server's access log is read for the
weight pushes it received (``POST /update_weights_from_tensor``): one at start, then one per sync. Prints held-out
success per evaluated step for both, the largest gap, and the push count; the issue's check is a gap within
5 points at every evaluated step (one seed each).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from demo_rl import DEMO, rl_run
from tether.config import load_config
from tether.runtime import model_path

PUSH = re.compile(r'"POST /update_weights_from_(tensor|disk)\S* HTTP/1\.1" 200')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(sft: str, overrides: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``tether serve`` over the warm start with the demo's config (the engine settings the local run has)."""
    port = free_port()
    sets = [a for o in overrides for a in ("--set", o)]
    cmd = [sys.executable, "-m", "tether", "serve", sft, "--port", str(port), "--served-model-name", "policy",
           "--config", str(DEMO / "config.yaml"), "--enable-weight-updates", *sets]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tether serve exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"tether serve did not answer on {url} within 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", type=Path, default=None, help="default: a temporary folder")
    args = ap.parse_args()
    torch.set_num_threads(2)
    root = args.run_dir or Path(tempfile.mkdtemp(prefix="remote_vs_local-"))
    root.mkdir(parents=True, exist_ok=True)
    common = [f"trainer.seed={args.seed}", f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.eval_every}",
              f"trainer.save_every={args.steps}", "metrics.tensorboard=false"]
    sft = model_path(load_config([DEMO / "config.yaml"], common))
    print(f"warm start: {sft}; runs under {root}", flush=True)

    results = {"local": rl_run(Path(sft), root / "local", common)}
    print(f"local done in {results['local']['wall_s']:.0f} s", flush=True)

    log = root / "serve.log"
    server, url = start_server(sft, [f"trainer.seed={args.seed}"], log)
    try:
        results["remote"] = rl_run(Path(sft), root / "remote",
                                   [*common, "engine.type=remote", f"llm_client.base_url={url}/v1",
                                    "llm_client.model=policy", "llm_client.timeout_s=600"])
        with urllib.request.urlopen(url + "/get_weight_version", timeout=10) as answer:
            served_version = answer.read().decode()
    finally:
        server.terminate()
        server.wait(timeout=60)
    pushes = len(PUSH.findall(log.read_text()))
    print(f"remote done in {results['remote']['wall_s']:.0f} s", flush=True)

    local, remote = results["local"]["curve"], results["remote"]["curve"]
    print("\nheld-out success (64 tasks, greedy)")
    print(f"{'step':>5} {'local':>8} {'remote':>8} {'gap':>8}")
    gaps = []
    for step in sorted(local.keys() | remote.keys()):
        a, b = local.get(step), remote.get(step)
        gap = None if a is None or b is None else (b - a) * 100
        gaps += [] if gap is None else [abs(gap)]
        print(f"{step:>5} {_pct(a):>8} {_pct(b):>8} {'' if gap is None else f'{gap:+.1f}':>8}")
    print(f"\nlargest gap {max(gaps):.1f} points ({'within' if max(gaps) <= 5 else 'NOT within'} 5); wall "
          f"local {results['local']['wall_s']:.0f} s, remote {results['remote']['wall_s']:.0f} s")
    print(f"weight pushes received by the server: {pushes} (1 at start + {args.steps} syncs = {1 + args.steps} "
          f"expected); its final weight version: {served_version}")


def _pct(v: float | None) -> str:
    return "" if v is None else f"{v:.1%}"


if __name__ == "__main__":
    main()
