"""Does learning hold under asynchrony? The demo's RL phase in ``sync`` and in ``fully_async`` (max_staleness 4),
from the same SFT warm start, with tool latency so that rollouts are dominated by waiting.

    python benchmarks/async_learning.py [--sft DIR] [--latency-ms 500] [--steps 16] [--seeds 0 1 2] [--margin 0]

Without ``--sft`` it starts from the demo's warm start (the tiny-sft preset, built into the cache once). Per RL
seed, ``sync`` trains ``--steps`` steps and ``fully_async`` up to 1.5× as many, both evaluated every
``--eval-every`` steps on the 64 held-out tasks. Training time is the sum of ``perf/step_time`` (evaluation
excluded: it costs the same in both modes). The target of a seed is its sync run's final held-out success minus
``--margin``; a line per seed, and the last line reads ``time to target: fully_async/sync R (median of N seeds;
per seed ...); final success sync A, fully_async B`` (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import yaml

from demo_rl import DEMO, rl_run, warm_start_dir
from tether.config import load_config

MODES = {
    "sync": ["rollout.mode=sync"],
    "fully_async": ["rollout.mode=fully_async", "rollout.scheduler.max_staleness=4",
                    "trainer.trigger_parameter_sync_step=1"],
}


def latency_overlay(root: Path, median_ms: float) -> Path:
    """The demo's tools with a lognormal latency (sigma 1.0: a long tail, capped at 20 × the median)."""
    tools = load_config([DEMO / "config.yaml"]).redacted_dict()["environment"]["action_space"]
    for tool in tools:
        tool["latency_ms"] = {"median": median_ms, "sigma": 1.0, "max": 20 * median_ms}
        tool["timeout_ms"] = max(tool["timeout_ms"], 40 * median_ms)
    path = root / "latency.yaml"
    path.write_text(yaml.safe_dump({"environment": {"action_space": tools}}, sort_keys=False))
    return path


def training_clock(run_dir: Path) -> dict[int, float]:
    """Cumulative training seconds (perf/step_time) at the end of each step."""
    clock, total = {0: 0.0}, 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] > 0:
            total += row["perf/step_time"]
            clock[row["step"]] = total
    return clock


def one_seed(seed: int, sft: Path, root: Path, overlay: Path, args: argparse.Namespace) -> dict[str, object]:
    """Sync then fully_async from ``sft`` with RL seed ``seed``; prints the seed's table."""
    steps = {"sync": args.steps, "fully_async": args.steps * 3 // 2}
    results = {}
    for mode, overrides in MODES.items():
        common = [f"trainer.total_steps={steps[mode]}", f"trainer.eval_every={args.eval_every}",
                  f"trainer.seed={seed}", *args.overrides]
        results[mode] = rl_run(sft, root / f"seed{seed}" / mode, [*overrides, *common], (overlay,))
        results[mode]["clock"] = training_clock(root / f"seed{seed}" / mode)
    target = results["sync"]["after"] - args.margin
    print(f"seed {seed}: target = sync's final held-out success {results['sync']['after']:.1%} "
          f"minus {args.margin:.0%} = {target:.1%}")
    print(f"{'mode':12s} {'steps':>5s} {'s/step':>7s} {'final':>7s} {'best':>7s} {'reached at':>14s} {'max lag':>8s}")
    reach = {}
    for mode, r in results.items():
        clock = r["clock"]
        hit = next((s for s, v in sorted(r["curve"].items()) if s > 0 and v >= target), None)
        reach[mode] = clock[hit] if hit is not None else None
        at = f"step {hit}, {clock[hit]:.0f} s" if hit is not None else "not reached"
        print(f"{mode:12s} {steps[mode]:5d} {clock[steps[mode]] / steps[mode]:7.1f} {r['after']:7.1%} "
              f"{max(r['curve'].values()):7.1%} {at:>14s} {r['max_lag']:8.0f}")
        print(f"  held-out success by step: {dict(sorted(r['curve'].items()))}")
    s, a = reach["sync"], reach["fully_async"]
    return {"seed": seed, "sync_s": s, "async_s": a, "ratio": a / s if s and a else None,
            "sync_final": results["sync"]["after"], "async_final": results["fully_async"]["after"]}


def _seconds(t: float | None) -> str:
    """A time to target as the seed tables print it (whole seconds), or "not reached"."""
    return "not reached" if t is None else f"{t:.0f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", type=Path, help="an SFT model folder (default: the tiny-sft preset of seed 0)")
    ap.add_argument("--latency-ms", type=float, default=500.0)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds (one SFT start for all)")
    ap.add_argument("--margin", type=float, default=0.0, help="target = sync's final success minus this")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path, help="keep the run directories here (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        sft = warm_start_dir(args.sft, root)
        overlay = latency_overlay(root, args.latency_ms)
        print(f"tools: lognormal latency, median {args.latency_ms:g} ms, sigma 1.0; trainer steps of 64 "
              f"trajectories; overrides {args.overrides or 'none'}", flush=True)
        seeds = [one_seed(seed, sft, root, overlay, args) for seed in args.seeds]
    ratios = [r["ratio"] for r in seeds]
    per_seed = ", ".join(f"seed {r['seed']}: " + (f"{r['async_s']:.0f}/{r['sync_s']:.0f} s = {r['ratio']:.2f}"
                                                  if r["ratio"] is not None else
                                                  f"sync {_seconds(r['sync_s'])}, fully_async {_seconds(r['async_s'])}")
                         for r in seeds)
    known = [x for x in ratios if x is not None]
    med = f"{statistics.median(known):.2f}" if len(known) == len(ratios) else "n/a"
    print(f"time to target: fully_async/sync {med} (median of {len(seeds)} seeds; {per_seed}); final success sync "
          f"{statistics.median(r['sync_final'] for r in seeds):.1%}, fully_async "
          f"{statistics.median(r['async_final'] for r in seeds):.1%}")


if __name__ == "__main__":
    main()
