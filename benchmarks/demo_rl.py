"""Shared by the learning benchmarks: the demo's RL phase from an SFT warm start, under config overrides.

``warm_start_dir`` builds (or reuses) the warm start of examples/customer_service/demo.py; ``rl_run`` trains
from it and summarises metrics.jsonl: held-out success before/after and at every evaluation, wall time,
generated and trained trajectories, the fraction of groups with a non-zero advantage, the largest policy lag.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "customer_service"
sys.path.insert(0, str(DEMO))

from tether.config import load_config  # noqa: E402
from tether.pipeline.trainer import train  # noqa: E402


def warm_start_dir(sft: Path | None, root: Path, seed: int = 0) -> Path:
    """``sft`` if given, else the demo's warm start: the tiny-sft preset (built into the cache once, a few minutes;
    ``root`` is not used since the preset moved to the cache)."""
    if sft is not None:
        return sft
    from demo import warm_start  # noqa: PLC0415 — the demo's warm start, only when asked for

    return warm_start(load_config([DEMO / "config.yaml"], [f"trainer.seed={seed}"]))[0]


def rl_run(sft: Path, run_dir: Path, overrides: list[str], files: tuple[Path, ...] = ()) -> dict:
    cfg = load_config([DEMO / "config.yaml", *files], overrides)
    t = time.perf_counter()
    if run_dir.exists():  # the benchmark's own output: a rerun replaces it (tether train refuses a used run dir)
        shutil.rmtree(run_dir)
    result = train(cfg, run_dir, model_dir=str(sft), show_progress=False)
    wall = time.perf_counter() - t
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    curve = {r["step"]: r["eval/success_rate"] for r in rows if "eval/success_rate" in r}

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in steps)

    ratio = "optim/degenerate_group_ratio_before_filter"
    degenerate = [r.get(ratio, r.get("optim/degenerate_group_ratio", 0.0)) for r in steps]
    return {
        "wall_s": wall, "before": result.eval_before["eval/success_rate"],
        "after": result.eval_after["eval/success_rate"], "curve": curve,
        "generated": total("rollout/generated_trajectories") + total("rollout/resampled_trajectories"),
        "trained": total("rollout/trained_trajectories"),
        "informative_groups": 1.0 - sum(degenerate) / max(len(degenerate), 1),
        "informative_samples": (sum(r.get("optim/nonzero_advantage_ratio", 0.0)
                                    * r.get("rollout/trained_trajectories", 0) for r in steps)
                                / max(total("rollout/trained_trajectories"), 1)),
        "max_lag": max((r.get("rollout/policy_version_lag_max", 0) for r in steps), default=0),
        "kl_max": max((r.get("optim/kl_divergence", 0.0) for r in steps), default=0.0),
    }


def steps_to_reach(curve: dict[int, float], level: float) -> int | None:
    """The first evaluated step whose held-out success is at least ``level`` (None if never)."""
    return next((s for s, v in sorted(curve.items()) if v >= level), None)
