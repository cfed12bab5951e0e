"""torch threads under CPU contention: fixed 1, fixed 2 and adaptive (``tether.threads``), quiet and beside others.

    python benchmarks/contention.py [--steps 5] [--methods]

The probe is one SFT step of the tiny-sft preset's model (``RECIPE.model``, its 2735-token vocabulary): forward,
backward and AdamW of a batch of 8 × 400 tokens. Per condition — quiet, beside a process busy half the time (50 ms
on, 50 ms off) and beside one CPU-bound process (``while True: pass``; each started and killed here) — the median
seconds of ``--steps`` steps at each thread setting (interleaved), and the ratio to the better fixed one. Adaptive
re-decides before every step (``TorchThreads.update``, its time included), as SFT does before every epoch.

``--methods`` also prints, per condition, what each way of measuring contention reads (mean, min–max of 8): the
idle share sampled over ``SAMPLE_S`` while this process sleeps, the window over a probe step on 2 threads and on 1
(cores busy with other processes: what ``CpuMeter`` uses) and ``procs_running`` (runnable threads, an instant).
Last, whether one probe step's weights are the same bits on 1 thread and on 2.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tether.learner.model import TINY_DEFAULTS
from tether.threads import CpuMeter, TorchThreads, read_cpus
from tether.warmstart.tiny_sft import RECIPE

VOCAB = 2735  # the tiny-sft preset's tokenizer: 2048 BPE tokens, specials and 697 entity tokens
COMPETITORS = {
    "quiet": None,
    "half-busy": "import time\nwhile True:\n    t = time.monotonic()\n    while time.monotonic() - t < 0.05: pass\n"
                 "    time.sleep(0.05)",
    "busy": "while True: pass",
}


class Probe:
    """One SFT step of the tiny-sft model on a fixed batch."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        config = Qwen2Config(**{**TINY_DEFAULTS, **RECIPE.model}, vocab_size=VOCAB)
        self.model = Qwen2ForCausalLM(config).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ids = torch.randint(VOCAB, (8, 400), generator=torch.Generator().manual_seed(seed))  # [B, T]

    def step(self) -> None:
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


@contextlib.contextmanager
def competitor(code: str | None) -> Iterator[None]:
    proc = None if code is None else subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(1.0)  # settled: its own start-up is not what is measured
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def settings(probe: Probe, steps: int) -> dict[str, float]:
    """Median seconds per step of each setting, their steps interleaved (1, 2, adaptive, 1, 2, …): a load that
    drifts during the condition weighs on all three alike."""
    chooser = TorchThreads(ceiling=2)
    before: dict[str, Callable[[], object]] = {"fixed 1": lambda: torch.set_num_threads(1),
                                               "fixed 2": lambda: torch.set_num_threads(2),
                                               "adaptive": chooser.update}
    times: dict[str, list[float]] = {name: [] for name in before}
    for step in range(steps + 1):  # the first: warm-up (and the adaptive meter's first, sampled, look)
        for name, setup in before.items():
            t0 = time.perf_counter()
            setup()
            probe.step()
            if step:
                times[name].append(time.perf_counter() - t0)
    return {**{name: statistics.median(t) for name, t in times.items()},
            "adaptive counts": statistics.mean(chooser.counts[1:])}


def others(meter: CpuMeter) -> float:
    seen = meter.look()
    assert seen is not None  # main checked /proc/stat
    return seen[1]


def methods(probe: Probe) -> dict[str, list[float]]:
    reads: dict[str, list[float]] = {"idle share, 0.2 s sample": [], "window over a 2-thread step": [],
                                     "window over a 1-thread step": [], "procs_running": []}
    meter = CpuMeter()
    for _ in range(8):
        reads["idle share, 0.2 s sample"].append(others(CpuMeter()))  # a new meter: a sampled look
        for n in (2, 1):
            torch.set_num_threads(n)
            others(meter)
            probe.step()
            reads[f"window over a {n}-thread step"].append(others(meter))
        stat = Path("/proc/stat").read_text()
        reads["procs_running"].append(float(stat.split("procs_running")[1].split()[0]))
    return reads


def same_bits() -> str:
    weights = []
    for n in (1, 2):
        torch.set_num_threads(n)
        probe = Probe()
        probe.step()
        weights.append([p.detach().clone() for p in probe.model.parameters()])
    diff = max(float((a - b).abs().max()) for a, b in zip(*weights))
    equal = all(torch.equal(a, b) for a, b in zip(*weights))
    return f"one probe step, 1 vs 2 threads: {'the same bits' if equal else f'differ, max |Δw| {diff:.1e}'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per setting (median)")
    ap.add_argument("--methods", action="store_true", help="also what each way of measuring contention reads")
    args = ap.parse_args()
    if read_cpus(CpuMeter().cpus) is None:
        sys.exit("no /proc/stat here: the adaptive choice keeps the caller's count")
    saved, probe = torch.get_num_threads(), Probe()
    print(f"torch {torch.__version__}, {len(CpuMeter().cpus)} CPUs, probe: SFT step of the tiny-sft model "
          f"(batch 8 × 400), median of {args.steps} steps, seconds")
    results, reads, before = {}, {}, {}
    try:
        for name, code in COMPETITORS.items():
            with competitor(code):
                before[name] = others(CpuMeter())
                results[name] = settings(probe, args.steps)
                if args.methods:
                    reads[name] = methods(probe)
    finally:
        torch.set_num_threads(saved)
    print(f"{'':<12}" + "".join(f"{name:>22}" for name in results))
    for row in ("fixed 1", "fixed 2", "adaptive"):
        cells = []
        for r in results.values():
            best = min(r["fixed 1"], r["fixed 2"])
            cells.append(f"{r[row]:.3f} s ({r[row] / best:.2f}×)")
        print(f"{row:<12}" + "".join(f"{c:>22}" for c in cells))
    print(f"{'(threads)':<12}" + "".join(f"{r['adaptive counts']:>22.1f}" for r in results.values()))
    print(f"{'(busy)':<12}" + "".join(f"{b:>22.2f}" for b in before.values()))
    print("(×: the setting's time over the better fixed one's; threads: the adaptive count, mean over the steps; "
          "busy: cores other processes kept busy, competitor included, over 0.2 s before the condition's runs)")
    if args.methods:
        print("\ncontention as each method reads it (cores busy with other processes; procs_running: runnable "
              "threads), mean (min–max) of 8")
        print(f"{'':<30}" + "".join(f"{name:>22}" for name in reads))
        for method in next(iter(reads.values())):
            cells = [f"{statistics.mean(v[method]):.2f} ({min(v[method]):.2f}–{max(v[method]):.2f})"
                     for v in reads.values()]
            print(f"{method:<30}" + "".join(f"{c:>22}" for c in cells))
        torch.set_num_threads(saved)
        print("\n" + same_bits())
        torch.set_num_threads(saved)


if __name__ == "__main__":
    main()
