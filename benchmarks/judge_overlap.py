"""Does the reward loop hide a slow LLM judge? The demo's rollout phase with an instant and a 1 s judge.

    python benchmarks/judge_overlap.py [--steps 3] [--rounds 2] [--rpm 1800] [--out judge_overlap.json]

The demo's config (examples/customer_service/config.yaml: sync mode, 8 tasks × 8 rollouts a step, the
degenerate-group filter resampling) with ``environment.verifier.judge: llm``, its two rubrics scored by a judge
at ``reward.judge_client`` under a request rate limit (``requests_per_minute``, the client's token bucket) and a
concurrency cap. Three judges:

- ``instant``: a stub OpenAI-compatible server (``tether.reward.stub``) that answers ``SCORE: 0.5`` at once;
- ``slow``: the same stub sleeping 1 s before every answer;
- ``serve``: ``tether serve`` of the policy's own checkpoint (the plumbing through a real server; a tiny model
  does not write the ``SCORE:`` line, so its answers are counted as unparseable judge failures and settled by
  ``reward.on_judge_failure``, here rule_only so that the groups still train).

Each run builds the demo's run (``Run.build`` from the demo's tiny-sft preset, built once into the cache; the sync
batch source) and
times ``next_batch`` — the rollout phase: generation, rewards, resampling — for ``--steps`` steps without
training between them (the same weights), so the runs differ only by their judge. instant and slow alternate for
``--rounds`` rounds (the machine is shared: compare medians side by side). Reported: rollout samples/s (episodes
generated, resamples included, per second of the phase), slow / instant, and at the stubs the request arrivals
checked against the bucket: by every arrival at most burst + rate · (t − start) requests had come (burst = one
second's worth; ``bucket_excess`` ≤ 0), the busiest sliding windows, and the most requests in flight against the cap.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "customer_service" / "config.yaml"

from tether.config import load_config  # noqa: E402
from tether.pipeline.build import Run  # noqa: E402
from tether.reward.stub import StubChatServer, bucket_excess, window_max  # noqa: E402
from tether.runtime import model_path  # noqa: E402


def overrides(base_url: str, model: str, rpm: float, cap: int, extra: list[str]) -> list[str]:
    return ["environment.verifier.judge=llm", f"reward.judge_client.base_url={base_url}",
            f"reward.judge_client.model={model}", f"reward.judge_client.requests_per_minute={rpm}",
            f"reward.judge_client.max_concurrency={cap}", "reward.judge_client.timeout_s=30",
            "reward.on_judge_failure=rule_only", *extra]


def rollout_phase(label: str, sets: list[str], steps: int, root: Path, policy: str) -> dict:
    """``steps`` rollout phases of the demo's run under ``sets``, from the ``policy`` checkpoint: samples and
    seconds of each."""
    cfg = load_config([DEMO], sets)
    run_dir = root / label
    shutil.rmtree(run_dir, ignore_errors=True)
    run = Run.build(cfg, run_dir, model_dir=policy, show_progress=False)
    per_step = []
    try:
        for step in range(1, steps + 1):
            t = time.perf_counter()
            batch = run.source.next_batch(step)
            dt = time.perf_counter() - t
            samples = sum(p.first_trajectories + p.resampled_trajectories for p in batch.produced)
            per_step.append({"samples": samples, "seconds": round(dt, 2), "samples_per_s": round(samples / dt, 2)})
            print(f"  {label} step {step}: {samples} episodes in {dt:.1f} s = {samples / dt:.2f}/s", flush=True)
        stats = run.rt.rewards.stats if run.rt.rewards is not None else None
    finally:
        run.close()
    total_samples, total_s = sum(r["samples"] for r in per_step), sum(r["seconds"] for r in per_step)
    return {"label": label, "steps": per_step, "samples_per_s": round(total_samples / total_s, 3),
            "median_step_samples_per_s": statistics.median(r["samples_per_s"] for r in per_step),
            "judge": None if stats is None else vars(stats)}


def rate_check(arrivals: list[float], start: float, rpm: float) -> dict:
    """The arrivals against the bucket: ``excess`` ≤ 0 when by every arrival at most burst + rate · (t − start)
    requests had come (``bucket_excess``); the sliding-window maxima are shown too, though a busy machine can
    bunch the stamps of requests sent apart (they are stamped when the stub's handler runs)."""
    rate = rpm / 60.0
    burst = max(1.0, rate)
    out = {"requests": len(arrivals), "limit_per_s": rate, "burst": burst, "windows": {}}
    for w in (1.0, 10.0, 60.0):
        out["windows"][f"{w:g}s"] = {"max_requests": window_max(arrivals, w), "allowed": burst + rate * w}
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
    out["mean_rate_per_s"] = round(len(arrivals) / span, 2) if span else None
    out["excess"] = round(bucket_excess(arrivals, start, rpm), 2)
    out["never_exceeded"] = out["excess"] <= 0
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_judge(checkpoint: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    tether = str(Path(sys.executable).with_name("tether"))
    proc = subprocess.Popen([tether, "serve", checkpoint, "--port", str(port), "--served-model-name", "judge"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"tether serve {checkpoint} exited with {proc.returncode}") from None
            time.sleep(1)
    proc.kill()
    raise RuntimeError("tether serve did not answer /health within 180 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="rollout phases timed per run")
    ap.add_argument("--rounds", type=int, default=2, help="instant/slow pairs, alternated")
    ap.add_argument("--rpm", type=float, default=1800.0, help="reward.judge_client.requests_per_minute")
    ap.add_argument("--cap", type=int, default=64, help="reward.judge_client.max_concurrency")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds the slow judge sleeps per request")
    ap.add_argument("--serve-steps", type=int, default=2, help="rollout phases with tether serve as judge (0: skip)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra config override")
    ap.add_argument("--policy", default=None, help="policy checkpoint (default: the demo's tiny-sft preset)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="judge_overlap-"))
    print(f"load: {os.getloadavg()}", flush=True)
    policy = args.policy or model_path(load_config([DEMO], args.sets))  # the demo's tiny-sft (built once, cached)
    results: dict = {"runs": [], "args": vars(args) | {"out": str(args.out)}, "policy": policy}
    for r in range(args.rounds):
        for label, delay in (("instant", 0.0), ("slow", args.delay)):
            with StubChatServer(lambda body: "Reasons.\nSCORE: 0.5", delay_s=delay) as stub:
                start = time.monotonic()  # before the run's client (and its full bucket) exists
                res = rollout_phase(f"{label}{r}", overrides(stub.base_url, "stub", args.rpm, args.cap, args.sets),
                                    args.steps, root, policy)
                res["max_in_flight"] = stub.max_in_flight
                res["rate"] = rate_check(stub.arrivals, start, args.rpm)
            results["runs"].append(res)
    if args.serve_steps:
        proc, url = served_judge(policy)
        try:
            res = rollout_phase("serve", overrides(url, "judge", args.rpm, args.cap,
                                                   ["reward.judge_max_tokens=16", *args.sets]),
                                args.serve_steps, root, policy)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        results["runs"].append(res)
    inst = [x["samples_per_s"] for x in results["runs"] if x["label"].startswith("instant")]
    slow = [x["samples_per_s"] for x in results["runs"] if x["label"].startswith("slow")]
    results["instant_samples_per_s_median"] = statistics.median(inst)
    results["slow_samples_per_s_median"] = statistics.median(slow)
    results["slow_over_instant"] = round(statistics.median(slow) / statistics.median(inst), 3)
    results["rate_never_exceeded"] = all(x["rate"]["never_exceeded"] for x in results["runs"] if "rate" in x)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))
    for x in results["runs"]:
        rate = x.get("rate", {})
        print(f"{x['label']:>9}: {x['samples_per_s']:.2f} samples/s  judge {x['judge']}  bucket excess "
              f"{rate.get('excess')}  max 1 s window {rate.get('windows', {}).get('1s')}  in flight "
              f"{x.get('max_in_flight')}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
