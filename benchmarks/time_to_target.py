"""Wall-clock from the demo's SFT checkpoint to held-out success ≥ 75 %, evaluation time excluded.

    python benchmarks/time_to_target.py [--seeds 0 1 2] [--steps 16] [--eval-every 2] [--target 0.75 [0.85 0.9]]
                                        [--model DIR] [--threads 2]
    python benchmarks/time_to_target.py --combine a.json b.json c.json     # one summary of separate runs

The demo's RL phase (examples/customer_service/config.yaml, sync mode, 8 tasks × 8 rollouts) from its SFT
checkpoint (``--model``; default: the ``tiny-sft`` preset of seed 0, so every RL seed starts from the same
weights), for ``--steps`` steps with held-out evaluation (the environment's eval tasks, greedy) every
``--eval-every`` steps. The training clock runs from the end of the step-0 evaluation and stops while an
evaluation runs; the time to target is the training clock at the first evaluated step whose success is at least
``--target`` (so it is resolved to ``--eval-every`` steps; several targets are read from the same run).
Evaluation time is reported separately, and so is the process CPU time over the same span (what the clock would
read on idle cores with one thread, when other programs share the machine).

Per seed: time to target (wall, CPU), evaluation seconds, trajectories generated (first attempts and resamples) per
trajectory trained, held-out success at every evaluation and at the last step. The last lines are ``time to 75% = X s
(median of 3 seeds)``, one per target ("not reached" counts as infinite).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "customer_service" / "config.yaml"


class Clock:
    """Training wall and CPU seconds, paused during evaluation (wraps ``Run.eval``)."""

    def __init__(self) -> None:
        self.start: tuple[float, float] | None = None  # (wall, cpu) at the end of the step-0 evaluation
        self.paused = (0.0, 0.0)  # evaluation time since start
        self.evals: list[dict[str, float]] = []

    def now(self) -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def train_time(self, at: tuple[float, float]) -> tuple[float, float]:
        assert self.start is not None
        return at[0] - self.start[0] - self.paused[0], at[1] - self.start[1] - self.paused[1]


def instrument(clock: Clock) -> None:
    """Time ``Run.eval`` into ``clock`` (the original eval wrapped once per seed, never a wrapper of a wrapper:
    nested wrappers would keep extending the earlier seeds' records)."""
    from tether.pipeline import build

    evaluate = getattr(build.Run.eval, "__wrapped__", build.Run.eval)

    @functools.wraps(evaluate)
    def timed_eval(self: Any, step: int) -> dict[str, float]:
        t0 = clock.now()
        train = clock.train_time(t0) if clock.start is not None else (0.0, 0.0)
        metrics = evaluate(self, step)
        t1 = clock.now()
        if clock.start is None:
            clock.start = t1
        else:
            clock.paused = (clock.paused[0] + t1[0] - t0[0], clock.paused[1] + t1[1] - t0[1])
        clock.evals.append({"step": step, "success": float(metrics.get("eval/success_rate", math.nan)),
                            "train_wall_s": train[0], "train_cpu_s": train[1], "eval_wall_s": t1[0] - t0[0]})
        return metrics

    build.Run.eval = timed_eval  # type: ignore[method-assign]


def reached(evals: list[dict[str, float]], target: float) -> dict[str, Any]:
    """The training wall / CPU seconds and the step of the first evaluation after step 0 at ``target`` or above."""
    hit = next((e for e in evals if e["step"] > 0 and e["success"] >= target), None)
    return {"time_to_target_s": hit["train_wall_s"] if hit else math.inf,
            "cpu_to_target_s": hit["train_cpu_s"] if hit else math.inf,
            "step_to_target": hit["step"] if hit else None}


def run_seed(seed: int, model: str, steps: int, every: int, targets: list[float],
             overrides: list[str]) -> dict[str, Any]:
    from tether.config import load_config
    from tether.pipeline.trainer import train

    cfg = load_config([DEMO], [f"trainer.seed={seed}", f"trainer.total_steps={steps}", f"trainer.eval_every={every}",
                               f"trainer.save_every={steps}", "metrics.tensorboard=false", *overrides])
    clock = Clock()
    instrument(clock)
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp) / "run", model_dir=model, show_progress=False)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["step"] > 0]
    generated = sum(r.get("rollout/generated_trajectories", 0) + r.get("rollout/resampled_trajectories", 0)
                    for r in steps_rows)
    trained = sum(r.get("rollout/trained_trajectories", 0) for r in steps_rows)
    return {"seed": seed, "evals": clock.evals, "targets": {f"{t:g}": reached(clock.evals, t) for t in targets},
            "eval_s": sum(e["eval_wall_s"] for e in clock.evals),
            "train_s": clock.evals[-1]["train_wall_s"], "train_cpu_s": clock.evals[-1]["train_cpu_s"],
            "final_success": clock.evals[-1]["success"],
            "final_step": clock.evals[-1]["step"],
            "generated_per_trained": generated / trained if trained else math.inf}


def _when(hit: dict[str, Any]) -> str:
    return (f"{hit['time_to_target_s']:.0f} s wall / {hit['cpu_to_target_s']:.0f} s CPU (step {hit['step_to_target']})"
            if hit["step_to_target"] else "not reached")


def _targets(r: dict[str, Any]) -> dict[float, dict[str, Any]]:
    """A result's targets, the first one first (a result of an older run has one, in ``target`` and its own fields)."""
    targets = r["targets"] if "targets" in r else {f"{r['target']:g}": r}
    return {float(t): hit for t, hit in targets.items()}


def same_targets(results: list[dict[str, Any]]) -> None:
    """Refuse to summarise results read for different targets (``--combine`` of runs with other ``--target`` lists)."""
    first = list(_targets(results[0]))
    for r in results[1:]:
        if list(_targets(r)) != first:
            raise ValueError(f"seed {r['seed']} was run for targets {list(_targets(r))}, seed {results[0]['seed']} for "
                             f"{first}: combine runs of the same --target list")


def summarise(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        curve = " ".join(f"{e['step']}:{e['success']:.0%}" for e in r["evals"])
        when = "; ".join(f"to {t:.0%}: {_when(hit)}" for t, hit in _targets(r).items())
        lines.append(f"seed {r['seed']}: {when}; held-out success at step {r['final_step']}: "
                     f"{r['final_success']:.1%}; training {r['train_s']:.0f} s "
                     f"({r['evals'][-1]['train_cpu_s']:.0f} s CPU), "
                     f"evaluation {r['eval_s']:.0f} s; "
                     f"generated per trained trajectory {r.get('generated_per_trained', math.nan):.2f}; "
                     f"curve {curve}")
    same_targets(results)
    cpu = [next(iter(_targets(r).values()))["cpu_to_target_s"] for r in results]  # the first target's
    lines.append(f"CPU time to target (median): {statistics.median(cpu):.0f} s; held-out success at the last step: "
                 + ", ".join(f"{r['final_success']:.1%}" for r in results))
    for t in _targets(results[0]):
        med = statistics.median(_targets(r)[t]["time_to_target_s"] for r in results)
        shown = f"{med:.0f} s" if math.isfinite(med) else "not reached"
        lines.append(f"time to {t:.0%} = {shown} (median of {len(results)} seeds)")
    return "\n".join(lines)


def default_model() -> str:
    from tether.config import load_config
    from tether.runtime import model_path

    return model_path(load_config([DEMO], ["trainer.seed=0"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--target", type=float, nargs="+", default=[0.75],
                    help="held-out success to reach, one or more (e.g. 0.75 0.85 0.9): each from the same run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="SFT checkpoint (HF folder); default: the tiny-sft preset")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    ap.add_argument("--json", type=Path, default=None, help="write the per-seed results here")
    ap.add_argument("--combine", type=Path, nargs="+", default=None, help="summarise --json files of earlier runs")
    args = ap.parse_args()
    if args.combine:
        try:
            print(summarise([r for path in args.combine for r in json.loads(path.read_text())]))
        except ValueError as e:
            ap.error(f"{e} (in {', '.join(map(str, args.combine))})")
        return
    torch.set_num_threads(args.threads)
    import tether

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"tether from {Path(tether.__file__).parent}; threads {args.threads}; load: {load}", flush=True)
    model = args.model or default_model()
    results = []
    for seed in args.seeds:
        results.append(run_seed(seed, model, args.steps, args.eval_every, args.target, args.overrides))
        print(summarise(results[-1:]).splitlines()[0], flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    print(summarise(results), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
