"""Where one demo RL step spends its time: stages, FLOPs, achieved GFLOP/s beside a matmul roofline.

    python benchmarks/step_profile.py [--steps 4] [--warmup 1] [--threads 2] [--model DIR] [--set key=value]

The demo's workload (examples/customer_service/config.yaml: its tiny-sft warm start, 8 tasks × 8 rollouts, sync
mode): ``warmup + steps`` trainer steps of the real loop (``tether.pipeline.trainer.train``) with held-out
evaluation and checkpoints switched off, each step broken into stages by ``stage_timers.py`` (wrappers around the
pipeline's own functions, so the same script measures an older tree: ``PYTHONPATH=/tmp/speed-base``).

Per stage: wall seconds per step (median over the measured steps), its share of the median step, GFLOP per step
(from the model config and the tokens each call saw; useful FLOPs, padding not counted), the achieved GFLOP/s,
and the roofline: fp32 matmul GFLOP/s measured in this run at the stage's own shapes (its mean rows per call ×
the model's linear layers; backward: the two products of the gradient) and torch threads (half of them for the
engine and the learner when they ran side by side). The engine thread (prefill, decode, KV
moves) works while the event-loop thread runs the environment and templates, so those rows overlap in wall time;
the learner's rows add up, and with ``learner.overlap_rollout`` (sync mode) they run beside the engine's: each
group is trained as it finishes, so most of the learner's time is spent during the rollout phase.
"filter resampling" is the wall time of the rollout phase after the last first
attempt finished (the tail the degenerate-group filter's resampling adds), with the trajectories it generated.

The last line is ``median step = X.XX s`` (the trainer's ``perf/step_time``: batch, update, weight sync); the line
before it, the step's process CPU time (all threads), which other programs on the machine disturb far less.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tether.threads import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_timers import STAGES, TRAINER_STAGES, Flops, Timers, attach, matmul_gflops  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "customer_service" / "config.yaml"


class StepRecorder:
    """Snapshots the timers at the end of every trainer step (wraps ``trainer.step_metrics``)."""

    def __init__(self, timers: Timers):
        self.timers, self.steps = timers, []
        self.groups: list[tuple[str, float, float]] = []  # (task id, start, end) of every Rollouter.group call
        self.cpu_mark = time.process_time()  # process CPU seconds (all threads) at the last step's end

    def snapshot(self) -> None:
        t = self.timers
        first_end: dict[str, float] = {}
        for task, _, end in self.groups:
            first_end.setdefault(task, end)
        ends = [end for _, _, end in self.groups]
        tail = max(ends) - max(first_end.values()) if ends else 0.0
        cpu, self.cpu_mark = time.process_time() - self.cpu_mark, time.process_time()
        self.steps.append({"cpu": cpu, "wall": dict(t.wall), "flops": dict(t.flops), "tokens": dict(t.tokens),
                           "rows": {k: statistics.mean(v) for k, v in t.shapes.items() if v},
                           "extra": dict(t.extra), "resample_tail": tail,
                           "resample_calls": len(self.groups) - len(first_end)})
        t.reset()
        self.groups = []


def instrument(timers: Timers, model_config: Any) -> StepRecorder:
    from tether.pipeline import build, trainer
    from tether.pipeline.rollouter import Rollouter

    attach(timers, model_config)
    rec = StepRecorder(timers)
    step_metrics = trainer.step_metrics

    @functools.wraps(step_metrics)
    def step_end(*args: Any, **kwargs: Any) -> None:
        step_metrics(*args, **kwargs)
        rec.snapshot()

    trainer.step_metrics = step_end  # type: ignore[assignment]
    group = Rollouter.group

    @functools.wraps(group)
    async def timed_group(self: Any, task: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = await group(self, task, *args, **kwargs)
        rec.groups.append((task.id, t0, time.perf_counter()))
        return out

    Rollouter.group = timed_group  # type: ignore[method-assign]
    build.Run.eval = lambda self, step: {}  # type: ignore[assignment,method-assign]  # no held-out eval here
    build.Run.save = lambda self, step: None  # type: ignore[assignment,method-assign]  # nor checkpoints
    return rec


_INSTRUMENTED: dict[str, StepRecorder] = {}


def default_model(cfg: Any) -> str:
    from tether.runtime import model_path

    return model_path(cfg)


def profile(model: str | None, steps: int, warmup: int, overrides: list[str], run_dir: Path | None = None,
            files: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Run ``warmup + steps`` demo steps under the timers; returns the per-step records and the metrics rows."""
    from tether.config import load_config
    from tether.learner.model import load_model_and_tokenizer
    from tether.pipeline.trainer import train

    cfg = load_config([DEMO, *files], [f"trainer.total_steps={warmup + steps}", "trainer.eval_every=0",
                                       "trainer.save_every=0", "metrics.tensorboard=false", *overrides])
    model = model or default_model(cfg)
    config = load_model_and_tokenizer(model, cfg.model.dtype)[0].config
    if "recorder" not in _INSTRUMENTED:  # wrapped once per process; FLOPs are counted for the first model
        _INSTRUMENTED["recorder"] = instrument(Timers(), config)
    rec = _INSTRUMENTED["recorder"]
    rec.steps, rec.groups, rec.cpu_mark = [], [], time.process_time()
    rec.timers.reset()
    with tempfile.TemporaryDirectory() as tmp:
        out = run_dir or Path(tmp) / "run"
        train(cfg, out, model_dir=model, show_progress=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    return {"steps": rec.steps[warmup:], "rows": rows[warmup:], "config": config, "cfg": cfg}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def threads_of(stage: str, rows: list[dict[str, Any]]) -> int:
    """The torch threads a stage ran with: the learner's worker beside the rollout has half
    (``tether.pipeline.streaming``), the engine's thread too while the learner trains (all of them while it waits:
    its roofline is given at half, the lower bound); everything else all of them."""
    overlapped = any(r.get("perf/learner_overlap_s", 0) > 0 for r in rows)
    if overlapped and (stage in TRAINER_STAGES or stage in ("prefill", "decode")):
        return max(1, torch.get_num_threads() // 2)
    return torch.get_num_threads()


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    steps, rows, fl = result["steps"], result["rows"], Flops.of(result["config"])
    step_time = [r["perf/step_time"] for r in rows]
    table: dict[str, dict[str, float]] = {}
    lin = fl.linears()
    head = [(fl.hidden, fl.vocab)]
    for stage in STAGES:
        wall = [s["wall"].get(stage, 0.0) for s in steps]
        flops = [s["flops"].get(stage, 0.0) for s in steps]
        rows_m = [s["rows"][stage] for s in steps if stage in s["rows"]]
        entry = {"wall_s": _median(wall), "gflop": _median(flops) / 1e9,
                 "tokens": _median([s["tokens"].get(stage, 0) for s in steps])}
        entry["gflops"] = sum(flops) / 1e9 / sum(wall) if sum(wall) and sum(flops) else 0.0
        roof_stage = {"reference forward": "forward", "pi_prox scoring": "forward"}.get(stage, stage)
        rows_r = rows_m or [s["rows"][roof_stage] for s in steps if roof_stage in s["rows"]]
        if rows_r and entry["gflop"]:
            shapes = lin + (head if stage != "prefill" else [])
            with torch_threads(threads_of(stage, rows)):  # the roofline at the threads the stage ran with
                entry["roofline"] = matmul_gflops(int(_median(rows_r)), shapes, backward=stage == "backward")
            entry["rows"] = _median(rows_r)
        table[stage] = entry
    tail = _median([s["resample_tail"] for s in steps])
    table["filter resampling"] = {"wall_s": tail, "gflop": 0.0, "tokens": 0, "gflops": 0.0}
    padded = sum(s["extra"].get("learner padded tokens", 0) for s in steps)
    real = sum(s["extra"].get("learner real tokens", 0) for s in steps)
    counts = {k: _median([r.get(k, 0) for r in rows]) for k in
              ("rollout/generated_trajectories", "rollout/resampled_trajectories", "rollout/trained_trajectories",
               "perf/trainer_idle_ratio", "perf/engine_busy_s", "perf/learner_overlap_s",
               "perf/learner_after_rollout_s")}
    return {"median_step_s": _median(step_time), "step_times": step_time, "stages": table,
            "median_step_cpu_s": _median([s["cpu"] for s in steps]),
            "rollout_phase_s": _median([r["perf/step_time"] * r["perf/trainer_idle_ratio"] for r in rows]),
            "learner_padding": 1 - real / padded if padded else 0.0, "counts": counts}


def render(s: dict[str, Any], threads: int) -> str:
    med = s["median_step_s"]
    lines = [f"{'stage':<22}{'thread':<9}{'wall s':>8}{'share':>7}{'GFLOP':>8}{'GFLOP/s':>9}{'roofline':>10}"
             f"{'rows':>8}"]
    for stage, e in s["stages"].items():
        thread = "learner" if stage in TRAINER_STAGES else ("engine" if stage in ("prefill", "decode", "kv moves")
                                                            else "loop")
        roof = f"{e['roofline']:>10.1f}" if "roofline" in e else f"{'':>10}"
        rows = f"{e['rows']:>8.0f}" if "rows" in e else f"{'':>8}"
        gf = f"{e['gflops']:>9.1f}" if e["gflops"] else f"{'':>9}"
        lines.append(f"{stage:<22}{thread:<9}{e['wall_s']:>8.2f}{e['wall_s'] / med:>7.0%}{e['gflop']:>8.2f}{gf}"
                     f"{roof}{rows}")
    c = s["counts"]
    trained = c["rollout/trained_trajectories"] or 1
    gen = c["rollout/generated_trajectories"] + c["rollout/resampled_trajectories"]
    lines += [f"rollout phase (the step's batch generated): {s['rollout_phase_s']:.2f} s; "
              f"engine busy {c['perf/engine_busy_s']:.2f} s",
              f"learner beside the rollout {c.get('perf/learner_overlap_s', 0):.2f} s, after it "
              f"{c.get('perf/learner_after_rollout_s', 0):.2f} s (learner.overlap_rollout)",
              f"trajectories per step: {gen:.0f} generated ({c['rollout/resampled_trajectories']:.0f} resampled), "
              f"{c['rollout/trained_trajectories']:.0f} trained → {gen / trained:.2f} generated per trained",
              f"learner padding: {s['learner_padding']:.0%} of forwarded positions; torch threads {threads}",
              "step times: " + " ".join(f"{t:.2f}" for t in s["step_times"]),
              f"median step CPU = {s['median_step_cpu_s']:.2f} s (process CPU time, all threads: the step's cost "
              "when other programs share the cores)",
              f"median step = {med:.2f} s"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="measured steps")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (process-wide)")
    ap.add_argument("--model", default=None, help="HF folder to start from (default: the tiny-sft preset)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import tether

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"tether from {Path(tether.__file__).parent}; load: {load}", flush=True)
    asyncio.set_event_loop_policy(None)
    summary = summarise(profile(args.model, args.steps, args.warmup, args.overrides))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    print(render(summary, args.threads), flush=True)


if __name__ == "__main__":
    main()
