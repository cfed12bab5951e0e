"""GPU acceptance run: a 0.5B-parameter Qwen2-architecture model built from its config (Qwen2-0.5B's shape, random
weights, nothing downloaded; the tokenizer and chat template are the tiny preset's, built in code) in bf16 on one GPU,
measured and run through a few RL steps, printed as one markdown table; ``--tiny`` runs the same code on a CPU with a
2-layer model in fp32 and small sizes (CI). The figures: **memory bandwidth** = bytes read + written by a 1 GiB
device-to-device ``copy_`` ÷ its time; **matmul peak** = 2n³ ÷ the time of an 8192³ ``torch.mm`` in the run's dtype
(the MFU denominator, measured on this device, not the datasheet's); **engine decode** and **HF generate decode** at
batch 1, 64 and 256 = batch × (N − 1) ÷ (T_N − T₁), where T_k is the median time (3 runs after a warm-up, fewer when
the section's share of the budget runs short) to generate k greedy tokens for the same batch of distinct 128-token
random prompts, N = 128 (``generate`` with ``min_new_tokens`` = ``max_new_tokens``, the engine without stop tokens:
neither stops early); **bandwidth limit** = batch ÷ (parameter bytes ÷ memory bandwidth), the decode rate if a step
only had to read the weights once (KV-cache reads and compute ignored: optimistic at batch 256); **engine prefill** =
batch × prompt length ÷ T₁ at the largest batch; **learner** tokens/s = the prompt + response tokens of 64 synthetic
trajectories of 128 + 384 tokens ÷ the median ``Learner.train_step`` time (FSDP2 over one rank, bf16 compute with
fp32 master weights and optimizer state, one update per step, no KL); **learner MFU** = 6 × parameters × learner
tokens/s ÷ matmul peak, counting the LM head on the response tokens only, where the learner runs it (forward +
backward; attention's FLOPs not counted); **RL step** = a step of the loop in
miniature through tether's own pieces (the LocalEngine samples ``group_size`` completions per chat prompt → a reward
per completion, its distinct-token ratio → group-relative advantages → ``Learner.train_step`` with DetachActorWorker,
4 passes and a KL term to a sharded reference → every second step a **weight sync**: the weights gathered from the
shards and loaded into the engine, timed), whose loss and gradient norm must be finite; **peak memory** =
``torch.cuda.max_memory_allocated`` (the process's max RSS on a CPU). Each section runs in its own ``try``, so one
failure still prints the rest; the run exits 1 when any figure is missing or not finite (2 when no GPU is visible).
Progress goes to stderr with timestamps; a section that would start after its share of ``--budget-s`` is skipped
(its figures missing), and a watchdog prints the table so far and exits 1 at the budget + 40 s.
``GPU_SMOKE_FAIL=<stage>`` makes a stage's sections raise (tests).

    benchmarks/gpu_smoke.sh 2>&1 | tee gpu_smoke.log   # one NVIDIA GPU, bf16
    benchmarks/gpu_smoke.sh --tiny                     # CPU (CI), fp32; --dtype bfloat16 for bf16 on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import faulthandler
import math
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bench as bench  # noqa: E402  (benchmarks/gpu_bench.py: the measurements and the table)
from tether.algo import group_advantages  # noqa: E402
from tether.config import RunConfig  # noqa: E402
from tether.config.plan import Plan  # noqa: E402
from tether.engine.base import SamplingParams  # noqa: E402
from tether.engine.local import LocalEngine  # noqa: E402
from tether.engine.prefix_cache import shared_prompt  # noqa: E402
from tether.learner.fsdp import init_ranks, sharded_learner  # noqa: E402
from tether.learner.model import build_tiny, load_model_and_tokenizer  # noqa: E402
from tether.metrics import MetricsRecorder, set_recorder  # noqa: E402
from tether.types import Trajectory  # noqa: E402

# Qwen2-0.5B's architecture (Qwen/Qwen2-0.5B config.json), with a shorter context.
QWEN2_0_5B: dict[str, Any] = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
TINY: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=1024)
# Long enough that every request of a step shares more than MIN_SHARED_PROMPT (32) prompt tokens: the engine's decode
# then runs the cascade attention over the shared prompt, as in the demo's groups.
SYSTEM = ("You are a customer-service agent for an online store. Look orders and stock up with the tools, never invent "
          "an order id, confirm with the customer before a refund or an address change, and answer in one or two "
          "short sentences.")
ASKS = ["Where is my order ORD-{n}?", "Is SKU-{n} in stock?", "I want a refund for order ORD-{n}.",
        "Please check order ORD-{n} and tell me when it ships.", "Can you change my address for ORD-{n}?"]


def build(tiny: bool, device: torch.device, workdir: Path) -> tuple[Any, Any]:
    """The policy (fp32 master weights, on ``device``) and the tiny preset's tokenizer."""
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


def rl_config(sizes: bench.Sizes, group: int) -> RunConfig:
    batch = sizes.prompts * group
    return RunConfig.model_validate({
        "learner": {"batch_size": batch, "mini_batch_size": batch, "gradient_accumulation_steps": min(4, batch)},
        "policy_optimization": {"advantage": {"group_size": group},
                                "kl_control": {"type": "relative_entropy", "init_coef": 0.01, "adaptive": False},
                                "optimizer": {"lr": 1e-5, "warmup_steps": 0}},
        "engine": {"max_tokens": sizes.max_tokens, "temperature": 1.0},
        "actor_worker": {"class": "DetachActorWorker", "strategy": "fsdp2"},
        "trainer": {"trigger_parameter_sync_step": 2}})


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": ASKS[i % len(ASKS)].format(n=1000 + i)}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def rl_step(step: int, engine: LocalEngine, learner: Any, prompts: list[list[int]], cfg: RunConfig,
            recorder: MetricsRecorder, device: torch.device, report: bench.Report) -> dict[str, float]:
    """One step of the loop in miniature (see the module docstring); its timings, tokens/s and loss."""
    group = cfg.policy_optimization.advantage.group_size

    async def sample() -> list:
        params = [SamplingParams(temperature=1.0, max_tokens=cfg.engine.max_tokens, seed=step * 10_000 + i)
                  for i in range(len(prompts) * group)]
        return await asyncio.gather(*(engine.generate(prompts[i // group], p) for i, p in enumerate(params)))

    t0 = time.perf_counter()
    results = asyncio.run(sample())
    gen_s = time.perf_counter() - t0
    trajs = [Trajectory(f"p{i // group}", prompts[i // group], list(r.token_ids), [1] * len(r.token_ids),
                        list(r.logprobs), list(r.versions), reward=len(set(r.token_ids)) / max(len(r.token_ids), 1))
             for i, r in enumerate(results) if r.token_ids]
    if not all(math.isfinite(lp) for t in trajs for lp in t.logprobs):
        raise FloatingPointError(f"step {step}: a behaviour logprob is not finite")
    sizes = [sum(1 for t in trajs if t.task_id == f"p{k}") for k in range(len(prompts))]
    adv, _ = group_advantages(torch.tensor([t.reward for t in trajs]), group_sizes=[s for s in sizes if s],
                              normalization="group")
    t1 = time.perf_counter()
    metrics = learner.train_step(trajs, adv)
    bench.sync(device)
    train_s = time.perf_counter() - t1
    row = {"gen_tok_s": sum(len(r.token_ids) for r in results) / gen_s,
           "train_tok_s": metrics["perf/tokens_per_s"],  # tokens forwarded and back-propagated × passes
           "loss": metrics["optim/loss"], "grad_norm": metrics["optim/grad_norm"]}
    if step % cfg.trainer.trigger_parameter_sync_step == 0:
        t2 = time.perf_counter()
        version = step // cfg.trainer.trigger_parameter_sync_step
        engine.update_weights(learner.state_dict_for_engine(engine.model.dtype), version)  # cast as a run's sync does
        learner.worker.on_sync(learner.version)  # DetachActorWorker keeps the pushed weights (π_prox)
        bench.sync(device)
        row["sync_s"] = time.perf_counter() - t2
    row["step_s"] = time.perf_counter() - t0
    recorder.flush(step)
    sync = f"{row['sync_s']:.3f} s (engine now version {engine.version})" if "sync_s" in row else "-"
    report.log(f"rl step {step}: generated {row['gen_tok_s']:.0f} tokens/s ({gen_s:.2f} s), trained "
               f"{row['train_tok_s']:.0f} tokens/s ({train_s:.2f} s), loss {row['loss']:+.4f}, grad norm "
               f"{row['grad_norm']:.3g}, step {row['step_s']:.2f} s, weight sync {sync}")
    for name in ("loss", "grad_norm"):
        if not math.isfinite(row[name]):
            raise FloatingPointError(f"step {step}: {name} = {row[name]}")
    return row


def declare(report: bench.Report, sizes: bench.Sizes) -> None:
    report.expect("memory bandwidth (copy)", "GB/s")
    report.expect("matmul peak", "TFLOP/s")
    for b in sizes.batches:
        report.expect(f"engine decode, batch {b}", "tokens/s")
        report.expect(f"HF generate decode, batch {b}", "tokens/s")
        report.expect(f"bandwidth limit, batch {b}", "tokens/s")
    report.expect(f"engine prefill, batch {max(sizes.batches)}", "tokens/s")
    report.expect("learner", "tokens/s")
    report.expect("learner MFU", "%")
    report.expect("RL step (median)", "s")
    report.expect("RL generated", "tokens/s")
    report.expect("RL trained", "tokens/s")
    report.expect("RL loss (last step)", "")
    report.expect("weight sync (median)", "s")
    report.expect("peak memory", "GiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU and a 2-layer model (CI)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="engine weights and learner compute (default bfloat16 on a GPU, float32 with --tiny)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default 4; 3 with --tiny)")
    ap.add_argument("--prompts", type=int, default=None, help="RL prompts per step (default 8; 2 with --tiny)")
    ap.add_argument("--group-size", type=int, default=4, help="RL completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=None, help="RL tokens per completion (default 128; 16 tiny)")
    ap.add_argument("--batches", type=str, default=None, help="decode batch sizes (default 1,64,256; 1,4,8 tiny)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 420 s; 120 tiny)")
    ap.add_argument("--watchdog-s", type=float, default=None, help="print the table so far and exit 1 after this "
                    "long (default: the budget + 40 s, 460 s on a GPU: the 8 minutes, imports included)")
    args = ap.parse_args(argv)
    base = bench.CPU_TINY if args.tiny else bench.GPU
    sizes = bench.Sizes(**{**base.__dict__, **{k: v for k, v in dict(
        steps=args.steps, prompts=args.prompts, max_tokens=args.max_tokens, budget_s=args.budget_s,
        batches=args.batches and tuple(int(b) for b in args.batches.split(","))).items() if v}})
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    dtype = getattr(torch, args.dtype)
    if not args.tiny and not torch.cuda.is_available():
        print(f"gpu_smoke: no CUDA device visible to torch (this torch is {torch.__version__}); run with --tiny on a "
              "CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.tiny else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if args.tiny:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    report = bench.Report(sizes.budget_s)
    declare(report, sizes)
    facts: dict[str, Any] = {}
    watchdog(report, sizes, facts, args.watchdog_s or sizes.budget_s + 40)
    report.run("device", "device", bench.measure_device, report, sizes, device, dtype, facts)  # on an idle device
    try:
        run_all(report, sizes, args, device, dtype, facts)
    except Exception as exc:  # the setup (process group, model build, engine): the table still prints, exit 1
        report.errors.append(f"setup: {type(exc).__name__}: {exc}")
        report.log("setup: FAILED")
        traceback.print_exc(file=sys.stderr)
    report.run("memory", "memory", measure_memory, report, device)
    add_references(report, sizes, facts)
    print(report.markdown(), flush=True)
    bad = report.bad()
    report.verdict = 1 if bad or report.errors else 0
    if report.verdict:
        print(f"gpu_smoke: FAILED — missing or not finite: {', '.join(bad) or 'none'}; errors: "
              f"{'; '.join(report.errors) or 'none'}", flush=True)
    else:
        print(f"gpu_smoke: OK in {time.perf_counter() - report.t0:.0f} s", flush=True)
    if torch.distributed.is_initialized():  # after the verdict: a teardown that hangs cannot hide the figures
        torch.distributed.destroy_process_group()
    return report.verdict


def run_all(report: bench.Report, sizes: bench.Sizes, args: argparse.Namespace, device: torch.device,
            dtype: torch.dtype, facts: dict[str, Any]) -> None:
    """Build the model and its engine, then the decode, learner and RL sections."""
    import transformers

    ranks = init_ranks("gloo" if args.tiny else "nccl")  # one rank (under torchrun: its environment's)
    set_recorder(recorder := MetricsRecorder([]))
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = build(args.tiny, device, Path(tmp))
        engine_model = copy.deepcopy(model).to(dtype).eval()  # the engine's own copy, in the run's dtype
        facts["params"] = sum(p.numel() for p in engine_model.parameters())  # tied embeddings counted once
        head = engine_model.get_output_embeddings().weight  # the LM head (Qwen2-0.5B: the embedding table, tied)
        tables = {id(head), id(engine_model.get_input_embeddings().weight)}
        facts["body_params"] = sum(p.numel() for p in engine_model.parameters() if id(p) not in tables)
        facts["head_params"] = head.numel()
        facts["param_bytes"] = sum(p.numel() * p.element_size() for p in engine_model.parameters())
        where = "tiny (CPU)" if args.tiny else torch.cuda.get_device_name(device)
        print(f"gpu_smoke: {where}, torch {torch.__version__}, transformers {transformers.__version__}; Qwen2 "
              f"{facts['params'] / 1e6:.1f}M parameters "
              f"({bench.size(facts['param_bytes'])} in {args.dtype}), FSDP2 over {ranks.world} rank; decode "
              f"{sizes.prompt_len} + {sizes.new_tokens} tokens at batch {', '.join(map(str, sizes.batches))}; RL "
              f"{sizes.prompts} prompts × {args.group_size} × {sizes.max_tokens} tokens, {sizes.steps} steps",
              flush=True)
        report.log(f"built the model on {device}")
        engine = LocalEngine(engine_model, max_batch=max(sizes.batches), prefix_cache_size=0, seed=0,
                             max_prefill_tokens=max(sizes.batches) * sizes.prompt_len)
        try:
            for b in sizes.batches:
                report.run(f"engine batch {b}", "engine", bench.engine_batch, report, sizes, device, engine, b)
            for b in sizes.batches:  # on the engine's copy of the weights, while the engine is idle
                report.run(f"generate batch {b}", "generate", bench.generate_batch, report, sizes, device,
                           engine_model, tokenizer.pad_token_id, b)
            report.run("learner", "learner", bench.measure_learner, report, sizes, device, dtype, model, ranks, facts)
            report.run("rl", "rl", run_rl, report, sizes, args.group_size, device, dtype, model, tokenizer, engine,
                       ranks, recorder)
        finally:
            engine.close()


def run_rl(report: bench.Report, sizes: bench.Sizes, group: int, device: torch.device, dtype: torch.dtype, model: Any,
           tokenizer: Any, engine: LocalEngine, ranks: Any, recorder: MetricsRecorder) -> None:
    cfg = rl_config(sizes, group)
    learner = sharded_learner(model, ranks, cfg.learner, cfg.policy_optimization, temperature=cfg.engine.temperature,
                              max_response_tokens=Plan.of(cfg).max_response_tokens, worker=cfg.actor_worker.class_,
                              param_dtype=None if dtype == torch.float32 else dtype)
    prompts = chat_prompts(tokenizer, sizes.prompts)
    shared = shared_prompt([SimpleNamespace(prompt=p) for p in prompts])
    report.log(f"rl: the {len(prompts)} prompts share {shared} tokens"
               f"{': decode through the cascade attention' if shared else ': no cascade attention'}")
    rows: list[dict[str, float]] = []
    for step in range(1, sizes.steps + 1):
        if step > 1 and time.perf_counter() - report.t0 > bench.DEADLINES["rl"] * sizes.budget_s:
            report.log(f"rl: stopped after {len(rows)} steps, past the budget")
            break
        rows.append(rl_step(step, engine, learner, prompts, cfg, recorder, device, report))
    syncs = [r["sync_s"] for r in rows if "sync_s" in r]
    median = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "gen_tok_s", "train_tok_s")}
    every = f"{len(rows)} steps of {sizes.prompts} prompts × {group} completions × ≤ {sizes.max_tokens} tokens"
    report.put("RL step (median)", median["step_s"], every)
    cascade = f"cascade attention over the {shared} prompt tokens all share" if shared else "no shared prompt"
    report.put("RL generated", median["gen_tok_s"], f"engine, sampled at temperature 1, {cascade}, median")
    report.put("RL trained", median["train_tok_s"], f"tokens × {cfg.learner.update_frequency} passes ÷ train_step time "
               "(with DetachActorWorker's π_prox and the KL reference's forwards), median")
    report.put("RL loss (last step)", rows[-1]["loss"], f"finite loss and grad norm in all {len(rows)} steps")
    if syncs:
        weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        sync = statistics.median(syncs)
        report.put("weight sync (median)", sync, f"{len(syncs)} syncs, {weights / sync / 1e9:.2f} GB/s of engine "
                   "weights (gathered from the shards, cast to its dtype as a run does, loaded into the engine)")


def watchdog(report: bench.Report, sizes: bench.Sizes, facts: dict[str, Any], seconds: float) -> None:
    """After ``seconds``, whatever is still running (a hung section): the stacks to stderr, the table so far to stdout,
    exit 1 — a run with one try on a GPU leaves its figures even when something hangs."""
    def fire() -> None:
        if report.verdict is not None:  # the table and verdict are out: the teardown hung
            report.log(f"watchdog: the teardown still running after {seconds:g} s; exit {report.verdict}")
            os._exit(report.verdict)
        report.log(f"watchdog: still running after {seconds:g} s; the stacks, the figures so far, exit 1")
        faulthandler.dump_traceback(file=sys.stderr)
        try:
            add_references(report, sizes, facts)  # from facts another thread is still filling in
        except Exception:  # the references are a nicety here: the table and the exit are not
            traceback.print_exc(file=sys.stderr)
        print(report.markdown(), flush=True)
        print(f"gpu_smoke: FAILED — watchdog after {seconds:g} s", flush=True)
        os._exit(1)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def measure_memory(report: bench.Report, device: torch.device) -> None:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        report.put("peak memory", torch.cuda.max_memory_allocated(device) / 2**30,
                   f"`max_memory_allocated`; reserved {torch.cuda.max_memory_reserved(device) / 2**30:.1f} of "
                   f"{total / 2**30:.0f} GiB")
    else:
        report.put("peak memory", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                   "the process's max RSS (a CPU run)")


def add_references(report: bench.Report, sizes: bench.Sizes, facts: dict[str, Any]) -> None:
    """The reference column: ratios to the device's measured limits and to HF generate."""
    bw, peak, param_bytes = (facts.get(k) for k in ("bw", "peak", "param_bytes"))
    body, head = facts.get("body_params", 0), facts.get("head_params", 0)  # matmul parameters: layers, LM head
    for b in sizes.batches:
        limit = None
        if bw and param_bytes:
            limit = b * bw / param_bytes
            report.put(f"bandwidth limit, batch {b}", limit, f"batch ÷ ({bench.size(param_bytes)} of weights ÷ "
                       f"{bw / 1e9:,.0f} GB/s)")
        engine, hf = report.get(f"engine decode, batch {b}"), report.get(f"HF generate decode, batch {b}")
        notes = [f"{engine / hf:.2f}× HF generate" if engine and hf else "",
                 f"{engine / limit:.1%} of bandwidth limit" if engine and limit else ""]
        report.rows[f"engine decode, batch {b}"].ref = ", ".join(n for n in notes if n)
        if hf and limit:
            report.rows[f"HF generate decode, batch {b}"].ref = f"{hf / limit:.1%} of bandwidth limit"
    prefill = report.get(f"engine prefill, batch {max(sizes.batches)}")
    if prefill and peak:  # the engine runs the LM head on a prompt's last position only
        flops = 2 * (body + head / sizes.prompt_len)  # per prompt token
        report.rows[f"engine prefill, batch {max(sizes.batches)}"].ref = (
            f"{sizes.prompt_len} tokens per prompt; {flops * prefill / peak:.1%} of matmul peak (2 × (layers' params "
            "+ LM head ÷ prompt length) FLOPs per token)")
    learner = report.get("learner")
    if learner and peak:  # the learner runs the LM head on the response positions only (tether.learner.logits)
        response = sizes.train_response / (sizes.train_prompt + sizes.train_response)
        flops = 6 * (body + head * response)  # per token, forward + backward
        report.put("learner MFU", 100 * flops * learner / peak,
                   f"6 × ({body / 1e6:.1f}M layer params + {head / 1e6:.1f}M LM-head params × {response:.0%} of "
                   "tokens) × tokens/s ÷ measured matmul peak (attention not counted)")


if __name__ == "__main__":
    sys.exit(main())
