"""Merged or unmerged: how the local engine should apply a LoRA adapter, measured at the demo's shapes and a 4× wider
model's.

    python benchmarks/lora_merge.py [--rank 16] [--batch 16 64] [--threads 1]

Merged (what ``LocalEngine.update_adapter`` does): once per sync, W = W_base + s · B @ A for every adapted projection,
then decode runs the plain weights. Unmerged: no work at a sync, but every decode step adds x A^T then (·) B^T for the
7 projections of every layer. Printed per shape: the merged decode step (LocalEngine, ``--batch`` requests decoding
together, median ms per step), the low-rank products an unmerged step would add at the same rows (timed alone, the
same torch ops the layers would run), the merge per sync (``update_adapter``, median of 5), and the break-even: how
many decode steps per sync make merging cheaper. The unmerged step is not an engine of its own: its cost is the
merged step plus the measured products (a lower bound: it leaves out the extra reads and the adds).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tether.config.sections import LoraConfig
from tether.engine import SamplingParams
from tether.engine.local import LocalEngine
from tether.env.customer_service import example_texts
from tether.learner import build_tiny, load_model_and_tokenizer, lora
from tether.warmstart.tiny_sft import Recipe

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEMO = Recipe().model  # the demo's model: tiny-sft's shape (4 layers, 128 wide)
SHAPES = {"demo (128 wide)": DEMO, "4x wider (512)": {**DEMO, "hidden_size": 4 * DEMO["hidden_size"],
                                                     "intermediate_size": 4 * DEMO["intermediate_size"]}}


def median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_step_s(engine: LocalEngine, prompt: list[int], batch: int, tokens: int) -> float:
    """Median-free estimate: the engine's busy seconds per step over a generation of ``batch`` × ``tokens``."""
    async def run():
        return await asyncio.gather(*[engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=tokens,
                                                                             seed=i)) for i in range(batch)])
    before_s, before_steps = engine.stats["busy_s"], engine.stats["steps"]
    asyncio.run(run())
    return (engine.stats["busy_s"] - before_s) / max(engine.stats["steps"] - before_steps, 1)


def _push_adapter(engine: LocalEngine, adapter: dict[str, torch.Tensor], s: float, versions) -> None:
    engine.update_adapter(adapter, s, next(versions))


def lowrank_s(model, adapter: dict[str, torch.Tensor], rows: int) -> float:
    """One unmerged decode step's extra work: (x A^T) B^T for every adapted projection, x of ``rows`` rows."""
    pairs = [(adapter[f"{n}.lora_A"], adapter[f"{n}.lora_B"]) for n in {k.rsplit(".", 1)[0] for k in adapter}]
    xs = {a.shape[1]: torch.randn(rows, a.shape[1]) for a, _ in pairs}

    def step():
        for a, b in pairs:
            (xs[a.shape[1]] @ a.t()) @ b.t()
    step()
    return median_s(step, 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shares: list[float] = []
    pays: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode(False):
        for label, shape in SHAPES.items():
            path = build_tiny(Path(tmp) / label.split()[0], corpus=example_texts(100), **shape)
            model, tok = load_model_and_tokenizer(path)
            peft_model = lora.wrap(load_model_and_tokenizer(path)[0], LoraConfig(rank=args.rank))
            with torch.no_grad():
                for name, p in peft_model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.01)
            adapter, s = lora.adapter_for_engine(peft_model), lora.scaling(peft_model)
            adapter_mb = sum(t.nbytes for t in adapter.values()) / 2**20
            full_mb = sum(t.nbytes for t in model.state_dict().values()) / 2**20
            prompt = tok.encode("Where is my order ORD-1234? It is late, please check.")
            with LocalEngine(model, num_threads=args.threads, max_batch=max(args.batch)) as engine:
                versions = iter(range(1, 1000))
                merge = median_s(functools.partial(_push_adapter, engine, adapter, s, versions), 5)
                state = {k: v.clone() for k, v in model.state_dict().items()}
                full = median_s(lambda: engine.update_weights(state, next(versions)), 5)  # noqa: B023 — called here
                print(f"{label}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, rank "
                      f"{args.rank} adapter {adapter_mb:.3f} MiB vs {full_mb:.2f} MiB of weights "
                      f"({full_mb / adapter_mb:.0f}x); merge per sync {1e3 * merge:.1f} ms (a full-weights load: "
                      f"{1e3 * full:.1f} ms)")
                for rows in args.batch:
                    step = decode_step_s(engine, prompt, rows, args.tokens)
                    extra = lowrank_s(model, adapter, rows)
                    shares.append(extra / step)
                    pays.append(merge / extra)
                    print(f"  {rows:>3} rows: merged decode step {1e3 * step:.2f} ms; unmerged adds >= "
                          f"{1e3 * extra:.2f} ms ({100 * extra / step:.0f} %); merging pays off after "
                          f"{merge / extra:.1f} decode steps per sync")

    print(f"merged: unmerged would add >= {100 * min(shares):.0f}-{100 * max(shares):.0f} % to every decode step; "
          f"merging pays off after {min(pays):.0f}-{max(pays):.0f} decode steps per sync")


if __name__ == "__main__":
    main()
