"""What grammar-constrained decoding costs (tether.engine.grammar): the mask per token, and decode tokens/s with and
without a constraint on the tiny model, side by side (medians over repeats).

Grammars: a tool-call grammar of two tools (``tool_choice: required``, the hermes blocks) and a JSON schema
(``response_format: json_schema``). For each:
- mask: the per-token cost of filling a request's mask and applying it to its logits row, and of accepting the token,
  replayed over the tokens of constrained generations (xgrammar on this CPU, no model);
- decode: ``--batch`` concurrent requests of the same chat prompt through a LocalEngine, sampled (T = 1, seeded), with
  the constraint and without it; generated tokens / wall time. Unconstrained requests run to ``--max-tokens`` (the
  untrained model rarely ends a turn), constrained ones end with their grammar: tokens/s is what compares.

    python benchmarks/grammar_cost.py [--threads 2] [--batch 16] [--repeats 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tether.agent.chat import render_ids
from tether.engine.base import SamplingParams
from tether.engine.grammar import Grammars, ToolSpec
from tether.engine.local import LocalEngine
from tether.learner import ensure_tiny, load_model_and_tokenizer

ORDER = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^O-[0-9]{4}$"},
                                          "urgent": {"type": "boolean"}}, "required": ["order_id", "urgent"]}
REFUND = {"type": "object", "properties": {"reason": {"type": "string", "enum": ["late", "damaged", "wrong item"]},
                                           "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["reason", "quantity"]}
ANSWER = {"type": "object", "properties": {"status": {"enum": ["shipped", "pending", "lost"]},
                                           "days": {"type": "integer", "minimum": 0, "maximum": 30},
                                           "note": {"type": "string", "maxLength": 24}},
          "required": ["status", "days", "note"], "additionalProperties": False}


def decode(engine: LocalEngine, prompt: list[int], params: list[SamplingParams]) -> tuple[float, list[list[int]]]:
    """Generated tokens/s of ``params`` run together, and their tokens."""
    async def main() -> list:
        return await asyncio.gather(*[engine.generate(prompt, p) for p in params])

    t0 = time.perf_counter()
    outs = asyncio.run(main())
    wall = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / wall, [o.token_ids for o in outs]


def mask_cost(grammar, stop: tuple[int, ...], runs: list[list[int]], vocab: int) -> tuple[float, float]:
    """Median microseconds per token to fill + apply a mask, and to accept a token, over ``runs``."""
    masks, accepts = [], []
    row = torch.zeros(1, vocab)
    for tokens in runs:
        m = grammar.matcher(stop)
        for tok in tokens:
            t0 = time.perf_counter()
            m.mask(row)
            t1 = time.perf_counter()
            m.accept(tok)
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
    return statistics.median(masks) * 1e6, statistics.median(accepts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="a HF folder (default: the tiny model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or ensure_tiny(Path(tempfile.gettempdir(), "tether-tiny"))
    model, tok = load_model_and_tokenizer(path)
    vocab = model.get_output_embeddings().weight.shape[0]
    tools = [{"type": "function", "function": {"name": "get_order_status", "parameters": ORDER}},
             {"type": "function", "function": {"name": "refund", "parameters": REFUND}}]
    prompt = render_ids(tok, [{"role": "user", "content": "Where is my order O-1234?"}], tools,
                        add_generation_prompt=True)
    stop = tuple(sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}))
    grammars = Grammars(tok, vocab)
    t0 = time.perf_counter()
    cases = {"tool_calls(required)": grammars.tool_calls([ToolSpec("get_order_status", ORDER),
                                                          ToolSpec("refund", REFUND)], required=True, parallel=False),
             "json_schema": grammars.json_schema(ANSWER, strict=True)}
    compile_ms = (time.perf_counter() - t0) * 1e3 / len(cases)
    print(f"tiny model: vocab {vocab}, {args.threads} threads, batch {args.batch}, {args.repeats} repeats; "
          f"the first {len(cases)} compiles {compile_ms:.1f} ms each (reading the vocabulary included; cached after)")
    print(f"{'grammar':<22} {'mask µs/tok':>11} {'accept µs/tok':>13} {'free tok/s':>10} {'constrained tok/s':>17} "
          f"{'ratio':>6} {'tokens/req':>10}")
    with LocalEngine(model, num_threads=args.threads) as engine:
        decode(engine, prompt, [SamplingParams(max_tokens=8, seed=0)] * args.batch)  # warm-up
        for name, grammar in cases.items():
            free, bound, runs = [], [], []
            for r in range(args.repeats):
                seeds = range(r * args.batch, (r + 1) * args.batch)
                rate, _ = decode(engine, prompt, [SamplingParams(max_tokens=args.max_tokens, seed=s,
                                                                 stop_token_ids=stop) for s in seeds])
                free.append(rate)
                rate, outs = decode(engine, prompt, [SamplingParams(max_tokens=args.max_tokens, seed=s,
                                                                    stop_token_ids=stop, constraint=grammar)
                                                     for s in seeds])
                bound.append(rate)
                runs += outs
            mask_us, accept_us = mask_cost(grammar, stop, runs, vocab)
            f, b = statistics.median(free), statistics.median(bound)
            per_req = statistics.median(len(o) for o in runs)
            print(f"{name:<22} {mask_us:>11.1f} {accept_us:>13.1f} {f:>10.0f} {b:>17.0f} {b / f:>6.2f} "
                  f"{per_req:>10.0f}")
        # the engine's shaped-row path alone (a zero logit_bias shapes nothing but takes it): what a mask rides on
        free, shaped = [], []
        for r in range(args.repeats):
            seeds = range(r * args.batch, (r + 1) * args.batch)
            free.append(decode(engine, prompt, [SamplingParams(max_tokens=args.max_tokens, seed=s,
                                                               stop_token_ids=stop) for s in seeds])[0])
            shaped.append(decode(engine, prompt, [SamplingParams(max_tokens=args.max_tokens, seed=s,
                                                                 stop_token_ids=stop, logit_bias=((0, 0.0),))
                                                  for s in seeds])[0])
        f, b = statistics.median(free), statistics.median(shaped)
        print(f"{'(shaped path, no mask)':<22} {'':>11} {'':>13} {f:>10.0f} {b:>17.0f} {b / f:>6.2f}")


if __name__ == "__main__":
    main()
