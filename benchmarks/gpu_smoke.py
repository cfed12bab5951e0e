"""GPU smoke test: FSDP2 + the local engine on a 0.5B-parameter Qwen2-architecture model built from its config
(random weights, nothing downloaded; the tokenizer and chat template are the tiny preset's, built in code).

    benchmarks/gpu_smoke.sh [--steps 4]   # one NVIDIA GPU: Qwen2-0.5B's shape, bf16 compute on fp32 weights, NCCL
    benchmarks/gpu_smoke.sh --tiny        # CPU (CI): the same code on a 2-layer, 64-wide model, gloo

A step is the RL loop in miniature, through tether's own pieces: the LocalEngine samples ``group_size``
completions of each chat prompt (continuous batching, per-token logprobs and versions) → a reward per
completion (its distinct-token ratio: a number that varies within a group, not a task) → group-relative
advantages → ``Learner.train_step`` with the model sharded by ``fully_shard`` over one rank
(``tether.learner.fsdp``), π_prox held by DetachActorWorker across a sync window of two steps and a KL term
to a sharded reference → every second step a weight sync (the whole weights gathered from the shards and
loaded into the engine, which bumps its version). Each step prints generated tokens/s, trained tokens/s, the
step time, the weight-sync time and DetachActorWorker's save/restore times; the summary the medians, the peak
GPU memory and the model's parameter count. It exits non-zero when a number is missing or not finite.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tether.algo import group_advantages  # noqa: E402
from tether.config import RunConfig  # noqa: E402
from tether.config.plan import Plan  # noqa: E402
from tether.engine.base import SamplingParams  # noqa: E402
from tether.engine.local import LocalEngine  # noqa: E402
from tether.learner.fsdp import init_ranks, sharded_learner  # noqa: E402
from tether.learner.model import build_tiny, load_model_and_tokenizer  # noqa: E402
from tether.metrics import MetricsRecorder, set_recorder  # noqa: E402
from tether.types import Trajectory  # noqa: E402

# Qwen2-0.5B's architecture (Qwen/Qwen2-0.5B config.json), with a shorter context: the engine's KV cache
# reserves max_position_embeddings positions per slot.
QWEN2_0_5B: dict[str, Any] = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
TINY: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=1024)
ASKS = ["Where is my order ORD-{n}?", "Is SKU-{n} in stock?", "I want a refund for order ORD-{n}.",
        "Please check order ORD-{n} and tell me when it ships.", "Can you change my address for ORD-{n}?"]


def build(tiny: bool, device: torch.device, workdir: Path) -> tuple[Any, Any]:
    """The policy (fp32, on ``device``) and the tiny preset's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = build_tiny(workdir / "tiny", seed=0, **TINY)
    model, tokenizer = load_model_and_tokenizer(path)
    if tiny:
        return model.to(device), tokenizer
    config = Qwen2Config(**QWEN2_0_5B, bos_token_id=None, eos_token_id=model.config.eos_token_id,
                         pad_token_id=model.config.pad_token_id)  # token ids < the tokenizer's size ⊂ the vocab
    torch.manual_seed(0)
    with torch.device(device):
        big = Qwen2ForCausalLM(config)
    big.generation_config = model.generation_config
    return big.eval(), tokenizer


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "You are a customer-service agent."},
                    {"role": "user", "content": ASKS[i % len(ASKS)].format(n=1000 + i)}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def reward(tokens: list[int]) -> float:
    return len(set(tokens)) / max(len(tokens), 1)


async def generate(engine: LocalEngine, batch: list[list[int]], group: int, max_tokens: int, step: int) -> list:
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=step * 10_000 + i)
              for i in range(len(batch) * group)]
    return await asyncio.gather(*(engine.generate(batch[i // group], p) for i, p in enumerate(params)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU and a 2-layer model (CI)")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (default 4; 3 with --tiny)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; 2 with --tiny)")
    ap.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default 128; 16 tiny)")
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.tiny else 4)
    n_prompts = args.prompts or (2 if args.tiny else 8)
    max_tokens = args.max_tokens or (16 if args.tiny else 128)
    if not args.tiny and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device visible to torch (this torch is "
              f"{torch.__version__}); run with --tiny on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.tiny else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if args.tiny:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ranks = init_ranks("gloo" if args.tiny else "nccl")  # one rank (under torchrun: its environment's)

    batch = n_prompts * args.group_size
    cfg = RunConfig.model_validate({
        "learner": {"batch_size": batch, "mini_batch_size": batch, "gradient_accumulation_steps": min(4, batch)},
        "policy_optimization": {"advantage": {"group_size": args.group_size},
                                "kl_control": {"type": "relative_entropy", "init_coef": 0.01, "adaptive": False},
                                "optimizer": {"lr": 1e-5, "warmup_steps": 0}},
        "engine": {"max_tokens": max_tokens, "temperature": 1.0},
        "actor_worker": {"class": "DetachActorWorker", "strategy": "fsdp2"},
        "trainer": {"trigger_parameter_sync_step": 2}})
    recorder = MetricsRecorder([])
    set_recorder(recorder)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, tokenizer = build(args.tiny, device, Path(tmp))
        n_params = sum(p.numel() for p in model.parameters())
        engine_model = load_copy(model, dtype=torch.float32 if args.tiny else torch.bfloat16)
        engine = LocalEngine(engine_model, max_batch=64, prefix_cache_size=0, seed=0)
        learner = sharded_learner(model, ranks, cfg.learner, cfg.policy_optimization,
                                  temperature=cfg.engine.temperature,
                                  max_response_tokens=Plan.of(cfg).max_response_tokens,
                                  worker=cfg.actor_worker.class_, param_dtype=None if args.tiny else torch.bfloat16)
        print(f"gpu_smoke: {'tiny (CPU, gloo)' if args.tiny else torch.cuda.get_device_name(device)}; Qwen2 "
              f"{n_params / 1e6:.1f}M parameters, FSDP2 over {ranks.world} rank, built in "
              f"{time.perf_counter() - t0:.1f} s; {n_prompts} prompts × {args.group_size} completions × "
              f"{max_tokens} tokens per step, weight sync every {cfg.trainer.trigger_parameter_sync_step} steps",
              flush=True)
        rows = []
        try:
            for step in range(1, steps + 1):
                rows.append(run_step(step, engine, learner, tokenizer, cfg, n_prompts, max_tokens, recorder, device))
        finally:
            engine.close()
    peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else "n/a (CPU)"
    med = {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0]}
    syncs = [r["sync_s"] for r in rows if "sync_s" in r]
    print(f"gpu_smoke summary (median of {steps} steps): generated {med['gen_tok_s']:.0f} tokens/s, trained "
          f"{med['train_tok_s']:.0f} tokens/s, step time {med['step_s']:.3f} s, weight sync "
          f"{statistics.median(syncs):.3f} s ({len(syncs)} syncs), detach save {med['save_s']:.4f} s / restore "
          f"{med['restore_s']:.4f} s, peak GPU memory {peak}", flush=True)
    numbers = [*med.values(), *syncs]
    if not syncs or not all(math.isfinite(v) and v >= 0 for v in numbers) or med["train_tok_s"] <= 0:
        print(f"gpu_smoke: FAILED — a number is missing or not finite: {med}, syncs {syncs}", file=sys.stderr)
        return 1
    print("gpu_smoke: OK")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def load_copy(model: Any, dtype: torch.dtype) -> Any:
    """The engine's own copy of the weights, in its dtype."""
    import copy

    return copy.deepcopy(model).to(dtype).eval()


def run_step(step: int, engine: LocalEngine, learner: Any, tokenizer: Any, cfg: RunConfig, n_prompts: int,
             max_tokens: int, recorder: MetricsRecorder, device: torch.device) -> dict[str, float]:
    group = cfg.policy_optimization.advantage.group_size
    t0 = time.perf_counter()
    batch = prompts(tokenizer, n_prompts)
    results = asyncio.run(generate(engine, batch, group, max_tokens, step))
    gen_s = time.perf_counter() - t0
    trajs = [Trajectory(f"p{i // group}", batch[i // group], list(r.token_ids), [1] * len(r.token_ids),
                        list(r.logprobs), list(r.versions), reward=reward(r.token_ids))
             for i, r in enumerate(results) if r.token_ids]
    sizes = [sum(1 for t in trajs if t.task_id == f"p{k}") for k in range(n_prompts)]
    adv, _ = group_advantages(torch.tensor([t.reward for t in trajs]), group_sizes=[s for s in sizes if s],
                              normalization="group")
    t1 = time.perf_counter()
    metrics = learner.train_step(trajs, adv)
    _sync(device)
    train_s = time.perf_counter() - t1
    row = {"gen_tok_s": sum(len(r.token_ids) for r in results) / gen_s, "train_tok_s": metrics["perf/tokens_per_s"]}
    if step % cfg.trainer.trigger_parameter_sync_step == 0:
        t2 = time.perf_counter()
        version = step // cfg.trainer.trigger_parameter_sync_step
        engine.update_weights(learner.state_dict_for_engine(), version)
        learner.worker.on_sync(learner.version)  # DetachActorWorker keeps the pushed weights (π_prox)
        _sync(device)
        row["sync_s"] = time.perf_counter() - t2
    row["step_s"] = time.perf_counter() - t0
    logged = recorder.flush(step)
    row["save_s"] = logged.get("perf/detach_save_s", 0.0)
    row["restore_s"] = logged.get("perf/detach_restore_s", 0.0)
    sync = f"{row['sync_s']:.3f} s (engine now version {engine.version})" if "sync_s" in row else "—"
    print(f"step {step}: generated {row['gen_tok_s']:.0f} tokens/s ({gen_s:.2f} s), trained "
          f"{row['train_tok_s']:.0f} tokens/s ({train_s:.2f} s), loss {metrics['optim/loss']:+.4f}, step time "
          f"{row['step_s']:.2f} s, weight sync {sync}, detach save {row['save_s']:.4f} s / restore "
          f"{row['restore_s']:.4f} s", flush=True)
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
