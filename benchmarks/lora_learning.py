"""Does RL with a LoRA adapter learn? The demo's RL phase (16 steps from the tiny-sft warm start) with ``model.lora``
against full fine-tuning, seed by seed, side by side in one run.

    python benchmarks/lora_learning.py [--seeds 0 1 2] [--rank 16] [--lr 5e-4] [--no-full]

Prints per seed and arm: held-out success before → after (64 tasks), the largest step KL to the reference (the demo's
``max_kl`` is 0.05), the weight-sync MiB per sync, the wall time;
then, on the last LoRA checkpoint, the engine's behaviour logprobs with the trained adapter merged vs a teacher-forced
forward of ``PeftModel.from_pretrained(base, checkpoint)`` (unmerged), max |Δ| in float32.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from demo_rl import DEMO, rl_run  # noqa: E402
from tether.config import load_config  # noqa: E402
from tether.runtime import model_path  # noqa: E402


def sync_mb(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per = [r["perf/weight_sync_mb"] for r in rows if r.get("step", 0) > 0 and "perf/weight_sync_mb" in r]
    return statistics.median(per) if per else float("nan")


def engine_vs_peft(base_dir: str, ckpt: Path) -> dict[str, tuple[float, float]]:
    """max |engine logprob − teacher-forced logprob| over the tokens the engine samples from 8 prompts (and the
    largest |logit|): the base engine vs the base (the engine's own float32 floor), the engine with the checkpoint's
    adapter merged vs ``PeftModel.from_pretrained`` (unmerged) and vs peft's ``merge_and_unload`` (merged)."""
    from peft import PeftModel  # noqa: PLC0415

    from tether.engine import SamplingParams  # noqa: PLC0415
    from tether.engine.local import LocalEngine  # noqa: PLC0415
    from tether.learner import load_model_and_tokenizer, lora  # noqa: PLC0415

    base, tok = load_model_and_tokenizer(base_dir)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(ckpt)).eval()
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Where is my order ORD-{1000 + i}?"}],
                                                  add_generation_prompt=True, tokenize=False)) for i in range(8)]

    async def sample(engine):
        return await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=1.0, max_tokens=48, seed=i))
                                      for i, p in enumerate(prompts)])

    def gap(model, results) -> tuple[float, float]:
        worst = top = 0.0
        with torch.no_grad():
            for p, r in zip(prompts, results):
                logits = model(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1:-1].float()
                ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
                worst = max(worst, (ref - torch.tensor(r.logprobs)).abs().max().item())
                top = max(top, logits.abs().max().item())
        return worst, top
    with LocalEngine(copy.deepcopy(base)) as engine:
        floor = gap(base, asyncio.run(sample(engine)))
    with LocalEngine(base) as engine:
        engine.update_adapter(lora.adapter_for_engine(peft_model), lora.scaling(peft_model), 1)
        results = asyncio.run(sample(engine))
    return {"base engine vs the base (floor)": floor, "adapter engine vs peft, unmerged": gap(peft_model, results),
            "adapter engine vs peft, merged": gap(merged, results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", type=float, default=5e-4, help="LoRA's learning rate (full fine-tuning: the demo's)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--no-full", action="store_true", help="skip the full fine-tuning arm")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/lora_learning"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    sft = Path(model_path(load_config([DEMO / "config.yaml"], [])))  # the tiny-sft preset (built once)
    arms = {f"lora r={args.rank} lr={args.lr:g}": [f"model.lora.rank={args.rank}", f"model.lora.alpha={args.alpha}",
                                                    f"policy_optimization.optimizer.lr={args.lr}"]}
    if not args.no_full:
        arms["full fine-tuning"] = []
    table: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in args.seeds:
        for arm, sets in arms.items():
            run_dir = args.out / f"{'lora' if sets else 'full'}_s{seed}"
            r = rl_run(sft, run_dir, [f"trainer.seed={seed}", f"trainer.total_steps={args.steps}",
                                      f"trainer.save_every={args.steps}", *sets])
            r["sync_mb"], r["run_dir"] = sync_mb(run_dir), run_dir
            table[arm].append(r)
            print(f"seed {seed} {arm:>24}: held-out success {r['before']:.3f} -> {r['after']:.3f} "
                  f"({100 * (r['after'] - r['before']):+.1f} points), largest KL {r['kl_max']:.3f}, sync "
                  f"{r['sync_mb']:.3f} MiB, {r['wall_s']:.0f} s", flush=True)
    print()
    for arm, rows in table.items():
        gains = [100 * (r["after"] - r["before"]) for r in rows]
        print(f"{arm:>24}: gain per seed {', '.join(f'{g:+.1f}' for g in gains)} points "
              f"(mean {statistics.mean(gains):+.1f}); sync {statistics.median(r['sync_mb'] for r in rows):.3f} MiB")
    lora_rows = next(iter(table.values()))
    if "full fine-tuning" in table:
        full = statistics.median(r["sync_mb"] for r in table["full fine-tuning"])
        print(f"sync bytes full / LoRA: {full / statistics.median(r['sync_mb'] for r in lora_rows):.1f}x")
    ckpt = lora_rows[-1]["run_dir"] / "checkpoints" / f"step_{args.steps}"
    print(f"behaviour logprobs vs a teacher-forced float32 forward, 8 x 48 sampled tokens, adapter of {ckpt}:")
    gaps = engine_vs_peft(str(sft), ckpt)
    for label, (gap, top) in gaps.items():
        print(f"  {label:>34}: max |dlogp| {gap:.2e} (largest |logit| {top:.1f})")
    lora_gain = statistics.mean(r["after"] - r["before"] for r in lora_rows)
    line = (f"LoRA r={args.rank}: mean held-out gain {100 * lora_gain:+.1f} points over {len(args.seeds)} seeds in "
            f"{args.steps} steps")
    if "full fine-tuning" in table:
        full_rows = table["full fine-tuning"]
        line += (f" vs full fine-tuning {100 * statistics.mean(r['after'] - r['before'] for r in full_rows):+.1f}; "
                 f"sync {statistics.median(r['sync_mb'] for r in lora_rows):.2f} vs "
                 f"{statistics.median(r['sync_mb'] for r in full_rows):.2f} MiB")
    floor, unmerged = gaps["base engine vs the base (floor)"][0], gaps["adapter engine vs peft, unmerged"][0]
    print(f"{line}; engine vs peft max |dlogp| {unmerged:.1e} (the base engine's own: {floor:.1e})")


if __name__ == "__main__":
    main()
