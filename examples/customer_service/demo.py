"""The CPU demo: a tiny model learns the customer-service task, SFT warm start → GRPO.

    python examples/customer_service/demo.py [--seeds 0 1 2] [--run-dir runs/demo]

1. the warm start: the ``model.preset: tiny-sft`` that config.yaml names — the tiny preset (random weights,
   tokenizer trained on the environment's texts) fine-tuned on demonstrations of a deliberately imperfect expert,
   replayed through the real agent loop so the tokens are exactly those RL will generate
   (``tether.warmstart.tiny_sft``); built once into the cache (``$TETHER_CACHE``), where ``tether train
   config.yaml`` finds it, and timed here when built;
2. run GRPO in sync mode (config.yaml) for each seed (``trainer.seed``: RL's seed; every seed starts from the same
   warm start) and print held-out success before and after RL;
3. end with the before → after figures, the report of each run (``tether report``) and two commands to try next.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # before transformers loads: no tqdm bars in the demo

import torch  # noqa: E402

from tether.config import RunConfig, load_config  # noqa: E402
from tether.pipeline.trainer import train  # noqa: E402
from tether.report import ReportError, build_report  # noqa: E402
from tether.runtime import model_path  # noqa: E402

HERE = Path(__file__).resolve().parent


def say(msg: str) -> None:
    print(msg, flush=True)


def warm_start(cfg: RunConfig) -> tuple[Path, float]:
    """The config's ``tiny-sft`` preset (built into the cache on first use, as ``tether train`` does) and the seconds
    it took here (~0 when it was cached)."""
    t0 = time.perf_counter()
    say("[demo] warm start: the tiny-sft preset (the tiny model after SFT on the expert's demonstrations; built once "
        "into the cache, a few minutes on 2 idle cores)…")
    path = Path(model_path(cfg))
    return path, time.perf_counter() - t0


def run(seed: int, run_root: Path, overrides: list[str], sft_dir: Path) -> dict:
    cfg = load_config([HERE / "config.yaml"], [f"trainer.seed={seed}", *overrides])
    out = run_root / f"seed{seed}"
    t0 = time.perf_counter()
    if (out / "rl").exists():  # the demo's own directory: a new demo replaces the previous one's RL run
        say(f"[demo] replacing the previous demo run in {out / 'rl'}")
        shutil.rmtree(out / "rl")
    say(f"[demo] seed {seed}: GRPO for {cfg.trainer.total_steps} steps; each evaluation's conversations go to "
        f"{out / 'rl' / 'validation'}")
    result = train(cfg, out / "rl", model_dir=str(sft_dir))
    before, after = result.eval_before["eval/success_rate"], result.eval_after["eval/success_rate"]
    summary = {"seed": seed, "sft_success": before, "rl_success": after, "gain": after - before,
               "total_s": round(time.perf_counter() - t0, 1), "run_dir": str(out / "rl")}
    say(f"[demo] seed {seed}: held-out success {before:.1%} after SFT → {after:.1%} after RL "
        f"({(after - before) * 100:+.1f} points) in {summary['total_s']:.0f} s; run directory {out / 'rl'}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    args = ap.parse_args()
    torch.set_num_threads(2)
    sft_dir, sft_s = warm_start(load_config([HERE / "config.yaml"], args.overrides))
    results = [{**run(s, args.run_dir, args.overrides, sft_dir), "sft_s": round(sft_s, 1)} for s in args.seeds]
    (args.run_dir / "summary.json").write_text(json.dumps(results, indent=2))
    for line in closing(results):
        say(line)


def closing(results: list[dict]) -> list[str]:
    """The demo's last lines: held-out success before → after RL per seed (and the mean gain), each run's report
    (built here, as ``tether report`` builds it), and the two commands a newcomer runs next on the first run."""
    lines = ["", "[demo] done. Held-out success (greedy, the environment's eval split):"]
    for r in results:
        lines.append(f"  seed {r['seed']}: {r['sft_success']:.1%} after SFT → {r['rl_success']:.1%} after RL "
                     f"({r['gain'] * 100:+.1f} points, RL in {r['total_s']:.0f} s)")
    if len(results) > 1:
        lines.append(f"  mean gain over {len(results)} seeds: "
                     f"{sum(r['gain'] for r in results) / len(results) * 100:+.1f} points")
    for r in results:
        try:
            lines.append(f"[demo] report of seed {r['seed']}: {build_report(r['run_dir']).index}")
        except (ReportError, OSError) as e:  # the run is done: a report that cannot be built is a note
            lines.append(f"[demo] no report for seed {r['seed']} ({e}); build it with tether report {r['run_dir']}")
    run_dir = Path(results[0]["run_dir"])
    last = max(run_dir.glob("checkpoints/step_*"), key=lambda p: int(p.name.split("_")[1]), default=None)
    lines += ["[demo] next:",
              f"  tether verify optim {run_dir}    # is it learning? the signal, gradient and KL criteria, per step"]
    if last is not None:
        lines.append(f"  tether eval {last} --config {HERE / 'config.yaml'}    # the trained policy on the eval split")
    return lines


if __name__ == "__main__":
    main()
