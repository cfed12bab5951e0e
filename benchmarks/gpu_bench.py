"""The measurements behind ``benchmarks/gpu_smoke.py``'s table: the device's own ceilings (a device-to-device copy's
bandwidth, a square matmul's FLOP/s), decode and prefill throughput of tether's LocalEngine and of HF
``model.generate`` on the same prompts, and the learner's throughput on synthetic trajectories. Each function times
its work between ``synchronize`` calls after warm-up iterations and returns plain numbers; ``Report`` holds the table
(rows declared up front, so a figure no section filled shows as missing) and runs each section in its own ``try``.

Decode rate, engine and ``generate`` alike: the same ``batch`` prompts of ``prompt_len`` random token ids, run once
to 1 new token (T₁: prefill and the first token) and once to ``new_tokens`` new tokens (T_N; greedy, and nothing
stops early: the engine has no stop tokens, ``generate`` gets ``min_new_tokens`` = ``max_new_tokens``), each the
median of ``reps`` runs; decode tokens/s = batch × (N − 1) / (T_N − T₁), prefill tokens/s = batch × prompt_len / T₁.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tether.config import RunConfig
from tether.config.plan import Plan
from tether.engine.base import SamplingParams
from tether.engine.local import LocalEngine
from tether.learner.fsdp import sharded_learner
from tether.types import Trajectory


def size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3f} MB"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, *, warmup: int, iters: int) -> float:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then ``iters`` calls between two synchronizations."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Memory bandwidth in bytes/s: ``dst.copy_(src)`` of ``nbytes`` reads and writes ``nbytes`` each."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, warmup=3, iters=iters)
    return 2 * nbytes / seconds


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, iters: int = 50) -> float:
    """FLOP/s of an n × n × n matmul in ``dtype`` (2n³ FLOPs per product)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = timed(lambda: torch.mm(a, b, out=out), device, warmup=3, iters=iters)
    return 2 * n**3 / seconds


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` distinct prompts of random token ids (distinct: no shared prefix for the engine to reuse)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()


def _median_time(run: Callable[[int], None], new_tokens: int, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        run(new_tokens)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit(reps: int, one_s: float, left_s: float) -> int:
    """How many of ``reps`` repetitions of ``one_s`` seconds fit in ``left_s`` (at least 1)."""
    return max(1, min(reps, int(left_s / max(one_s, 1e-9))))


def decode_rates(run: Callable[[int], None], batch: int, prompt_len: int, new_tokens: int, reps: int,
                 device: torch.device, left_s: float = math.inf) -> tuple[float, float]:
    """(decode tokens/s, prefill tokens/s) of ``run(n)``, which generates n new tokens for each of ``batch``
    prompts (see the module docstring); one untimed warm-up run first, then as many of ``reps`` repetitions as fit in
    ``left_s`` seconds (a pair of timed runs costs about one warm-up run)."""
    t0 = time.perf_counter()
    run(new_tokens)
    reps = fit(reps, time.perf_counter() - t0, left_s - (time.perf_counter() - t0))
    t1 = _median_time(run, 1, reps, device)
    tn = _median_time(run, new_tokens, reps, device)
    decode = batch * (new_tokens - 1) / (tn - t1) if tn > t1 else float("nan")
    return decode, batch * prompt_len / t1


def engine_runner(engine: LocalEngine, prompts: list[list[int]]) -> Callable[[int], None]:
    """``run(n)``: the engine generates n greedy tokens for every prompt, all submitted at once."""
    async def gather(n: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=n)
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    def run(n: int) -> None:
        results = asyncio.run(gather(n))
        short = [len(r.token_ids) for r in results if len(r.token_ids) != n]
        if short:
            raise RuntimeError(f"engine returned {short[:4]} tokens, not {n}")
    return run


def hf_runner(model: Any, prompts: list[list[int]], pad_id: int) -> Callable[[int], None]:
    """``run(n)``: ``model.generate`` on the whole batch (prompts of one length: no padding), n greedy tokens each."""
    from transformers import GenerationConfig

    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id,
                                  eos_token_id=None)
        model.generation_config = config  # generate fills the unset fields of its config from the model's: no gaps
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, not {n}")
    return run


def synthetic_trajectories(n: int, prompt_len: int, response_len: int, vocab: int,
                           seed: int = 0) -> tuple[list[Trajectory], torch.Tensor]:
    """``n`` trajectories of random tokens (distinct prompts: no shared prefix) and ±1 advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, prompt_len + response_len), generator=g).tolist()
    uniform = -math.log(vocab)  # the behaviour logprob of a random-weights model, about
    trajs = [Trajectory(f"t{i}", row[:prompt_len], row[prompt_len:], [1] * response_len, [uniform] * response_len,
                        [0] * response_len) for i, row in enumerate(ids)]
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)])
    return trajs, advantages


def learner_rate(learner: Any, trajs: list[Trajectory], advantages: torch.Tensor, steps: int,
                 device: torch.device, left_s: float = math.inf) -> tuple[float, dict[str, float], int]:
    """(tokens/s, the last step's metrics, timed steps) of ``learner.train_step`` on ``trajs``: one untimed warm-up
    step, then the median of as many of ``steps`` as fit in ``left_s`` seconds; tokens = prompt + response tokens
    forwarded and back-propagated per step."""
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    t0 = time.perf_counter()
    metrics = learner.train_step(trajs, advantages)
    sync(device)
    steps = fit(steps, time.perf_counter() - t0, left_s - (time.perf_counter() - t0))
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        metrics = learner.train_step(trajs, advantages)
        sync(device)
        times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times), metrics, steps


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]  # decode batch sizes
    prompt_len: int  # decode/prefill prompt tokens
    new_tokens: int  # decode tokens per request
    reps: int  # timed runs per decode figure (median)
    copy_bytes: int  # bandwidth probe
    matmul_n: int  # matmul probe
    train_trajectories: int  # learner probe: trajectories per step
    train_prompt: int
    train_response: int
    train_micro: int  # gradient_accumulation_steps of the learner probe
    steps: int  # RL steps
    prompts: int  # RL prompts per step
    max_tokens: int  # RL tokens per completion
    budget_s: float


GPU = Sizes(batches=(1, 64, 256), prompt_len=128, new_tokens=128, reps=3, copy_bytes=2**30, matmul_n=8192,
            train_trajectories=64, train_prompt=128, train_response=384, train_micro=8,  # 32k tokens/step
            steps=4, prompts=8, max_tokens=128, budget_s=420.0)
CPU_TINY = Sizes(batches=(1, 4, 8), prompt_len=16, new_tokens=16, reps=3, copy_bytes=2**26, matmul_n=512,
                 train_trajectories=8, train_prompt=16, train_response=48, train_micro=2,
                 steps=3, prompts=2, max_tokens=16, budget_s=120.0)
# Where in the budget each section may still start (a fraction of --budget-s); later, it is skipped.
DEADLINES = {"device": 0.10, "engine": 0.30, "generate": 0.55, "learner": 0.70, "rl": 0.97, "memory": math.inf}


@dataclass
class Row:
    name: str
    unit: str
    value: float | None = None
    ref: str = ""


class Report:
    """The table's rows, declared up front (a figure no section filled shows as missing), and the sections' errors."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.rows: dict[str, Row] = {}
        self.errors: list[str] = []
        self.verdict: int | None = None  # the exit status, once the table is printed
        self.t0 = time.perf_counter()

    def expect(self, name: str, unit: str) -> None:
        self.rows[name] = Row(name, unit)

    def put(self, name: str, value: float, ref: str = "") -> None:
        self.rows[name].value, self.rows[name].ref = float(value), ref

    def get(self, name: str) -> float | None:
        value = self.rows[name].value if name in self.rows else None
        return value if value is not None and math.isfinite(value) else None

    def bad(self) -> list[str]:
        return [r.name for r in self.rows.values() if self.get(r.name) is None]

    def left(self, stage: str) -> float:
        """Seconds until ``stage``'s time is up: the start of the next stage's share, ``DEADLINES`` + 5 % of the
        budget (a stage that overruns its share a little takes it from the next ones)."""
        return (DEADLINES[stage] + 0.05) * self.budget_s - (time.perf_counter() - self.t0)

    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - self.t0:6.1f}s] {message}", file=sys.stderr,
              flush=True)

    def run(self, name: str, stage: str, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)``, one section of the run, unless ``stage`` is past its share of the budget (``DEADLINES``):
        an exception is logged and kept, so one failed section still leaves the others' figures (exit 1 at the end).
        ``GPU_SMOKE_FAIL=<stage>`` makes the stage's sections raise instead (tests)."""
        if time.perf_counter() - self.t0 > DEADLINES[stage] * self.budget_s:
            self.log(f"{name}: skipped, past {DEADLINES[stage]:.0%} of the {self.budget_s:g} s budget")
            return
        self.log(f"{name}: start")
        try:
            if os.environ.get("GPU_SMOKE_FAIL") == stage:
                raise RuntimeError(f"GPU_SMOKE_FAIL={stage}")
            fn(*args)
            self.log(f"{name}: done")
        except Exception as exc:
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            self.log(f"{name}: FAILED")
            traceback.print_exc(file=sys.stderr)

    def markdown(self) -> str:
        lines = ["| figure | value | unit | reference |", "|---|---:|---|---|"]
        for r in self.rows.values():
            value = "missing" if r.value is None else f"{r.value:.4g}" if abs(r.value) < 10 else f"{r.value:,.0f}"
            lines.append(f"| {r.name} | {value} | {r.unit} | {r.ref} |")
        return "\n".join(lines)


def bench_config(sizes: Sizes) -> RunConfig:
    """The learner probe: one update per step over the whole batch, no KL, the plain ActorWorker."""
    n = sizes.train_trajectories
    return RunConfig.model_validate({
        "learner": {"batch_size": n, "mini_batch_size": n, "update_frequency": 1,
                    "gradient_accumulation_steps": sizes.train_micro},
        "policy_optimization": {"kl_control": {"type": "none"}, "optimizer": {"lr": 1e-6, "warmup_steps": 0}},
        "engine": {"max_tokens": sizes.train_response},
        "actor_worker": {"class": "ActorWorker", "strategy": "fsdp2"}})


def measure_device(report: Report, sizes: Sizes, device: torch.device, dtype: torch.dtype,
                   facts: dict[str, Any]) -> None:
    bw = copy_bandwidth(device, sizes.copy_bytes)
    report.put("memory bandwidth (copy)", bw / 1e9, f"{sizes.copy_bytes / 2**20:.0f} MiB `copy_` on {device.type}, "
               "bytes read + written ÷ time")
    peak = matmul_flops(device, dtype, sizes.matmul_n)
    report.put("matmul peak", peak / 1e12, f"{sizes.matmul_n}³ `torch.mm` in {str(dtype).removeprefix('torch.')}, "
               "2n³ ÷ time: the MFU denominator")
    facts.update(bw=bw, peak=peak)


def engine_batch(report: Report, sizes: Sizes, device: torch.device, engine: LocalEngine, b: int) -> None:
    """Engine decode at batch ``b`` (and prefill, at the largest batch)."""
    prompts = random_prompts(b, sizes.prompt_len, engine.model.config.vocab_size, seed=b)
    decode, prefill = decode_rates(engine_runner(engine, prompts), b, sizes.prompt_len, sizes.new_tokens, sizes.reps,
                                   device, report.left("engine") / (1 + sizes.batches[::-1].index(b)))
    report.put(f"engine decode, batch {b}", decode)
    report.log(f"engine batch {b}: decode {decode:,.0f} tokens/s, prefill {prefill:,.0f} tokens/s")
    if b == max(sizes.batches):
        report.put(f"engine prefill, batch {b}", prefill)


def generate_batch(report: Report, sizes: Sizes, device: torch.device, model: Any, pad_id: int, b: int) -> None:
    """HF ``generate`` decode at batch ``b``, on the same prompts as the engine's."""
    prompts = random_prompts(b, sizes.prompt_len, model.config.vocab_size, seed=b)
    try:
        decode, _ = decode_rates(hf_runner(model, prompts, pad_id), b, sizes.prompt_len, sizes.new_tokens, sizes.reps,
                                 device, report.left("generate") / (1 + sizes.batches[::-1].index(b)))
    finally:
        _free(device)  # generate's caches
    report.put(f"HF generate decode, batch {b}", decode)
    report.log(f"generate batch {b}: decode {decode:,.0f} tokens/s")


def measure_learner(report: Report, sizes: Sizes, device: torch.device, dtype: torch.dtype, model: Any,
                    ranks: Any, facts: dict[str, Any]) -> None:
    cfg = bench_config(sizes)
    learner = sharded_learner(copy.deepcopy(model), ranks, cfg.learner, cfg.policy_optimization, temperature=1.0,
                              max_response_tokens=Plan.of(cfg).max_response_tokens, worker="ActorWorker",
                              param_dtype=None if dtype == torch.float32 else dtype)
    trajs, adv = synthetic_trajectories(sizes.train_trajectories, sizes.train_prompt, sizes.train_response,
                                        model.config.vocab_size)
    rate, metrics, steps = learner_rate(learner, trajs, adv, sizes.reps, device, report.left("learner"))
    del learner
    _free(device)
    if not math.isfinite(metrics["optim/loss"]):
        raise FloatingPointError(f"learner probe: loss = {metrics['optim/loss']}")
    tokens = sizes.train_trajectories * (sizes.train_prompt + sizes.train_response)
    compute = "fp32" if dtype == torch.float32 else f"{str(dtype).removeprefix('torch.')} compute, fp32 master weights"
    report.put("learner", rate, f"{sizes.train_trajectories} × ({sizes.train_prompt} + {sizes.train_response}) = "
               f"{tokens} tokens/step in {sizes.train_micro} micro-batches, {compute}, FSDP2, median of {steps}")
    facts["learner"] = rate


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


