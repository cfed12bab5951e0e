"""Does learning hold under asynchrony? The demo's RL phase in ``sync`` and in ``fully_async`` (max_staleness 4),
from the same SFT warm start, with tool latency so that rollouts are dominated by waiting.

    python benchmarks/async_learning.py [--sft runs/demo/seed0/sft] [--latency-ms 300] [--steps 16]

Without ``--sft`` it first builds the warm start of examples/customer_service/demo.py (seed 0, ~2-3 min).
Prints, per mode, the wall time of the RL phase and held-out success before and after; the last line reads
``fully_async - sync held-out success = X points, wall-clock ratio = Y``. Extra ``--set`` overrides apply to
both runs.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", type=Path, help="an SFT model folder (demo.py writes RUN/seedN/sft)")
    ap.add_argument("--latency-ms", type=float, default=300.0)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path, help="keep the run directories here (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        sft = warm_start_dir(args.sft, root)
        overlay = latency_overlay(root, args.latency_ms)
        common = [f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.steps}", *args.overrides]
        results = {m: rl_run(sft, root / m, [*o, *common], (overlay,)) for m, o in MODES.items()}
    print(f"tools: lognormal latency, median {args.latency_ms:g} ms, sigma 1.0; {args.steps} trainer steps of 64 "
          f"trajectories; overrides {args.overrides or 'none'}")
    print(f"{'mode':12s} {'wall s':>8s} {'before':>8s} {'after':>8s} {'max lag':>8s}")
    for mode, r in results.items():
        print(f"{mode:12s} {r['wall_s']:8.1f} {r['before']:8.1%} {r['after']:8.1%} {r['max_lag']:8.0f}")
    s, a = results["sync"], results["fully_async"]
    print(f"fully_async - sync held-out success = {(a['after'] - s['after']) * 100:+.1f} points, "
          f"wall-clock ratio = {a['wall_s'] / s['wall_s']:.2f}")


if __name__ == "__main__":
    main()
