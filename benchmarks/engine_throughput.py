"""Generated tokens/s: LocalEngine (continuous batching) vs plain ``model.generate`` on an agentic workload.

Workload: 64 multi-turn conversations with the tiny model. Each starts from a chat-templated prompt
(system + two tools + a user message); each turn asks for a continuation with its own budget
(max_tokens drawn between 8 and 128, no stop ids, greedy, so every request produces exactly its budget),
then appends the model's reply and a fixed fake tool result before the next turn.

- engine: the 64 conversations are 64 asyncio tasks; turn k+1 starts as soon as turn k returns.
- generate: turn by turn, all 64 current turns batched (left padding, KV cache on, greedy),
  max_new_tokens = the longest budget in the batch; tokens past a request's own budget are discarded.
Both count only the tokens the requests asked for. Usage:

    python benchmarks/engine_throughput.py [--threads 2] [--repeats 3] [--conversations 64] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

from tether.engine.base import SamplingParams
from tether.engine.local import LocalEngine
from tether.learner import ensure_tiny, load_model_and_tokenizer
from tether.learner.tiny import tool_schema

TOOL_RESULT = ('<|im_end|>\n<|im_start|>user\n<tool_response>\n{"status": "ok", "count": 3}\n</tool_response>'
               '<|im_end|>\n<|im_start|>assistant\n')
USER_ASKS = ["Where is my order ORD-{n}?", "Is SKU-{n} in stock?", "Can you help me?",
             "I want a refund for order ORD-{n}, it arrived damaged.",
             "Please check order ORD-{n} and tell me when it ships."]


def make_workload(tokenizer, conversations: int, turns: int, seed: int = 0):
    """Per conversation: the first prompt's ids and the token budget of each turn."""
    rng = random.Random(seed)
    tools = [tool_schema("query_inventory"), tool_schema("check_refund_policy")]
    prompts, budgets = [], []
    for _ in range(conversations):
        messages = [{"role": "system", "content": "You are a customer support agent."},
                    {"role": "user", "content": rng.choice(USER_ASKS).format(n=rng.randint(1000, 99999))}]
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text))
        budgets.append([rng.randint(8, 128) for _ in range(turns)])
    return prompts, budgets, tokenizer.encode(TOOL_RESULT)


def run_engine(engine: LocalEngine, prompts, budgets, tool_ids) -> tuple[int, float]:
    async def conversation(prompt, turn_budgets):
        ids, produced = list(prompt), 0
        for budget in turn_budgets:
            out = await engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=budget))
            assert len(out.token_ids) == budget, (len(out.token_ids), budget)
            produced += budget
            ids += out.token_ids + tool_ids
        return produced

    async def main():
        return sum(await asyncio.gather(*[conversation(p, b) for p, b in zip(prompts, budgets)]))

    start = time.perf_counter()
    tokens = asyncio.run(main())
    return tokens, time.perf_counter() - start


def run_generate(model, pad_id: int, prompts, budgets, tool_ids) -> tuple[int, float]:
    contexts, produced = [list(p) for p in prompts], 0
    start = time.perf_counter()
    for turn in range(len(budgets[0])):
        turn_budgets = [b[turn] for b in budgets]
        longest = max(len(c) for c in contexts)
        ids = torch.tensor([[pad_id] * (longest - len(c)) + c for c in contexts])
        mask = torch.tensor([[0] * (longest - len(c)) + [1] * len(c) for c in contexts])
        config = GenerationConfig(max_new_tokens=max(turn_budgets), do_sample=False, eos_token_id=None,
                                  pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] == longest + max(turn_budgets)  # no early stop: every budget is exact
        for c, row, budget in zip(contexts, out[:, longest:].tolist(), turn_budgets):
            c += row[:budget] + tool_ids
            produced += budget
    return produced, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--batch1-subset", type=int, default=4, help="conversations for the batch=1 line (0: skip)")
    ap.add_argument("--model", default=None, help="HF model folder (default: the tiny preset)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    path = args.model or ensure_tiny(Path(tempfile.gettempdir(), "tether-tiny"))
    model, tokenizer = load_model_and_tokenizer(path)
    prompts, budgets, tool_ids = make_workload(tokenizer, args.conversations, args.turns)
    requested = sum(map(sum, budgets))
    print(f"model: {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params), "
          f"threads: {torch.get_num_threads()}")
    print(f"workload: {args.conversations} conversations x {args.turns} turns, budgets 8-128 "
          f"({requested} tokens requested), first prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens")

    with LocalEngine(model, num_threads=args.threads) as engine:  # warm-up
        run_engine(engine, prompts[:8], [b[:1] for b in budgets[:8]], tool_ids)
    run_generate(model, tokenizer.pad_token_id, prompts[:8], [b[:1] for b in budgets[:8]], tool_ids)
    rates = {"engine": [], "generate": []}
    for r in range(args.repeats):
        with LocalEngine(model, num_threads=args.threads) as engine:  # fresh: no prefixes cached
            tokens, dt = run_engine(engine, prompts, budgets, tool_ids)
            reused = engine.stats["cached_prompt_tokens"] / engine.stats["prompt_tokens"]
        rates["engine"].append(tokens / dt)
        tokens, dt = run_generate(model, tokenizer.pad_token_id, prompts, budgets, tool_ids)
        rates["generate"].append(tokens / dt)
        print(f"repeat {r + 1}: engine {rates['engine'][-1]:.0f} tok/s ({reused:.0%} of prompt tokens from "
              f"cached prefixes), generate {rates['generate'][-1]:.0f} tok/s")

    if args.batch1_subset:
        n = args.batch1_subset
        tokens = seconds = 0.0
        for p, b in zip(prompts[:n], budgets[:n]):  # one conversation at a time, batch = 1
            t, dt = run_generate(model, tokenizer.pad_token_id, [p], [b], tool_ids)
            tokens, seconds = tokens + t, seconds + dt
        print(f"reference: batch=1 sequential generate on {n} conversations: {tokens / seconds:.0f} tok/s")
    engine_rate, generate_rate = statistics.median(rates["engine"]), statistics.median(rates["generate"])
    print(f"engine   (LocalEngine, 64 async conversations): {engine_rate:.0f} tok/s (median of {args.repeats})")
    print(f"generate (batched per turn, left padding):      {generate_rate:.0f} tok/s (median of {args.repeats})")
    print(f"ratio engine/generate = {engine_rate / generate_rate:.2f}")


if __name__ == "__main__":
    main()
