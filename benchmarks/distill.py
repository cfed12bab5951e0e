"""On-policy distillation on the demo: the demo's RL-trained checkpoint teaches a fresh SFT student.

    python benchmarks/distill.py [--sft DIR] [--teacher DIR] [--steps 16] [--eval-every 2] [--threads 2]
                                 [--runs distill self rl rl+distill] [--loss topk_forward_kl] [--coef 1.0]
                                 [--distill-lr 3e-4]
                                 [--out DIR] [--json FILE]

Student: ``--sft`` (default: the demo's ``tiny-sft`` preset of seed 0, the warm start its RL starts from).
Teacher: ``--teacher`` (an HF folder; evaluated here on the same held-out tasks, greedy), else the ``rl`` run below
is trained first and its last checkpoint teaches: the demo's RL phase (examples/customer_service/config.yaml),
``--steps`` GRPO steps from the student (16 = the demo's).

Runs, each ``--steps`` steps from the same student, held-out success (the environment's 64 eval tasks, greedy)
every ``--eval-every`` steps:

    distill      pure on-policy distillation: teacher.rl_loss false (only the teacher's term), the KL to the SFT
                 reference and the degenerate-group filter off (every rollout carries the teacher's signal)
    distill_k1   the same with the per-token reverse KL on the sampled tokens (teacher.loss reverse_kl, k1)
    self         the control: distill with the student itself as teacher (no knowledge to pass: what the optimizer
                 and the sampling noise alone do to held-out success)
    rl           the demo's GRPO, unchanged
    rl+distill   the demo's GRPO + coef · the teacher's term (teacher.rl_loss true)

The loss of the distill runs is ``--loss`` (default topk_forward_kl, top 20) with ``--coef``; the pure runs
(distill, distill_k1, self) train at ``--distill-lr`` (the teacher's dense, low-variance signal takes a larger
step than GRPO's: at the demo's 1e-4 distillation tracks RL step for step), rl and rl+distill at the demo's.
The target is the rl run's held-out success at its last step; steps and training seconds to it are the first
evaluated step at or above it (so resolved to ``--eval-every``) and the sum of ``perf/step_time`` up to there
(rollout, teacher scoring and update; evaluation excluded). The last line is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from demo_rl import DEMO, rl_run
from tether.config import load_config

COMMON = ["metrics.tensorboard=false"]
PURE = ["teacher.rl_loss=false", "policy_optimization.advantage.degenerate_group_filter.enabled=false",
        "policy_optimization.kl_control.type=none"]


def teacher_keys(teacher: Path, loss: str, coef: float) -> list[str]:
    keys = ["teacher.enabled=true", f"teacher.path={teacher}", f"teacher.coef={coef}", f"teacher.loss={loss}"]
    return keys if loss == "topk_forward_kl" else [*keys, "teacher.kl_estimator=k1"]


def run_overrides(name: str, teacher: Path | None, loss: str, coef: float, sft: Path, lr: float) -> list[str]:
    pure = [*PURE, f"policy_optimization.optimizer.lr={lr}"]
    if name == "rl":
        return []
    if name == "self":
        return [*teacher_keys(sft, loss, coef), *pure]
    assert teacher is not None
    if name == "distill":
        return [*teacher_keys(teacher, loss, coef), *pure]
    if name == "distill_k1":
        return [*teacher_keys(teacher, "reverse_kl", coef), *pure]
    if name == "rl+distill":
        return teacher_keys(teacher, loss, coef)
    raise SystemExit(f"unknown run {name!r}; expected distill, distill_k1, self, rl or rl+distill")


def held_out(model: Path, seed: int) -> float:
    """Greedy held-out success of ``model`` on the demo's eval tasks (what every run's evaluation measures)."""
    from tether.pipeline.evaluate import evaluate
    from tether.pipeline.rollouter import Rollouter
    from tether.runtime import Runtime

    cfg = load_config([DEMO / "config.yaml"], [f"trainer.seed={seed}"])
    rt = Runtime.build(cfg, str(model))
    try:
        rollouter = Rollouter(rt.loop(greedy=True), rt.make_env,
                              max_concurrent=cfg.rollout.worker.max_concurrent_tasks, rewards=rt.rewards)
        metrics, _ = asyncio.run(evaluate(rollouter, rt.tasks("eval"), seed=seed))
    finally:
        rt.close()
    return metrics["eval/success_rate"]


def per_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl by step, with the cumulative training seconds (``perf/step_time``) as ``clock``."""
    out, clock = {}, 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        clock += row.get("perf/step_time", 0.0)
        out[row["step"]] = {**row, "clock": clock}
    return out


def summarise(name: str, r: dict[str, Any], rows: dict[int, dict[str, float]], target: float) -> dict[str, Any]:
    hit = next((s for s, v in sorted(r["curve"].items()) if s > 0 and v >= target), None)
    kl = [rows[s]["teacher/kl"] for s in sorted(rows) if "teacher/kl" in rows[s]]
    return {"run": name, "curve": r["curve"], "final": r["after"], "best": max(r["curve"].values()),
            "step_to_target": hit, "s_to_target": rows[hit]["clock"] if hit is not None else None,
            "train_s": rows[max(rows)]["clock"], "teacher_kl": (kl[0], kl[-1]) if kl else None}


def table(results: list[dict[str, Any]], target: float, teacher_success: float) -> str:
    steps = sorted({s for r in results for s in r["curve"]})
    head = f"{'run':11s} " + " ".join(f"{s:>5d}" for s in steps) + f" {'to target':>15s} {'train s':>8s} teacher/kl"
    lines = [f"held-out success by step (target: rl's final {target:.1%}; teacher {teacher_success:.1%})", head]
    for r in results:
        cells = " ".join(f"{r['curve'][s]:5.1%}" if s in r["curve"] else f"{'':5s}" for s in steps)
        to = f"step {r['step_to_target']}, {r['s_to_target']:.0f} s" if r["step_to_target"] else "not reached"
        kl = f"{r['teacher_kl'][0]:.3f} → {r['teacher_kl'][1]:.3f}" if r["teacher_kl"] else "-"
        lines.append(f"{r['run']:11s} {cells} {to:>15s} {r['train_s']:8.0f} {kl}")
    return "\n".join(lines)


def headline(results: dict[str, dict[str, Any]], target: float) -> str:
    parts = []
    if (d := results.get("distill")) is not None:
        before, after = d["curve"][0], d["final"]
        reach = f"step {d['step_to_target']}" if d["step_to_target"] else "not reached"
        parts.append(f"pure distillation {'raises' if after > before else 'does not raise'} held-out success "
                     f"{before:.1%} → {after:.1%} at step {max(d['curve'])} (best {d['best']:.1%}; RL-only's "
                     f"{target:.1%}: {reach})")
    if (c := results.get("self")) is not None:
        later = [v for s, v in c["curve"].items() if s > 0]
        parts.append(f"the student as its own teacher: {min(later):.1%}–{max(later):.1%}")
    both, rl = results.get("rl+distill"), results.get("rl")
    if both is not None and rl is not None:
        a, b = both["step_to_target"], rl["step_to_target"]
        if a is None:
            parts.append(f"RL + distillation does not reach RL-only's {target:.1%}")
        else:
            verdict = "fewer" if b is None or a < b else ("as many" if a == b else "more")
            parts.append(f"RL + distillation reaches RL-only's {target:.1%} at step {a} ({both['s_to_target']:.0f} s) "
                         f"vs RL-only step {b} ({rl['s_to_target']:.0f} s): {verdict} steps")
    return "; ".join(parts) or "nothing to compare"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", type=Path, default=None, help="the student (HF folder); default: the tiny-sft preset")
    ap.add_argument("--teacher", type=Path, default=None, help="the teacher (HF folder); default: trained here")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--runs", nargs="+", default=["distill", "self", "rl", "rl+distill"])
    ap.add_argument("--loss", default="topk_forward_kl", choices=["topk_forward_kl", "reverse_kl"])
    ap.add_argument("--coef", type=float, default=1.0)
    ap.add_argument("--distill-lr", type=float, default=3e-4, help="learning rate of the pure distillation runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override for every run")
    ap.add_argument("--out", type=Path, default=None, help="keep the run directories here (default: temporary)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        sft = args.sft
        if sft is None:
            from tether.runtime import model_path

            sft = Path(model_path(load_config([DEMO / "config.yaml"], [f"trainer.seed={args.seed}"])))
        raw: dict[str, tuple[dict[str, Any], dict[int, dict[str, float]]]] = {}

        def run(name: str, teacher: Path | None) -> None:
            keys = [f"trainer.seed={args.seed}", f"trainer.total_steps={args.steps}",
                    f"trainer.eval_every={args.eval_every}", f"trainer.save_every={args.steps}", *COMMON,
                    *run_overrides(name, teacher, args.loss, args.coef, sft, args.distill_lr),
                    *args.overrides]
            print(f"[{name}] overrides: {' '.join(keys)}", flush=True)
            r = rl_run(sft, root / name.replace("+", "_"), keys)
            raw[name] = (r, per_step(root / name.replace("+", "_")))
            print(f"[{name}] held-out success by step {r['curve']} ({r['wall_s']:.0f} s)", flush=True)

        if args.teacher is None:  # the rl run first: its last checkpoint teaches
            run("rl", None)
            teacher = (root / "rl" / "checkpoints" / f"step_{args.steps}").resolve()
            teacher_success = raw["rl"][0]["after"]
        else:
            teacher = args.teacher.resolve()
            teacher_success = held_out(teacher, args.seed)
        print(f"student {sft}; teacher {teacher}: held-out success {teacher_success:.1%}", flush=True)
        for name in args.runs:
            if name not in raw:
                run(name, teacher)
    target = raw["rl"][0]["after"] if "rl" in raw else teacher_success
    results = {name: summarise(name, r, rows, target) for name, (r, rows) in raw.items()}
    if args.json:
        args.json.write_text(json.dumps({"teacher_success": teacher_success, "target": target,
                                         "runs": list(results.values())}, indent=2))
    print(table(list(results.values()), target, teacher_success))
    print(headline(results, target), flush=True)


if __name__ == "__main__":
    main()
