"""The CPU demo: a tiny model learns the customer-service task, SFT warm start → GRPO.

    python examples/customer_service/demo.py [--seeds 0 1 2] [--run-dir runs/demo]

1. build the tiny preset (random weights, tokenizer trained on the environment's texts);
2. warm-start it by SFT on demonstrations of a deliberately imperfect expert (imperfect_expert.py),
   replayed through the real agent loop so the tokens are exactly those RL will generate;
3. run GRPO in sync mode (config.yaml) and print held-out success before and after RL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from entities import (CopyTask, EntitySwap, EntityVocab, copy_pretrain, init_entity_embeddings,  # noqa: E402
                      tied_class_gradients, world_entities)
from imperfect_expert import ImperfectExpert  # noqa: E402

from tether.agent.loop import LoopLimits  # noqa: E402
from tether.agent.replay import demonstrate  # noqa: E402
from tether.config import RunConfig, load_config  # noqa: E402
from tether.env.customer_service import example_texts  # noqa: E402
from tether.learner.model import build_tiny, load_model_and_tokenizer  # noqa: E402
from tether.learner.sft import sft  # noqa: E402
from tether.learner.tiny import IM_START  # noqa: E402
from tether.pipeline.trainer import train  # noqa: E402
from tether.runtime import env_factory  # noqa: E402
from tether.types import Trajectory  # noqa: E402

# The demo's model: the tiny preset, narrowed so that SFT + RL fit in a few minutes on 2 cores.
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
COPY = dict(steps=100, lr=3e-3, batch_size=32)  # the copy task alone, before SFT
SFT_DIALOGUE = dict(epochs=12, lr=3e-3, batch_size=8)  # system prompt dropped, copy task alongside
SFT_FULL = dict(epochs=3, lr=1e-3, batch_size=8)  # the exact sequences RL will generate
MISTAKE_RATE = 0.6


def say(msg: str) -> None:
    print(msg, flush=True)


def without_system_prompt(traj: Trajectory, turn_start: int) -> Trajectory:
    """The trajectory from its first user turn on: the system prompt and tool list (~290 of its ~400
    tokens, the same in every demonstration) dropped, so an epoch costs a quarter."""
    first_user = traj.prompt_ids.index(turn_start, 1)
    return replace(traj, prompt_ids=traj.prompt_ids[first_user:])


def warm_start(cfg: RunConfig, out: Path, seed: int) -> Path:
    """Build the tiny model and fine-tune it on imperfect demonstrations; returns the HF folder."""
    names = world_entities(cfg)
    base = build_tiny(out / "base", corpus=example_texts(400), seed=seed,
                      extra_tokens=[e for v in names.values() for e in v], **MODEL)
    model, tokenizer = load_model_and_tokenizer(base)
    vocab = EntityVocab.build(names, tokenizer)
    init_entity_embeddings(model, vocab, seed)
    make_env, tasks = env_factory(cfg)
    rng = random.Random(seed)
    limits = LoopLimits.from_config(cfg.agent_loop, cfg.environment.state.context_window)

    async def collect():
        jobs = [demonstrate(t, make_env, ImperfectExpert(MISTAKE_RATE, random.Random(rng.random())).act, tokenizer,
                            limits=limits, max_tokens=cfg.engine.max_tokens)
                for t in tasks("train")]
        return await asyncio.gather(*jobs)

    demos = asyncio.run(collect())
    ok = sum(d.success for d in demos) / len(demos)
    say(f"[sft] {len(demos)} demonstrations, expert success {ok:.0%}, "
        f"{sum(len(d.prompt_ids) + len(d.response_ids) for d in demos) / len(demos):.0f} tokens each; "
        f"{sum(len(v) for v in names.values())} entity tokens ({', '.join(f'{len(v)} {c}' for c, v in names.items())})")
    pools = vocab.pools(t for d in demos for t in d.prompt_ids + d.response_ids)  # train entities only
    entity_ids = {i for v in vocab.ids.values() for i in v}
    copy_task = CopyTask(pools, vocab.markers, seed=seed, pad_id=tokenizer.pad_token_id,
                         filler=[t for d in demos for t in d.prompt_ids + d.response_ids if t not in entity_ids])
    swap = EntitySwap(pools)
    turn_start = tokenizer.convert_tokens_to_ids(IM_START)
    torch.manual_seed(seed)
    log = lambda m: say(f"[sft] {m}")  # noqa: E731
    with tied_class_gradients(model, vocab):
        copy_pretrain(model, copy_task, log=log, **COPY)
        sft(model, [without_system_prompt(d, turn_start) for d in demos], pad_id=tokenizer.pad_token_id,
            seed=seed, augment=swap, extra_loss=copy_task.loss, log=log, **SFT_DIALOGUE)
        sft(model, demos, pad_id=tokenizer.pad_token_id, seed=seed, augment=swap, log=log, **SFT_FULL)
    folder = out / "sft"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(seed: int, run_root: Path, overrides: list[str]) -> dict:
    cfg = load_config([HERE / "config.yaml"], [f"trainer.seed={seed}", *overrides])
    out = run_root / f"seed{seed}"
    t0 = time.perf_counter()
    sft_dir = warm_start(cfg, out, seed)
    t_sft = time.perf_counter() - t0
    result = train(cfg, out / "rl", model_dir=str(sft_dir))
    before, after = result.eval_before["eval/success_rate"], result.eval_after["eval/success_rate"]
    summary = {"seed": seed, "sft_success": before, "rl_success": after, "gain": after - before,
               "sft_s": round(t_sft, 1), "total_s": round(time.perf_counter() - t0, 1), "run_dir": str(out / "rl")}
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
    results = [run(s, args.run_dir, args.overrides) for s in args.seeds]
    (args.run_dir / "summary.json").write_text(json.dumps(results, indent=2))
    if len(results) > 1:
        mean = sum(r["gain"] for r in results) / len(results)
        say(f"[demo] mean gain over {len(results)} seeds: {mean * 100:+.1f} points")


if __name__ == "__main__":
    main()
