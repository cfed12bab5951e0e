"""The learner's step on 1 and 2 trainer ranks (gloo, CPU): step time, and memory per rank.

    python benchmarks/trainer_ranks.py [--steps 3] [--warmup 1] [--models demo,wide] [--one-thread] [--tiny]
                                       [--json PATH]

The learner is the demo's (examples/customer_service/config.yaml: one update of 64 trajectories in 4 micro-batches,
double-sided IS correction, the k3 KL reference, AdamW); the batches are synthetic, in the demo's shape: 8 groups ×
8 trajectories, a ~320-token prompt shared by each group (300–340 tokens: the demo's system prompt and tool list are
~290), then 1–4 turns of 3–24 model tokens and 2–16 tool tokens (mask 0) and a last 2–8 model tokens (~60 response
tokens); behaviour logprobs near a random-init model's (−log vocab ± 0.1). A new batch every step, the same ones
for every layout.

Models (random init, built in code: nothing to download, no tokenizer):
    demo   the tiny-sft preset's architecture (``RECIPE.model``: 4 layers, hidden 128, MLP 384, 4 heads / 2 KV heads,
           tied embeddings) with its 2735-token vocabulary
    wide   4× wider: hidden 512, MLP 1536, 16 heads / 8 KV heads (the head size, 32, kept), the same 4 layers and
           vocabulary (the layers' parameters ×16, the embedding ×4)

Layouts, each (model, layout) in a process of its own so that its peak RSS is its own:
    1 rank   a plain ``Learner`` in a ``LearnerGroup`` of one (what a run trains with), ``cores`` torch threads
    2 ranks  ``sharded_learner`` (FSDP2) in a ``LearnerGroup`` on rank 0, rank 1 a process started by ``spawn_ranks``
             (before the model is built) running ``follow``; ``cores // 2`` torch threads each
    1 rank, 1 thread (``--one-thread``): the reference for what a second rank adds on a core of its own

Per layout: ``train_step``'s wall time on rank 0 (the trajectories broadcast, every rank's share of every
micro-batch, FSDP's gathers and reduce-scatters over gloo, the closing barrier), median of ``--steps`` after
``--warmup``; the same for the weight push (``state_dict_for_engine``: whole tensors gathered on rank 0). Per rank:
the peak RSS (``ru_maxrss``) at the end, the same before the model was built (the interpreter, torch and tether: the
difference is what the learner added), and the bytes of the weights (policy and KL reference) and AdamW moments the
rank holds (its shards when sharded), and its CPU seconds per step and push (process time, every thread: other
programs on the machine disturb it far less than the wall time; the mean over every step, warm-up included, as rank 1
has no step boundaries of its own). Sharded weights are more than half: FSDP2 does not reshard the root unit
(embedding, tied LM head, final norm) after a forward, and the KL reference only runs forwards, so its root stays
whole on every rank between steps (the policy's is resharded after its backward).

The honest reading on a 2-core machine: the two layouts get the same cores (2 threads in one process, or 1 thread
in each of 2), so the ideal step-time ratio is about 1, not ½ — a speed-up needs a device per rank. Above 1 is what
the ranks cost (the broadcast, the collectives, a share padded to its longest row, one thread's worse use of a core's
neighbour); below 1 is one process's second thread scaling worse than a second process. What CPU does show is the
memory: each rank holds half the weights and moments, and the activations of its half of each micro-batch; the
interpreter and torch (a few hundred MB) are paid per rank. On a shared machine the 2-thread layout is the fragile
one: an OpenMP team waits at every barrier for a thread whose core another process holds (``tether.threads``), so
its steps swing (the demo's: 3.8 to 11 s in one run) while 2 one-thread ranks hold steady; ``--one-thread`` and the
CPU seconds are the comparisons that survive the noise.

Measured on 7ef5b96 (2 cores shared with other jobs, load 2–6; medians of 3 steps, the wide model's of 1):
    demo  1.14 M params: 1 rank × 2 threads 10.9 s, 2 ranks × 1 thread 6.9 s, 1 rank × 1 thread 5.7 s (CPU 5.8 s; 2
          ranks 7.4 s together: at this size the broadcast and collectives add 28 %); peak RSS per rank 1317 → 946 MB,
          weights + AdamW per rank 0.54×
    wide  14.0 M params: 37.3 s, 42.2 s, 55.0 s (CPU 53.0 s; 2 ranks 51.0 s together); peak RSS per rank 3185 →
          2073 MB, what the learner added 2743 → 1624 MB, weights + AdamW per rank 0.51×

``--tiny``: a 1-layer, 32-wide model and its 4× (128), a 512-token vocabulary, 2 groups × 4 trajectories of ~40-token
prompts, 1 warm-up and 2 measured steps (seconds; the test's). Exits 1 when a figure (a time, a size, a step's loss)
is not finite.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "customer_service" / "config.yaml"
VOCAB = 2735  # the tiny-sft preset's tokenizer: 2048 BPE tokens, specials and 697 entity tokens
DEMO_MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2)  # tether.warmstart.tiny_sft.RECIPE.model (checked in ``model_config``)
MODELS = {
    "demo": DEMO_MODEL,
    "wide": dict(DEMO_MODEL, hidden_size=512, intermediate_size=1536, num_attention_heads=16, num_key_value_heads=8),
}
TINY_MODELS = {  # --tiny: conftest's tiny_model and its 4×
    "demo": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1),
    "wide": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
                 num_key_value_heads=4),
}


@dataclass(frozen=True)
class Shape:
    """The synthetic batch: ``groups`` × ``group_size`` trajectories, prompts of ``prompt`` tokens (inclusive)."""

    groups: int = 8
    group_size: int = 8
    prompt: tuple[int, int] = (300, 340)
    vocab: int = VOCAB


@dataclass(frozen=True)
class Case:
    """One measured layout: what the case process runs."""

    model: str
    arch: dict[str, int]
    ranks: int
    threads: int  # torch threads per rank
    shape: Shape
    steps: int
    warmup: int


# ---- the workload ----------------------------------------------------------------------------------------------


def model_config(arch: dict[str, int], vocab: int) -> Any:
    from transformers import Qwen2Config

    from tether.learner.model import TINY_DEFAULTS
    from tether.warmstart.tiny_sft import RECIPE

    assert DEMO_MODEL == RECIPE.model, "the demo preset's architecture changed: update DEMO_MODEL"
    return Qwen2Config(**{**TINY_DEFAULTS, **arch}, vocab_size=vocab)


def build_model(arch: dict[str, int], vocab: int) -> Any:
    """The same random weights in every process (a fixed seed)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(model_config(arch, vocab))


def learner_args() -> dict[str, Any]:
    """``Learner``'s arguments after the model and reference, from the demo's config, as ``Run.build`` hands them."""
    from tether.config import load_config
    from tether.config.plan import Plan

    cfg = load_config([DEMO], [])
    return dict(lc=cfg.learner, po=cfg.policy_optimization, temperature=cfg.engine.temperature,
                max_response_tokens=Plan.of(cfg).max_response_tokens, teacher=cfg.teacher,
                worker=cfg.actor_worker.class_)


def batch(step: int, shape: Shape) -> tuple[list[Any], Any]:
    """Step ``step``'s trajectories in the demo's shape and their group-normalised advantages."""
    import torch

    from tether.types import Trajectory

    rng = random.Random(step)
    near = -math.log(shape.vocab)  # a random-init model's logprob of any token
    trajs, advantages = [], []
    for g in range(shape.groups):
        prompt = [rng.randrange(shape.vocab) for _ in range(rng.randint(*shape.prompt))]
        group = []
        for _ in range(shape.group_size):
            mask: list[int] = []
            for _turn in range(rng.randint(1, 4)):
                mask += [1] * rng.randint(3, 24) + [0] * rng.randint(2, 16)
            mask += [1] * rng.randint(2, 8)
            group.append(Trajectory(task_id=f"s{step}g{g}", prompt_ids=prompt,
                                    response_ids=[rng.randrange(shape.vocab) for _ in mask], response_mask=mask,
                                    logprobs=[near + rng.uniform(-0.1, 0.1) if m else 0.0 for m in mask],
                                    versions=[step - 1 if m else -1 for m in mask], reward=float(rng.random() < 0.5)))
        r = torch.tensor([t.reward for t in group])
        advantages.append((r - r.mean()) / (r.std() + 1e-6))
        trajs += group
    return trajs, torch.cat(advantages)


# ---- what a rank measures of itself ----------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """This process's peak resident set so far (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def held_mb(learner: Any) -> dict[str, float]:
    """MB of the weights (policy and KL reference) and AdamW moments this rank holds: its shards when sharded."""
    import torch
    from torch.distributed.tensor import DTensor

    def mb(tensors: Any) -> float:
        local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
        return sum(t.numel() * t.element_size() for t in local) / 2**20

    ref = learner.ref_model.parameters() if learner.ref_model is not None else ()
    state = learner.optimizer.optimizer.state.values()
    return {"weights_mb": mb(learner.model.parameters()) + mb(ref),
            "adamw_mb": mb(v for s in state for v in s.values() if torch.is_tensor(v) and v.dim() > 0)}


def follower(ranks: Any, case: dict[str, Any], out: str) -> None:
    """Rank 1: build the same learner, follow rank 0's commands until it closes the group, write what it measured."""
    import torch

    from tether.learner.fsdp import sharded_learner
    from tether.learner.group import follow

    torch.set_num_threads(case["threads"])
    before = peak_rss_mb()
    learner = sharded_learner(build_model(case["arch"], case["shape"]["vocab"]), ranks, **learner_args())
    cpu = time.process_time()
    follow(learner)
    cpu = (time.process_time() - cpu) / (case["warmup"] + case["steps"])  # its steps and pushes, warm-up included
    Path(out, f"rank{ranks.rank}.json").write_text(json.dumps({
        "rank": ranks.rank, "threads": torch.get_num_threads(), "cpu_s": cpu, "rss_before_mb": before,
        "peak_rss_mb": peak_rss_mb(), **held_mb(learner)}))


def run_case(case: Case, out: Path) -> dict[str, Any]:
    """The case on rank 0 (this process), rank 1 spawned for 2 ranks; the figures of every rank."""
    import torch

    from tether.learner.group import LearnerGroup
    from tether.learner.learner import Learner
    from tether.learner.spawn import spawn_ranks

    torch.set_num_threads(case.threads)
    before = peak_rss_mb()
    batches = [batch(step, case.shape) for step in range(1, case.warmup + case.steps + 1)]
    spawned = None
    if case.ranks > 1:  # before the model: the spawned interpreter starts from this process's imports only
        # rank 1 unpickles ``follower`` by its module's name: this file's, not ``__main__`` (on rank 1 that is the
        # spawner's); this script's folder is on sys.path, which spawn_ranks hands the rank
        rank_main = importlib.import_module(Path(__file__).stem).follower
        spawned = spawn_ranks(case.ranks, rank_main, asdict(case), str(out), backend="gloo", timeout_s=300)
    try:
        model = build_model(case.arch, case.shape.vocab)
        params = sum(p.numel() for p in model.parameters())
        if spawned is None:
            learner = Learner(model, None, **learner_args())
        else:
            from tether.learner.fsdp import sharded_learner

            learner = sharded_learner(model, spawned.ranks, **learner_args())
        group = LearnerGroup(learner, spawned=spawned)
        steps, pushes, cpus, losses, norms = [], [], [], [], []
        for trajs, advantages in batches:
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = group.train_step(trajs, advantages)
            t1 = time.perf_counter()
            group.state_dict_for_engine()
            pushes.append(time.perf_counter() - t1)
            steps.append(t1 - t0)
            cpus.append(time.process_time() - c0)
            losses.append(metrics["optim/loss"])
            norms.append(metrics["optim/grad_norm"])
        group.close()
    finally:
        exits = spawned.close() if spawned is not None else {}
    if any(code != 0 for code in exits.values()):
        raise RuntimeError(f"trainer ranks exited with {exits}")
    mine = {"rank": 0, "threads": torch.get_num_threads(), "cpu_s": statistics.mean(cpus), "rss_before_mb": before,
            "peak_rss_mb": peak_rss_mb(), **held_mb(learner)}
    ranks = [mine] + [json.loads((out / f"rank{r}.json").read_text()) for r in range(1, case.ranks)]
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in batches[0][0])
    return {"model": case.model, "ranks": case.ranks, "params": params, "tokens_per_step": tokens,
            "step_s": steps[case.warmup:], "push_s": pushes[case.warmup:], "losses": losses, "grad_norms": norms,
            "step_s_median": statistics.median(steps[case.warmup:]),
            "push_s_median": statistics.median(pushes[case.warmup:]), "per_rank": ranks}


# ---- the parent: one process per case, the table ----------------------------------------------------------------


def measure(case: Case) -> dict[str, Any]:
    """``case`` in a fresh interpreter (``--case``), so that its peak RSS is its own."""
    with tempfile.TemporaryDirectory(prefix="trainer-ranks-") as tmp:
        spec = Path(tmp) / "case.json"
        spec.write_text(json.dumps(asdict(case)))
        subprocess.run([sys.executable, __file__, "--case", str(spec)], check=True)
        return json.loads((Path(tmp) / "result.json").read_text())


def finite(results: list[dict[str, Any]]) -> list[str]:
    """The figures that are not finite numbers (a time, a size, a loss), by name."""
    bad = []
    for r in results:
        where = f"{r['model']} × {r['ranks']} ranks"
        values = {k: r[k] for k in ("step_s", "push_s", "losses", "grad_norms")}
        values.update({f"rank {p['rank']} {k}": [v] for p in r["per_rank"] for k, v in p.items() if k != "rank"})
        bad += [f"{where}: {k}" for k, vs in values.items() if not all(math.isfinite(v) for v in vs)]
    return bad


def r_threads(r: dict[str, Any] | None) -> int:
    """A layout's torch threads per rank (0: no layout)."""
    return r["per_rank"][0]["threads"] if r is not None else 0


def render(results: list[dict[str, Any]]) -> str:
    lines = [f"{'model':<6}{'params':>8}{'ranks':>6}{'rank':>5}{'threads':>8}{'step s':>8}{'push s':>8}{'CPU s':>7}"
             f"{'peak RSS MB':>12}{'+learner MB':>12}{'weights MB':>11}{'AdamW MB':>9}"]
    for r in results:
        for p in r["per_rank"]:
            lead = p["rank"] == 0
            step = f"{r['step_s_median']:>8.2f}{r['push_s_median']:>8.3f}" if lead else f"{'':>8}{'':>8}"
            lines.append(f"{r['model']:<6}{r['params'] / 1e6:>7.2f}M{r['ranks']:>6}{p['rank']:>5}{p['threads']:>8}"
                         f"{step}{p['cpu_s']:>7.1f}{p['peak_rss_mb']:>12.0f}"
                         f"{p['peak_rss_mb'] - p['rss_before_mb']:>12.0f}{p['weights_mb']:>11.2f}{p['adamw_mb']:>9.2f}")
    for r in results:
        lines.append(f"{r['model']} × {r['ranks']} ranks: {r['tokens_per_step']} tokens a step; step s "
                     + " ".join(f"{s:.2f}" for s in r["step_s"]))
    ratios = []
    for model in dict.fromkeys(r["model"] for r in results):
        mine = [r for r in results if r["model"] == model]
        two = next((r for r in mine if r["ranks"] == 2), None)
        one = next((r for r in mine if r["ranks"] == 1 and r["per_rank"][0]["threads"] == 2 * r_threads(two)), None)
        if one is None or two is None:
            continue

        def most(r: dict[str, Any], key: str) -> float:
            return max(p[key] if key != "added" else p["peak_rss_mb"] - p["rss_before_mb"] for p in r["per_rank"])

        held = [most(r, "weights_mb") + most(r, "adamw_mb") for r in (one, two)]
        cpu = [sum(p["cpu_s"] for p in r["per_rank"]) for r in (one, two)]
        ratios.append(f"{model} step {two['step_s_median'] / one['step_s_median']:.2f}×, CPU s (all ranks) "
                      f"{cpu[1] / cpu[0]:.2f}×, push "
                      f"{two['push_s_median'] / one['push_s_median']:.1f}×, peak RSS per rank "
                      f"{most(two, 'peak_rss_mb') / most(one, 'peak_rss_mb'):.2f}×, RSS the learner added per rank "
                      f"{most(two, 'added') / most(one, 'added'):.2f}×, weights + AdamW per rank "
                      f"{held[1] / held[0]:.2f}×")
        if single := next((r for r in mine if r["ranks"] == 1 and r_threads(r) == r_threads(two)), None):
            ratios[-1] += (f" (vs 1 rank on 1 thread: step {two['step_s_median'] / single['step_s_median']:.2f}×, "
                           f"CPU s {cpu[1] / sum(p['cpu_s'] for p in single['per_rank']):.2f}×)")
    lines.append("2 ranks ÷ 1 rank (the largest rank's; the same cores: ideal step ≈ 1×): " + "; ".join(ratios))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    ap.add_argument("--models", default="demo,wide", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                    help="cores to use: 1 rank gets them as threads (rounded down to even), 2 ranks half each "
                    "(default: this process's CPUs)")
    ap.add_argument("--one-thread", action="store_true",
                    help="also 1 rank on 2 ranks' threads per rank (the single-thread reference)")
    ap.add_argument("--tiny", action="store_true", help="tiny models and batches, 2 steps (seconds)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--case", type=Path, default=None, help=argparse.SUPPRESS)  # one layout, in this process
    args = ap.parse_args()
    if args.case is not None:
        spec = json.loads(args.case.read_text())
        case = Case(**{**spec, "shape": Shape(**{**spec["shape"], "prompt": tuple(spec["shape"]["prompt"])})})
        result = run_case(case, args.case.parent)
        (args.case.parent / "result.json").write_text(json.dumps(result))
        return 0
    models, shape, steps, warmup = MODELS, Shape(), args.steps, args.warmup
    if args.tiny:
        models, shape, steps, warmup = TINY_MODELS, replace(shape, groups=2, group_size=4, prompt=(30, 50),
                                                            vocab=512), 2, 1
    names = args.models.split(",")
    if unknown := [n for n in names if n not in models]:
        ap.error(f"unknown models {unknown}; the models: {', '.join(models)}")
    load = os.getloadavg()
    print(f"{args.cores} cores for each layout; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{shape.groups} groups × {shape.group_size} trajectories, prompts of {shape.prompt[0]}–{shape.prompt[1]} "
          f"tokens; median of {steps} steps after {warmup}", flush=True)
    results = []
    for name in names:
        half = max(1, args.cores // 2)
        for ranks, threads in [(1, 2 * half), (2, half)] + [(1, half)] * args.one_thread:
            results.append(measure(Case(name, models[name], ranks, threads, shape, steps, warmup)))
            print(f"[{name}: {ranks} rank{'s' * (ranks > 1)} × {threads} thread{'s' * (threads > 1)}] median step "
                  f"{results[-1]['step_s_median']:.2f} s", flush=True)
            if args.json:  # written as they come: a long run stopped half-way keeps what it measured
                args.json.write_text(json.dumps(results, indent=1))
    print(render(results), flush=True)
    if bad := finite(results):
        print("not finite: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
