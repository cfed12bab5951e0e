"""How the demo's RL step grows with the work: group size, prompts per step, response budget, model size.

    python benchmarks/scaling.py [--quick] [--threads 2] [--model DIR] [--axes group prompts budget model]

One axis at a time around the demo's point (8 tasks × 8 rollouts, 64 tokens per turn, its tiny-sft model):
group size 4, 8, 16; prompts per step 4, 8, 16 (one optimizer update per step throughout: the mini-batch is the
batch); response budget (``engine.max_tokens``) 64, 128, 256; and model size — random-init models of the tiny
architecture at the demo's width, 2× and 4× (≈ 1×, 4× and 16× the layers' parameters; the degenerate-group
filter is off there, since an untrained model's groups carry no signal). Each point runs ``--warmup`` + ``--steps``
steps under ``stage_timers.py`` (``step_profile.profile``) and prints the median step, the per-stage shares, and
the tokens generated and trained. ``rollout`` is the rollout phase (the step's batch generated) over the step and
``learner`` the learner's stage times over it; with ``learner.overlap_rollout`` most of the learner's time falls
inside the rollout phase, so the two can sum past 100 %.

Then the fit: step time = a + b · (trained tokens) + c · (generated tokens), least squares over the points of the
first three axes, with each point's residual; a point more than 25 % off the fit is named as where the linear
model breaks. The model axis is fitted against FLOPs (parameters × tokens) instead. ``--quick``: one measured step
per point and no warm-up step (a few minutes on idle cores; noisier).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_timers import Flops  # noqa: E402
from step_profile import default_model, profile  # noqa: E402

LEARNER = ("pi_prox scoring", "reference forward", "forward", "backward", "optimizer", "weight sync")


def batch(tasks: int, group: int) -> list[str]:
    n = tasks * group
    return [f"policy_optimization.advantage.group_size={group}", f"learner.batch_size={n}",
            f"learner.mini_batch_size={n}", "learner.gradient_accumulation_steps=4"]


def points(model: str, tmp: Path, axes: list[str]) -> list[tuple[str, str, str, list[str]]]:
    """(axis, value, model dir, overrides) of every point."""
    out: list[tuple[str, str, str, list[str]]] = []
    if "group" in axes:
        out += [("group size", str(g), model, batch(8, g)) for g in (4, 8, 16)]
    if "prompts" in axes:
        out += [("prompts/step", str(p), model, batch(p, 8)) for p in (4, 8, 16)]
    if "budget" in axes:
        out += [("max tokens", str(r), model, [*batch(8, 8), f"engine.max_tokens={r}"]) for r in (64, 128, 256)]
    if "model" in axes:
        from tether.env.customer_service import example_texts
        from tether.learner.model import build_tiny

        for width in (1, 2, 4):
            path = build_tiny(tmp / f"w{width}", corpus=example_texts(200), hidden_size=128 * width,
                              intermediate_size=384 * width, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2)
            out.append(("model width", f"{width}x", str(path),
                        [*batch(8, 8), "policy_optimization.advantage.degenerate_group_filter.enabled=false"]))
    return out


def measure(model: str, overrides: list[str], steps: int, warmup: int) -> dict[str, Any]:
    result = profile(model, steps, warmup, overrides)
    steps_, rows = result["steps"], result["rows"]
    fl = Flops.of(result["config"])
    step = statistics.median(r["perf/step_time"] for r in rows)
    keys = {k for s in steps_ for k in s["wall"]}
    stage = {k: statistics.median([s["wall"].get(k, 0.0) for s in steps_]) for k in keys}
    tail = statistics.median(s["resample_tail"] for s in steps_)
    trained = statistics.median(s["tokens"].get("forward", 0) for s in steps_)  # tokens through the learner
    generated = statistics.median(s["tokens"].get("decode", 0) for s in steps_)  # tokens decoded by the engine
    learner = sum(stage.get(k, 0.0) for k in LEARNER)  # beside the rollout (learner.overlap_rollout) and after it
    rollout = statistics.median(r["perf/step_time"] * r["perf/trainer_idle_ratio"] for r in rows)  # batch generated
    return {"step_s": step, "learner_s": learner, "rollout_s": rollout, "resample_tail_s": tail,
            "trained_tokens": trained, "generated_tokens": generated,
            "params": fl.layers * fl.layer_params + fl.hidden * fl.vocab,
            "top": sorted(stage.items(), key=lambda kv: -kv[1])[:3]}


def fit(xs: list[list[float]], ys: list[float]) -> tuple[list[float], list[float]]:
    """Least-squares coefficients (intercept first) and relative residuals."""
    a = torch.tensor([[1.0, *x] for x in xs], dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    coef = torch.linalg.lstsq(a, y[:, None]).solution[:, 0]
    pred = a @ coef
    return coef.tolist(), ((y - pred) / pred).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one measured step per point, no warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="the SFT checkpoint (default: the tiny-sft preset)")
    ap.add_argument("--axes", nargs="+", default=["group", "prompts", "budget", "model"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps, warmup = (1, 0) if args.quick else (2, 1)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"threads {args.threads}; {warmup} warm-up + {steps} measured step(s) per point; load: {load}", flush=True)
    if args.model is None:
        from tether.config import load_config

        args.model = default_model(load_config([Path(__file__).resolve().parents[1] / "examples" /
                                                "customer_service" / "config.yaml"], []))
    print(f"{'axis':<13}{'value':>6}{'step s':>8}{'rollout':>9}{'learner':>9}{'resample':>9}{'trained tok':>12}"
          f"{'gen tok':>9}  top stages", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for axis, value, model, overrides in points(args.model, Path(tmp), args.axes):
            r = measure(model, overrides, steps, warmup)
            results.append((axis, value, r))
            top = ", ".join(f"{k} {v / r['step_s']:.0%}" for k, v in r["top"])
            print(f"{axis:<13}{value:>6}{r['step_s']:>8.2f}{r['rollout_s'] / r['step_s']:>9.0%}"
                  f"{r['learner_s'] / r['step_s']:>9.0%}{r['resample_tail_s'] / r['step_s']:>9.0%}"
                  f"{r['trained_tokens']:>12.0f}{r['generated_tokens']:>9.0f}  {top}", flush=True)
    work = [(a, v, r) for a, v, r in results if a != "model width"]
    if len(work) >= 3:
        coef, res = fit([[r["trained_tokens"], r["generated_tokens"]] for _, _, r in work],
                        [r["step_s"] for _, _, r in work])
        print(f"fit: step s = {coef[0]:.2f} + {coef[1] * 1e3:.3f} ms × trained tokens + {coef[2] * 1e3:.3f} ms × "
              "generated tokens")
        breaks = [f"{a} {v} ({e:+.0%})" for (a, v, _), e in zip(work, res) if abs(e) > 0.25]
        print("residuals: " + ", ".join(f"{a} {v} {e:+.0%}" for (a, v, _), e in zip(work, res)))
        print("breaks (> 25 % off the fit): " + (", ".join(breaks) if breaks else "none"))
    sized = [(v, r) for a, v, r in results if a == "model width"]
    if len(sized) >= 2:
        coef, res = fit([[r["params"] * (r["trained_tokens"] + r["generated_tokens"]) / 1e9] for _, r in sized],
                        [r["step_s"] for _, r in sized])
        print(f"model axis: step s = {coef[0]:.2f} + {coef[1]:.3f} s per (G params·tokens); parameters "
              + ", ".join(f"{v} {r['params'] / 1e6:.1f} M" for v, r in sized)
              + "; residuals " + ", ".join(f"{v} {e:+.0%}" for (v, _), e in zip(sized, res)))


if __name__ == "__main__":
    main()
