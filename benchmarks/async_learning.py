"""Does learning hold under asynchrony? The demo's RL phase in ``sync`` and in ``fully_async`` (max_staleness 4),
from the same SFT warm start, with tool latency so that rollouts are dominated by waiting.

    python benchmarks/async_learning.py [--sft runs/demo/seed0/sft] [--latency-ms 300] [--steps 16]

Without ``--sft`` it first builds the warm start of examples/customer_service/demo.py (seed 0, ~3 min).
Prints, per mode, the wall time of the RL phase and held-out success before and after; the last line reads
``fully_async - sync held-out success = X points, wall-clock ratio = Y``. Extra ``--set`` overrides apply to
both runs (e.g. ``--set learner.off_policy_correction.method=none``); ``--modes`` picks the runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "customer_service"
sys.path.insert(0, str(DEMO))

from tether.config import load_config  # noqa: E402
from tether.pipeline.trainer import train  # noqa: E402

MODES = {
    "sync": ["rollout.mode=sync"],
    "fully_async": ["rollout.mode=fully_async", "rollout.scheduler.max_staleness=4",
                    "trainer.trigger_parameter_sync_step=1"],
}


def latency_overlay(root: Path, median_ms: float) -> Path:
    """The demo's tools with a lognormal latency (sigma 1.0: a long tail, capped at 20 × the median)."""
    cfg = load_config([DEMO / "config.yaml"])
    tools = cfg.redacted_dict()["environment"]["action_space"]
    for tool in tools:
        tool["latency_ms"] = {"median": median_ms, "sigma": 1.0, "max": 20 * median_ms}
        tool["timeout_ms"] = max(tool["timeout_ms"], 40 * median_ms)
    path = root / "latency.yaml"
    path.write_text(yaml.safe_dump({"environment": {"action_space": tools}}, sort_keys=False))
    return path


def run(mode: str, sft: Path, overlay: Path, root: Path, overrides: list[str]) -> dict:
    cfg = load_config([DEMO / "config.yaml", overlay], [*MODES[mode], *overrides])
    t = time.perf_counter()
    result = train(cfg, root / mode, model_dir=str(sft), show_progress=False)
    wall = time.perf_counter() - t
    rows = [json.loads(line) for line in (root / mode / "metrics.jsonl").read_text().splitlines()]
    lags = [r["rollout/policy_version_lag_max"] for r in rows if "rollout/policy_version_lag_max" in r]
    return {"mode": mode, "wall_s": wall, "before": result.eval_before["eval/success_rate"],
            "after": result.eval_after["eval/success_rate"], "max_lag": max(lags, default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", type=Path, help="an SFT model folder (demo.py writes RUN/seedN/sft)")
    ap.add_argument("--latency-ms", type=float, default=300.0)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sft = args.sft
        if sft is None:
            from demo import warm_start  # noqa: PLC0415 — the demo's warm start, only when asked for
            sft = warm_start(load_config([DEMO / "config.yaml"], ["trainer.seed=0"]), root / "warm", 0)
        overlay = latency_overlay(root, args.latency_ms)
        overrides = [f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.steps}", *args.overrides]
        results = [run(m, sft, overlay, root, overrides) for m in args.modes]
    print(f"tools: lognormal latency, median {args.latency_ms:g} ms, sigma 1.0; {args.steps} trainer steps of 64 "
          f"trajectories; overrides {args.overrides or 'none'}")
    print(f"{'mode':12s} {'wall s':>8s} {'before':>8s} {'after':>8s} {'max lag':>8s}")
    for r in results:
        print(f"{r['mode']:12s} {r['wall_s']:8.1f} {r['before']:8.1%} {r['after']:8.1%} {r['max_lag']:8.0f}")
    if len(results) == 2:
        s, a = results
        print(f"fully_async - sync held-out success = {(a['after'] - s['after']) * 100:+.1f} points, "
              f"wall-clock ratio = {a['wall_s'] / s['wall_s']:.2f}")


if __name__ == "__main__":
    main()
