"""The protocol's cost: `tether serve` under 64 concurrent chat requests vs the same engine called in-process.

Workload: ``--requests`` chat requests (system prompt, two tools, one user message), at most ``--concurrency`` in
flight at once (a new one starts when one returns), each with its own budget (max_tokens drawn between 8 and 128,
greedy, end-of-turn ignored, so every request produces exactly its budget on both sides).

- server: the real command, ``tether serve MODEL --port 0`` in a subprocess (``OMP_NUM_THREADS=--threads``),
  driven by the official ``openai.AsyncOpenAI`` client from this process: HTTP, JSON, chat-template rendering,
  decoding and tool-call parsing on the server, response parsing in the client.
- stream: the same server and requests with ``stream: true`` (and ``include_usage``), paced by the server's default
  ``--stream-interval auto`` (a chunk a decode step while at most 16 choices stream, ⌈streaming / 16⌉ tokens a chunk
  above: 4 at 64 requests in flight); then again on a server started with ``--stream-interval 1`` (every decode step's
  tokens as a chunk, whatever the load).
- local: a ``LocalEngine`` (same model, threads and batch size) in this process, each request rendered with the
  chat template and its output decoded, as the agent loop does; no HTTP.

Latency is per request, from its start to its parsed response. The ratio server/local of tokens/s is what the
OpenAI-compatible boundary costs on this machine. The two servers start once; ``--rounds`` rounds then run local,
server, stream and the interval's stream one after another, and each ratio is the median of its rounds' (this
machine's speed drifts by 15 % between runs a minute apart: the in-process run alone gave 2615-3054 tokens/s). With
``--pin`` the engine side gets core 0 alone (the server process, or this process for the local run, one thread) and
the client core 1, as when clients run on other machines; without it, client and server share every core. Each
server run also prints the CPU seconds of the client (this process) and of the server process (every thread: engine,
its OpenMP worker, event loop, workers), to show where the cores went. Measured on a 2-core AMD EPYC host (session
29, 1 thread, one server's engine thread timed from /proc): the streamed run at ``--stream-interval 1`` made the
client parse ~14k chunks (3.8-4.9 CPU s, ~0.3 ms a chunk in the openai SDK) beside the engine, whose steps took
6.7-6.9 s of wall time for 5.3-5.4 s of its CPU (the same steps took 5.5 s in-process): 2071-2300 tokens/s against
2740 in-process. At 2 / 4 / 8 tokens a chunk the client spent 2.5 / 1.8 / 1.4 CPU s and the rate was 2358-2398 /
2362-2503 / 2477 tokens/s. One OpenMP thread suits the tiny model on 2 cores (the in-process run is faster at 1
thread than at 2, and at 2 the server's second thread spins beside the client), so ``--threads`` defaults to 1 (both
sides'). The first run of 3 rounds (same host, same day): server 0.92, streamed 0.84 (auto) and 0.77 (interval 1).
Usage:

    python benchmarks/serve_throughput.py [--threads 1] [--rounds 3] [--requests 192] [--concurrency 64] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tether.agent.chat import render_ids
from tether.engine.base import SamplingParams
from tether.engine.local import LocalEngine
from tether.learner import ensure_tiny, load_model_and_tokenizer
from tether.learner.tiny import tool_schema

USER_ASKS = ["Where is my order ORD-{n}?", "Is SKU-{n} in stock?", "Can you help me?",
             "I want a refund for order ORD-{n}, it arrived damaged.",
             "Please check order ORD-{n} and tell me when it ships."]
TOOLS = [tool_schema("query_inventory"), tool_schema("check_refund_policy")]


def workload(requests: int, seed: int = 0) -> list[tuple[list[dict], int]]:
    rng = random.Random(seed)
    return [([{"role": "system", "content": "You are a customer support agent."},
              {"role": "user", "content": rng.choice(USER_ASKS).format(n=rng.randint(1000, 99999))}],
             rng.randint(8, 128)) for _ in range(requests)]


async def bounded(jobs: list, concurrency: int, run) -> tuple[list[float], int, float]:
    """Run ``run(job)`` (returns generated tokens) for every job, ``concurrency`` at a time; latencies, tokens,
    wall seconds."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(job) -> int:
        async with gate:
            t0 = time.perf_counter()
            tokens = await run(job)
            latencies.append(time.perf_counter() - t0)
            return tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(j) for j in jobs)))
    return latencies, tokens, time.perf_counter() - start


def run_local(path: str, jobs, threads: int, concurrency: int, max_batch: int):
    model, tokenizer = load_model_and_tokenizer(path)

    async def run(job) -> int:
        messages, budget = job
        prompt = render_ids(tokenizer, messages, TOOLS, add_generation_prompt=True)
        out = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=budget))
        tokenizer.decode(out.token_ids, skip_special_tokens=False)
        assert len(out.token_ids) == budget
        return len(out.token_ids)

    with LocalEngine(model, num_threads=threads, max_batch=max_batch) as engine:
        asyncio.run(bounded(jobs[:8], concurrency, run))  # warm-up
        return asyncio.run(bounded(jobs, concurrency, run))


def start_server(path: str, threads: int, max_batch: int, log: Path,
                 stream_interval: str = "auto", cpus: set[int] | None = None) -> tuple[subprocess.Popen, int]:
    config = log.with_suffix(".yaml")
    config.write_text(f"engine: {{max_batch_size: {max_batch}}}\n")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "tether.cli", "serve", path, "--port", "0", "--served-model-name",
                             "bench", "--config", str(config), "--stream-interval", str(stream_interval)],
                            env=env, stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    deadline = time.monotonic() + 300
    while True:
        text = log.read_text()
        found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", text)
        if found and "Application startup complete" in text:
            return proc, int(found.group(1))
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"tether serve did not start:\n{text}")
        time.sleep(0.2)


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process, or of process ``pid`` (all its threads) from /proc."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_server(port: int, pid: int | None, jobs, concurrency: int, stream: bool = False):
    import httpx
    from openai import AsyncOpenAI

    async def main():
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=600, http_client=httpx.AsyncClient(limits=limits, trust_env=False)) as client:

            async def run(job) -> int:
                messages, budget = job
                kw = dict(model="bench", messages=messages, tools=TOOLS, max_tokens=budget, temperature=0.0,
                          extra_body={"ignore_eos": True})
                if not stream:
                    r = await client.chat.completions.create(**kw)
                    assert r.usage.completion_tokens == budget, (r.usage.completion_tokens, budget)
                    return r.usage.completion_tokens
                t0, text, usage = time.perf_counter(), "", None
                async for chunk in await client.chat.completions.create(**kw, stream=True,
                                                                        stream_options={"include_usage": True}):
                    for choice in chunk.choices:
                        if choice.delta.content and not text:
                            first_content.append(time.perf_counter() - t0)
                        text += choice.delta.content or ""
                    usage = chunk.usage or usage
                assert usage is not None and usage.completion_tokens == budget, (usage, budget)
                return usage.completion_tokens

            await bounded(jobs[:8], concurrency, run)  # warm-up
            return await bounded(jobs, concurrency, run)

    first_content: list[float] = []
    client0, server0 = cpu_s(), cpu_s(pid) if pid else 0.0
    latencies, tokens, wall = asyncio.run(main())
    if pid:  # (the warm-up's 8 requests included)
        print(f"{'streamed' if stream else 'plain'}: CPU seconds of the client {cpu_s() - client0:.2f}, of the server "
              f"{cpu_s(pid) - server0:.2f}, in {wall:.2f} s on {len(os.sched_getaffinity(0))} cores")
    if stream:
        print(f"streamed: first content after {statistics.median(first_content):.2f} s (median) of "
              f"{statistics.median(latencies):.2f} s per request")
    return latencies, tokens, wall


def summary(name: str, latencies: list[float], tokens: int, wall: float) -> float:
    q = statistics.quantiles(latencies, n=100)
    rate = tokens / wall
    print(f"{name:8s} {len(latencies):5d} req {tokens:7d} tok {wall:7.2f} s {rate:8.0f} tok/s "
          f"{len(latencies) / wall:6.1f} req/s   latency p50 {statistics.median(latencies):6.2f} s  p99 {q[98]:6.2f} s")
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=64, help="engine.max_batch_size (both sides)")
    ap.add_argument("--model", default=None, help="HF model folder (default: the tiny preset)")
    ap.add_argument("--stream-interval", default="1", help="tokens per chunk of the last streamed run (or auto)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of local, server, streamed (auto) and streamed at "
                                                         "--stream-interval, alternated; the ratios' medians")
    ap.add_argument("--pin", action="store_true", help="engine side on core 0 with one thread, client on core 1")
    args = ap.parse_args()
    server_cpus = None
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            raise SystemExit("--pin needs two cores")
        args.threads, server_cpus = 1, {0}

    torch.set_num_threads(args.threads)
    path = args.model or ensure_tiny(Path(tempfile.gettempdir(), "tether-tiny"))
    jobs = workload(args.requests)
    print(f"model: {path}; threads: {args.threads}; {args.requests} chat requests, {args.concurrency} concurrent, "
          f"{sum(b for _, b in jobs)} tokens requested (8-128 each, greedy, end-of-turn ignored); "
          f"{args.rounds} rounds")
    every = f"stream{args.stream_interval}"
    rates: dict[str, list[float]] = {"local": [], "server": [], "stream": [], every: []}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        ports = {}
        for name, interval in (("stream", "auto"), (every, args.stream_interval)):
            proc, port = start_server(path, args.threads, args.max_batch, Path(tmp) / f"{name}.log", interval,
                                      cpus=server_cpus)
            stack.callback(stop, proc)
            ports[name] = (port, proc.pid)
        for r in range(args.rounds):  # alternated, so a drift of the host's speed reaches every side alike
            print(f"round {r + 1}:")
            if args.pin:
                os.sched_setaffinity(0, server_cpus)  # the local run: engine, rendering and decoding on core 0
            local_cpu = cpu_s()
            local = run_local(path, jobs, args.threads, args.concurrency, args.max_batch)
            print(f"local: CPU seconds {cpu_s() - local_cpu:.2f} (model load and warm-up included) in {local[2]:.2f} s")
            if args.pin:
                os.sched_setaffinity(0, {1})  # the client
            runs = {"local": local, "server": run_server(*ports["stream"], jobs, args.concurrency),
                    "stream": run_server(*ports["stream"], jobs, args.concurrency, stream=True),
                    every: run_server(*ports[every], jobs, args.concurrency, stream=True)}
            for name, run in runs.items():
                rates[name].append(summary(name, *run))
    for label, name in (("server", "server"), ("stream", "stream"),
                        (f"stream (--stream-interval {args.stream_interval})", every)):
        ratios = [a / b for a, b in zip(rates[name], rates["local"])]
        print(f"ratio {label}/local tokens/s = {statistics.median(ratios):.2f} (median of {len(ratios)} rounds: "
              f"{' '.join(f'{x:.2f}' for x in ratios)})")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)

if __name__ == "__main__":
    main()
