"""An agent program trained as it is: the demo's RL phase played by examples/openai_agent/agent.py (official openai
SDK, every call over HTTP to its episode's endpoint) vs tether's own tool_agent loop, side by side.

For each seed, from the same SFT warm start (the demo's): 16 GRPO steps with the native loop, then the same with
``agent_loop.name: program``. Prints held-out success at every evaluation, wall time, median step time, and the
train-inference mismatch the learner measured on the recorded tokens (``rollout/logp_abs_diff_mean``). Then 64
episodes of the program on the warm start with a teacher-forced forward pass over every stitched segment: the
largest |recorded logprob - teacher-forced logprob| over all generated tokens, and the segments per episode (1 when
the program's re-rendered history is the tokens the engine produced).

    python benchmarks/program_learning.py [--seeds 0] [--steps 16] [--sft DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import torch

from demo_rl import REPO, rl_run, warm_start_dir
from tether.config import load_config
from tether.env.plugin.registry import search_beside
from tether.runtime import Runtime, agent_loop

EXAMPLE = REPO / "examples" / "openai_agent" / "config.yaml"


def step_time(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["perf/step_time"] for r in rows if "perf/step_time" in r)


def mismatch(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [r["rollout/logp_abs_diff_mean"] for r in rows if "rollout/logp_abs_diff_mean" in r]
    return max(values) if values else float("nan")


def teacher_forced(sft: Path, episodes: int) -> tuple[float, int, float]:
    """(max |Δ logprob|, generated tokens compared, segments per episode) of ``episodes`` program episodes."""
    cfg = load_config([REPO / "examples" / "customer_service" / "config.yaml", EXAMPLE], [])
    rt = Runtime.build(cfg, model_dir=str(sft))
    loop = agent_loop(cfg, rt.engine, rt.tokenizer, window=rt.window)
    tasks = rt.tasks("train")[:episodes]

    async def play():
        return await asyncio.gather(*(loop.run(t, rt.make_env(), seed=i) for i, t in enumerate(tasks)))

    try:
        trajs = asyncio.run(play())
    finally:
        loop.close()
        rt.close()
    worst, n, temperature = 0.0, 0, cfg.engine.temperature
    with torch.no_grad():
        for traj in trajs:
            for seg in traj.segments:
                logits = rt.model(torch.tensor([seg.prompt_ids + seg.response_ids])).logits[0].float()
                logp = torch.log_softmax(logits / temperature, -1)
                p = len(seg.prompt_ids)
                for j, (tok, m, lp) in enumerate(zip(seg.response_ids, seg.response_mask, seg.logprobs)):
                    if m:
                        worst, n = max(worst, abs(float(logp[p + j - 1, tok]) - lp)), n + 1
    return worst, n, sum(len(t.segments) for t in trajs) / len(trajs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sft", type=Path, default=None, help="an SFT checkpoint (default: the demo's warm start)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "tether-program-learning")
    args = ap.parse_args()
    search_beside([EXAMPLE])  # agent_loop.program: agent:agent, beside its config
    sft = warm_start_dir(args.sft, args.out)
    for seed in args.seeds:
        over = [f"trainer.seed={seed}", f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.steps // 2}"]
        native = rl_run(sft, args.out / f"native-{seed}", over)
        program = rl_run(sft, args.out / f"program-{seed}", over, files=(EXAMPLE,))
        for name, r in (("tool_agent", native), ("program", program)):
            curve = " ".join(f"{s}:{v:.1%}" for s, v in sorted(r["curve"].items()))
            run = args.out / f"{'native' if name == 'tool_agent' else 'program'}-{seed}"
            print(f"seed {seed} {name:10s} held-out {curve}  wall {r['wall_s']:.0f} s  median step "
                  f"{step_time(run):.2f} s  mismatch |Δlogp| mean (max over steps) {mismatch(run):.2e}")
        gap = (program["after"] - native["after"]) * 100
        print(f"seed {seed} program - tool_agent at step {args.steps}: {gap:+.1f} points")
    worst, n, segments = teacher_forced(sft, 64)
    print(f"teacher-forced: max |recorded - teacher-forced logprob| {worst:.2e} over {n} generated tokens of 64 "
          f"episodes; {segments:.2f} segments per episode")


if __name__ == "__main__":
    main()
