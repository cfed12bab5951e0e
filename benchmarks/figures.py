"""README.md's measured figures, re-measured on the current commit: ``make figures``.

    python benchmarks/figures.py [--only NAME[,NAME]] [--quick] [--list] [--readme README.md]

Each row of README.md's table between ``<!-- figures:begin -->`` and ``<!-- figures:end -->`` is one ``Figure``
below: the command a reader reruns (shown in the table, and the command run here: ``python``, ``pytest`` and
``tether`` are this interpreter's), and a parser from what that command prints to the row's figure. Nothing is
measured here: the benchmarks, tests and CLI print the numbers; this script runs them one after another and
copies them into the table, with the 1-minute load average before and after each (``os.getloadavg``), the wall
time, and a header naming the commit and the machine.

Each row's figure and the tail of its output are stored in ``benchmarks/figures.json`` with the code they were
measured on: the commit, plus a hash of the uncommitted changes if any (README.md and figures.json themselves
excepted, since this script writes them). The section is rewritten after every row, from the stored rows measured
on the current code only: a row measured on other code is removed, not marked, so ``--only NAME`` keeps the other
rows only while the code is the one they were measured on. A commit that changes only README.md or figures.json
counts as the same code (committing the figures does not void them). A row whose output the parser cannot read
is reported and not written, and the script exits 1.

The whole registry takes an hour or more on the 2-core machine (``--list`` gives each row's rough minutes there);
``--quick`` adds each row's cheaper arguments where it has them (fewer repeats, seeds or steps), and the table then
shows the command with them.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
STORE = "benchmarks/figures.json"
# Not part of the code a figure was measured on: what this script writes, the script and its test (they parse
# printed output, they measure nothing), the docs.
OWN = ("README.md", STORE, "benchmarks/figures.py", "tests/test_figures.py", "docs")
KEEP_OUTPUT = 4000  # characters of each row's output kept in figures.json


@dataclass(frozen=True)
class Figure:
    name: str
    what: str  # the table's first column
    command: str  # shown in the table and run (from the repository root)
    parse: Callable[[str], str]  # the command's stdout → the figure; ValueError when it is not there
    minutes: float  # rough wall time on the 2-core machine, idle
    quick: str = ""  # arguments appended under --quick
    block: Callable[[str], str] | None = None  # stdout → a printed block shown under the table
    run: Callable[[str, Path], str] | None = None  # (command, scratch dir) → stdout, when one command is not enough


# ---- running a command ----------------------------------------------------------------------------------------


def execute(command: str, cwd: Path = ROOT) -> str:
    """Run ``command`` (leading ``KEY=value`` words set the environment), echo its stdout line by line, return it.
    stderr (progress, logging) goes to the terminal only."""
    words = shlex.split(command)
    env = dict(os.environ)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    bin_dir = Path(sys.executable).parent
    head = {"python": [sys.executable], "pytest": [sys.executable, "-m", "pytest"],
            "tether": [str(bin_dir / "tether")]}.get(words[0], words[:1])
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen([*head, *words[1:]], cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"  | {line}", end="", flush=True)
        lines.append(line)
    if (rc := proc.wait()) != 0:  # a failed test or criterion is a figure too: the parser decides
        print(f"  | (exit {rc})", flush=True)
    return "".join(lines)


def run_demo(command: str, tmp: Path) -> str:
    """The demo into ``tmp``, then ``tether verify optim`` on each seed's RL run (summary.json names them)."""
    out = execute(f"{command} --run-dir {tmp / 'demo'}")
    for seed in json.loads((tmp / "demo" / "summary.json").read_text()):
        out += f"\n[figures] summary {json.dumps(seed)}\n" + execute(f"tether verify optim {seed['run_dir']}")
    return out


def run_train(command: str, tmp: Path) -> str:
    """``tether train`` with an empty cache in ``tmp``, then its held-out success at step 0 from metrics.jsonl."""
    run_dir = tmp / "run"
    out = execute(f"{command.replace('$(mktemp -d)', str(tmp / 'cache'))} --run-dir {run_dir}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/success_rate" in r]
    build = [json.loads(p.read_text())["build_s"] for p in (tmp / "cache").glob("tiny-sft-*/tether_warmstart.json")]
    return (out + "".join(f"\n[figures] step {r['step']} eval/success_rate {r['eval/success_rate']}" for r in evals)
            + "".join(f"\n[figures] built tiny-sft preset in {b:.0f} s" for b in build))


# ---- parsers: printed output → figure -------------------------------------------------------------------------


def find(pattern: str, text: str, what: str) -> re.Match[str]:
    """The last match of ``pattern`` in ``text`` (multiline), or ValueError naming ``what``."""
    found = list(re.finditer(pattern, text, re.MULTILINE))
    if not found:
        raise ValueError(f"no {what} in the output (/{pattern}/)")
    return found[-1]


def pytest_summary(out: str) -> str:
    """pytest's last line, ``21 passed, 1 skipped, 3 deselected in 95.12s (0:01:35)`` → ``21 passed, 1 skipped in
    95 s`` (the tests a ``-k`` left out are not news)."""
    m = find(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s", out, "pytest summary")
    counts = [c for c in m.group(1).rstrip(", ").split(", ") if not c.endswith("deselected")]
    return f"{', '.join(counts)} in {float(m.group(2)):.0f} s"


def printed_max_diff(out: str) -> str:
    """A test's ``max |…| … = 9.5e-07 [over N tokens]`` line → the figure, with the tests' summary."""
    m = find(r"max \|[^|]+\|(?: over (\d+) trajectories)?(?::| =) ([\d.e+-]+)(?: over (\d+) tokens)?", out,
             "max abs difference line")
    over = f" over {m.group(3)} tokens" if m.group(3) else (f" over {m.group(1)} trajectories" if m.group(1) else "")
    return f"max abs difference {float(m.group(2)):.1e}{over} ({pytest_summary(out)})"


def engine_throughput(out: str) -> str:
    e = find(r"^engine .*:\s+(\d+) tok/s \(median of (\d+)\)", out, "engine line")
    g = find(r"^generate .*:\s+(\d+) tok/s", out, "generate line")
    r = find(r"^ratio engine/generate = ([\d.]+)", out, "ratio line")
    return f"{e.group(1)} vs {g.group(1)} tokens/s, **ratio {r.group(1)}** (medians of {e.group(2)})"


def async_vs_sync(out: str) -> str:
    found = re.findall(r"^speedup (\S+)/sync = ([\d.]+) \(ideal ([\d.]+)[;)]", out, re.MULTILINE)
    if not found:
        raise ValueError("no 'speedup MODE/sync' line in the output")
    return "; ".join(f"{mode} **{s}×** sync (ideal {i}×, {float(s) / float(i):.0%} of it)" for mode, s, i in found)


def block_from(first: str) -> Callable[[str], str]:
    """The printed block: stdout from the first line starting with ``first``."""
    def block(out: str) -> str:
        lines = out.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith(first)), None)
        if start is None:
            raise ValueError(f"no line starting with {first!r} in the output")
        return "\n".join(lines[start:]).strip("\n")
    return block


def step_profile(out: str) -> str:
    step = find(r"^median step = ([\d.]+) s", out, "median step")
    cpu = find(r"^median step CPU = ([\d.]+) s", out, "median step CPU")
    phase = find(r"^rollout phase .*: ([\d.]+) s; engine busy ([\d.]+) s", out, "rollout phase")
    trajs = find(r"^trajectories per step: (\d+) generated \((\d+) resampled\), (\d+) trained", out, "trajectories")
    return (f"**median step {step.group(1)} s** (CPU {cpu.group(1)} s), rollout phase {phase.group(1)} s; "
            f"{trajs.group(1)} trajectories generated ({trajs.group(2)} resampled), {trajs.group(3)} trained")


def time_to_target(out: str) -> str:
    """Per target (the benchmark's ``--target``, one or more): the median and each seed's step and seconds; the CPU
    median of the first target; the held-out success at the last step."""
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^seed (\d+): (to \d+%: .*?); held-out success", out,
                                                        re.MULTILINE)}  # each seed's line is printed twice
    find(r"^time to \d+% = ", out, "median time to target")
    medians = dict(re.findall(r"^time to (\d+)% = (.+?)(?: s)? \(median of \d+ seeds\)", out, re.MULTILINE))
    cpu = find(r"^CPU time to target \(median\): (\S+) s; held-out success at the last step: (.+)$", out, "CPU line")
    parts = []
    for target, median in medians.items():
        per = []
        for line in lines.values():
            hit = re.search(rf"to {target}%: (?:(\d+) s wall / \d+ s CPU \(step (\d+)\)|not reached)", line)
            per.append(f"step {hit.group(2)}, {hit.group(1)} s" if hit and hit.group(2) else "not reached")
        shown = median if median == "not reached" else f"{median} s"
        parts.append(f"to {target} %: **median {shown}** over {len(per)} seeds ({' / '.join(per)})")
        if len(parts) == 1:
            parts.append(f"CPU {cpu.group(1)} s")
    return "; ".join([*parts, f"held-out success at the last step {cpu.group(2)}"])


def scaling(out: str) -> str:
    fit = find(r"^fit: (step s = .+)$", out, "fit line")
    breaks = find(r"^breaks \(> 25 % off the fit\): (.+)$", out, "breaks line")
    return f"{fit.group(1)}; breaks (> 25 % off the fit): {breaks.group(1)}"


def serve_throughput(out: str) -> str:
    rounds = r" = ([\d.]+) \(median of \d+ rounds: ([\d. ]+)\)"
    ratio = find(r"^ratio server/local tokens/s" + rounds, out, "ratio line")
    streamed = find(r"^ratio stream/local tokens/s" + rounds, out, "stream ratio line")
    every = find(r"^ratio stream \(--stream-interval 1\)/local tokens/s" + rounds, out, "interval-1 ratio line")
    local = re.findall(r"^local +\d+ req +\d+ tok +[\d.]+ s +(\d+) tok/s", out, re.MULTILINE)
    first = find(r"^streamed: first content after ([\d.]+) s \(median\)", out, "first content line")

    def each(m: re.Match) -> str:
        return " / ".join(m.group(2).split())

    return (f"**ratio {ratio.group(1)}** ({each(ratio)}); streamed **{streamed.group(1)}** ({each(streamed)}), "
            f"{every.group(1)} at a chunk every token ({each(every)}); in-process {' / '.join(local)} tokens/s; "
            f"first content after {first.group(1)} s (median)")


def remote_vs_local(out: str) -> str:
    rows = re.findall(r"^ *(\d+) +([\d.]+)% +([\d.]+)% +[+-][\d.]+$", out, re.MULTILINE)
    if not rows:
        raise ValueError("no held-out success rows in the output")
    gap = find(r"^largest gap ([\d.]+) points", out, "largest gap")
    pushes = find(r"^weight pushes received by the server: (\d+) \(.* = (\d+) expected\)", out, "weight pushes")
    steps = "/".join(s for s, _, _ in rows)
    return (f"held-out success at steps {steps}: local {' / '.join(a for _, a, _ in rows)} %, remote "
            f"{' / '.join(b for _, _, b in rows)} % (largest gap {gap.group(1)} points); {pushes.group(1)} weight "
            f"pushes ({pushes.group(2)} expected)")


def last_line(prefix: str) -> Callable[[str], str]:
    """The benchmark's headline: its last line starting with ``prefix``, as printed."""
    return lambda out: find(rf"^({re.escape(prefix)}.+)$", out, f"'{prefix}…' line").group(1).strip()


def serve_load(out: str) -> str:
    idle = re.findall(r"^idle +\d+ requests .*p99 +([\d.]+) ms", out, re.MULTILINE)
    loaded = re.findall(r"^loaded +\d+ requests .*p99 +([\d.]+) ms", out, re.MULTILINE)
    ratio = find(r"^p99 loaded/idle = ([\d.]+) \(median of \d+ rounds: ([\d. ]+)\)", out, "ratio line")
    rss = find(r"^server RSS: start (\d+) MB, peak (\d+) MB, end (\d+) MB \(end/start = ([\d.]+)", out, "RSS line")
    if not idle or len(idle) != len(loaded):
        raise ValueError("no idle / loaded p99 lines of each round in the output")
    return (f"small requests' p99 {' / '.join(loaded)} ms loaded vs {' / '.join(idle)} ms idle (**ratio "
            f"{ratio.group(1)}**, median of the rounds' {' / '.join(ratio.group(2).split())}; goal <= 2); server "
            f"RSS {rss.group(1)} -> peak {rss.group(2)} -> end {rss.group(3)} MB (**end/start {rss.group(4)}**, goal "
            f"<= 1.10)")


def tau2_replays(out: str) -> str:
    pairs = [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) matched", out)]
    if not pairs:
        raise ValueError("no 'N/M matched' tallies in the output")
    domains = re.findall(r"^(\w+): \{", out, re.MULTILINE)
    return (f"{sum(a for a, _ in pairs)} of {sum(b for _, b in pairs)} replays ({', '.join(domains)}) score exactly "
            f"what tau2 scores ({pytest_summary(out)})")


def verify_optim_counts(out: str) -> dict[str, tuple[int, int]]:
    """``tether verify optim``'s table rows (criterion │ steps │ pass │ fail │ …), summed over the runs:
    criterion → (pass, steps)."""
    counts: dict[str, tuple[int, int]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) >= 4 and cells[0].startswith("optim/") and cells[1].isdigit() and cells[2].isdigit():
            name = cells[0].split(" (")[0]
            p, n = counts.get(name, (0, 0))
            counts[name] = (p + int(cells[2]), n + int(cells[1]))
    return counts


def demo(out: str) -> str:
    seeds = [json.loads(s) for s in re.findall(r"^\[figures\] summary (\{.*\})$", out, re.MULTILINE)]
    if not seeds:
        raise ValueError("no demo summary in the output")
    per = "; ".join(f"seed {s['seed']}: {s['sft_success']:.1%} → {s['rl_success']:.1%} (RL {s['total_s']:.0f} s)"
                    for s in seeds)
    gain = sum(s["gain"] for s in seeds) / len(seeds) * 100
    optim = ", ".join(f"{name} on {p} of {n}" for name, (p, n) in verify_optim_counts(out).items())
    return f"held-out success after SFT → after RL, {per}; **mean gain {gain:+.1f} points**; verify optim: {optim}"


def train(out: str) -> str:
    evals = re.findall(r"^\[figures\] step (\d+) eval/success_rate ([\d.]+)$", out, re.MULTILINE)
    if not evals:
        raise ValueError("no eval/success_rate rows in metrics.jsonl")
    before, after = float(evals[0][1]), float(evals[-1][1])
    build = find(r"built tiny-sft preset in (\d+) s", out, "preset build line").group(1)
    return (f"held-out success {before:.1%} (step {evals[0][0]}) → {after:.1%} (step {evals[-1][0]}), "
            f"**{(after - before) * 100:+.1f} points**; the one-time tiny-sft build (empty cache) {build} s")


def ablation(out: str) -> str:
    rows = re.findall(r"^(\S+) +[\d.]+% +([\d.]+)% +(\S+) ", out, re.MULTILINE)
    if not rows:
        raise ValueError("no variant rows in the output")
    return "held-out success after RL (steps to 75 %): " + ", ".join(f"{v} {a} % ({s})" for v, a, s in rows)


# ---- the registry: one entry per README row --------------------------------------------------------------------

REGISTRY: list[Figure] = [
    Figure("engine", "local engine vs batched `model.generate`, 64 concurrent 3-turn conversations of uneven length, "
           "2 threads", "python benchmarks/engine_throughput.py", engine_throughput, 2, quick="--repeats 1"),
    Figure("engine-logprobs", "engine behaviour logprobs vs a teacher-forced forward pass, 64 concurrent rollouts",
           "pytest -s tests/test_rollout_tiny.py -k behaviour_logprobs", printed_max_diff, 0.5),
    Figure("async-vs-sync", "sync vs one_step_off_policy vs fully_async, tools with lognormal latency (median "
           "500 ms, σ 1.2, cap 8 s), 24 steps × 32 trajectories (the first step's fill spread as a run spreads it), "
           "2 threads (printed table below)",
           "python benchmarks/async_vs_sync.py --steps 24", async_vs_sync, 5, quick="--steps 4",
           block=block_from("workload:")),
    Figure("staleness-0", "async at staleness 0 vs sync: identical batches and metrics, weights within 1e-5",
           "pytest tests/test_modes.py", pytest_summary, 2),
    Figure("distill", "on-policy distillation, the demo's RL checkpoint teaching the SFT student, seed 0",
           "python benchmarks/distill.py", last_line("pure distillation"), 20, quick="--steps 4"),
    Figure("tau2", "tau2 replays through the adapter vs tau2's own evaluator (gold, first write omitted, an argument "
           "changed, no-op), every task of retail / airline / mock",
           "TETHER_TAU2_FULL=1 pytest -s tests/test_tau2_adapter.py -k replays", tau2_replays, 5),
    Figure("suite", "test suite (`-n 2`)", "make test", pytest_summary, 6),
    Figure("train", "`tether train` on the demo's config, 16 steps, empty cache",
           "TETHER_CACHE=$(mktemp -d) tether train examples/customer_service/config.yaml --set "
           "trainer.total_steps=16", train, 8, quick="--set trainer.total_steps=4", run=run_train),
    Figure("crash-resume", "kill -9 at 7 points × 3 modes, then `--resume`: every step's row once, no group trained "
           "twice, sync plans identical to an uninterrupted run, queue counters continuous",
           "pytest tests/test_crash_resume.py", pytest_summary, 4),
    Figure("run-lock", "two `tether train --resume` processes on one run directory: the second exits 2 naming the "
           "first's PID and host; a lock left by kill -9 is taken over", "pytest tests/test_run_lock.py",
           pytest_summary, 1),
    Figure("run-dir-safety", "metrics.jsonl with rows cut out before the checkpoint, a truncated checkpoint: refused "
           "in one line naming the fix", "pytest tests/test_run_dir_safety.py", pytest_summary, 1),
    Figure("determinism", "sync runs of one seed with `trainer.deterministic: true`, a reference and repeats with "
           "random delays in the learner and the engine: identical logprobs, metrics and weights",
           "pytest tests/test_determinism.py", pytest_summary, 3),
    Figure("serve", "`tether serve` vs the engine in-process, 192 chat requests, 64 in flight, 1 thread; "
           "the same requests streamed (`--stream-interval auto`, and 1); medians of 3 alternated rounds",
           "python benchmarks/serve_throughput.py", serve_throughput, 2),
    Figure("serve-pinned", "the same with the client on a core of its own (`--pin`: the server, or the in-process "
           "engine, on core 0 with one thread; the openai client on core 1), as when clients run on other machines",
           "python benchmarks/serve_throughput.py --pin", serve_throughput, 2),
    Figure("serve-load", "`tether serve` under abuse: 200 small chat requests idle, then again while 32 clients "
           "abandon heavy requests (n=32, 3 attempts each) and 4 send 20 MB bodies, 3 rounds on one server; the "
           "server's RSS",
           "python benchmarks/serve_load.py", serve_load, 2),
    Figure("serve-logprobs", "server behaviour logprobs vs a teacher-forced forward pass (`/v1/completions`, "
           "token ids)", "pytest -s tests/test_remote_engine.py -k teacher_forced", printed_max_diff, 0.5),
    Figure("remote-vs-local", "demo RL phase, `engine.type: remote` vs local, seed 0, 16 steps",
           "python benchmarks/remote_vs_local.py", remote_vs_local, 10, quick="--steps 4 --eval-every 2"),
    Figure("stale-logprobs", "stale behaviour logprobs (5 nats low on every third token), one learner step: the "
           "corrected update is the size of an on-policy one (< 1.5×), the uncorrected > 20×",
           "pytest tests/test_learner_objective.py -k stale", pytest_summary, 0.5),
    Figure("report", "`tether report` on a real fully_async run, the page opened in headless Chromium (skips "
           "without a `chromium` binary)", "pytest tests/test_report.py", pytest_summary, 1),
    Figure("demo", "the demo: tiny-sft warm start, then 16 GRPO steps (sync, 4 updates a step streamed beside the "
           "rollout, filter, diversity bonus, correction); "
           "held-out success on 64 tasks, and `tether verify optim RUN/seedN/rl` on each seed's run",
           "python examples/customer_service/demo.py --seeds 0 1 2", demo, 15, quick="--seeds 0", run=run_demo),
    Figure("step-profile", "one step of the demo's RL phase (8 tasks × 8 rollouts, sync), 2 threads, median of 4 "
           "after a warm-up", "python benchmarks/step_profile.py", step_profile, 2, quick="--steps 1 --warmup 0"),
    Figure("time-to-target", "from the demo's SFT checkpoint to held-out success ≥ 75 %, 85 %, 90 % in 16 steps, "
           "evaluation excluded, 2 threads", "python benchmarks/time_to_target.py --target 0.75 0.85 0.9",
           time_to_target, 8, quick="--seeds 0"),
    Figure("scaling", "the demo's RL step along group size, prompts per step, response budget and model width, one "
           "measured step per point (printed table below)", "python benchmarks/scaling.py --quick --threads 2",
           scaling, 5, block=block_from("axis")),
    Figure("async-learning", "the demo's RL phase in sync and fully_async (max_staleness 4), tool latency median "
           "500 ms, from the demo's seed-0 SFT checkpoint, RL seeds 0-2, target = sync's final success (printed "
           "table below)", "python benchmarks/async_learning.py", last_line("time to target:"), 30,
           quick="--steps 4 --seeds 0", block=block_from("tools:")),
    Figure("policy-optim", "the policy-optimisation mechanisms on the demo, 16 steps each from the seed-0 SFT "
           "checkpoint (printed table below; one run each, so a few points are noise)",
           "python benchmarks/policy_optim_ablation.py", ablation, 12, quick="--steps 4",
           block=block_from("variant")),
    Figure("trainer-ranks", "the demo's learner step on 1 vs 2 trainer ranks (gloo on CPU, rank 1 spawned running "
           "`follow`): the same 2 cores as 1 rank × 2 threads or 2 ranks × 1 thread, so the ideal step ratio is 1×; "
           "the demo's model and one 4× wider, synthetic batches of the demo's shape (printed table below)",
           "python benchmarks/trainer_ranks.py", last_line("2 ranks ÷ 1 rank"), 15, quick="--steps 1 --models demo",
           block=block_from("model")),
    Figure("lora-learning", "the demo's RL phase (16 steps from tiny-sft) with `model.lora` (rank 16, lr 5e-4) vs full "
           "fine-tuning (lr 8e-5), 3 seeds each; the trained adapter in the engine vs peft's forward",
           "python benchmarks/lora_learning.py", last_line("LoRA r="), 6, quick="--seeds 0",
           block=block_from("seed 0")),
    Figure("program-learning", "the demo's RL phase (16 steps from tiny-sft) played by examples/openai_agent (the "
           "official openai SDK over HTTP, `agent_loop.name: program`) vs the tool_agent loop, seed 0; recorded vs "
           "teacher-forced logprobs over 64 episodes", "python benchmarks/program_learning.py",
           last_line("seed 0 program - tool_agent"), 4, block=block_from("seed 0 tool_agent")),
    Figure("lora-merge", "LoRA in the engine merged (once per sync) vs unmerged (low-rank products every decode step), "
           "the demo's shape and 4× wider, 1 thread (printed table below)", "python benchmarks/lora_merge.py",
           last_line("merged: "), 1, block=block_from("demo (")),
    Figure("lora-sync", "weight sync through `tether serve` (RemoteEngine → server), LoRA rank 16 vs full weights, the "
           "demo's shape and 4× wider (printed table below)", "python benchmarks/lora_sync.py",
           last_line("full weights / LoRA"), 0.5, block=block_from("shape")),
]


# ---- the commit, the machine, the section ----------------------------------------------------------------------


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def code_id(root: Path) -> dict[str, str]:
    """The code being measured: HEAD, and a hash of the uncommitted changes outside this script's own files."""
    sha = git(root, "rev-parse", "HEAD")
    exclude = [f":(exclude){p}" for p in (*OWN, ".venv")]  # a worktree's link to the checkout's venv is no code
    status = git(root, "status", "--porcelain", "--", ".", *exclude)
    if not status:
        return {"commit": sha, "changes": ""}
    diff = git(root, "diff", "HEAD", "--", ".", *exclude)
    return {"commit": sha, "changes": hashlib.sha256((status + diff).encode()).hexdigest()[:12]}


def same_code(root: Path, row: dict, now: dict) -> bool:
    """Was ``row`` measured on the code measured now? The same uncommitted changes, and the same commit or one
    that differs from HEAD only in this script's own files."""
    if row.get("changes") != now["changes"]:
        return False
    if row.get("commit") == now["commit"]:
        return True
    exclude = [f":(exclude){p}" for p in OWN]
    return subprocess.run(["git", "diff", "--quiet", str(row.get("commit")), now["commit"], "--", ".", *exclude],
                          cwd=root, capture_output=True).returncode == 0


def machine() -> str:
    model = "unknown CPU"
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass  # not Linux, or no model name: the core count still says the size
    return f"{os.cpu_count()} cores ({model})"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section(registry: list[Figure], rows: dict[str, dict], now: dict) -> str:
    """The text between the markers: the header, the table, the printed blocks."""
    shown = [(f, rows[f.name]) for f in registry if f.name in rows]
    commit = str(now["commit"])[:7] + (" + uncommitted changes" if now["changes"] else "")
    dates = sorted({r["date"] for _, r in shown}) or [datetime.date.today().isoformat()]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    machines = sorted({r["machine"] for _, r in shown}) or [machine()]
    lines = [f"Measured on commit {commit}, {when}, on {' and '.join(machines)}; load: the 1-minute load average "
             "before → after the row's command, and its wall time.", "",
             "| what | figure | command | load |", "|---|---|---|---|"]
    for f, r in shown:
        load = f"{r['load_before'][0]:.2f} → {r['load_after'][0]:.2f}, {r['wall_s']:.0f} s"
        lines.append(f"| {cell(f.what)} | {cell(r['figure'])} | `{cell(r['command'])}` | {load} |")
    for _, r in shown:
        if r.get("block"):
            lines += ["", f"`{r['command']}` (load {r['load_before'][0]:.2f} → {r['load_after'][0]:.2f}):", "",
                      "```", r["block"], "```"]
    return "\n".join(lines)


def write_readme(readme: Path, body: str) -> None:
    """Replace what lies between the markers; every byte outside them stays as it is."""
    text = readme.read_text(encoding="utf-8")
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{readme}: no {BEGIN} … {END} section to write")
    readme.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}", encoding="utf-8")


def measure(f: Figure, quick: bool) -> dict:
    command = f"{f.command} {f.quick}" if quick and f.quick else f.command
    print(f"[figures] {f.name}: {command}", flush=True)
    before, t0 = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"figures-{f.name}-") as tmp:
        out = f.run(command, Path(tmp)) if f.run else execute(command)
    wall, after = time.perf_counter() - t0, os.getloadavg()
    row = {"command": command, "figure": f.parse(out), "block": f.block(out) if f.block else None,
           "load_before": [round(x, 2) for x in before], "load_after": [round(x, 2) for x in after],
           "wall_s": round(wall, 1), "date": datetime.date.today().isoformat(), "machine": machine(),
           "output_tail": out[-KEEP_OUTPUT:]}
    print(f"[figures] {f.name}: {row['figure']}", flush=True)
    return row


def main(argv: list[str] | None = None, registry: list[Figure] = REGISTRY, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated row names (default: all)")
    ap.add_argument("--quick", action="store_true", help="each row's cheaper arguments, where it has them")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--readme", type=Path, default=root / "README.md")
    ap.add_argument("--store", type=Path, default=root / STORE)
    args = ap.parse_args(argv)
    names = [f.name for f in registry]
    if args.list:
        for f in registry:
            quick = f"  (--quick: {f.quick})" if f.quick else ""
            print(f"{f.name:16s} ~{f.minutes:g} min  {f.command}{quick}")
        print(f"total ~{sum(f.minutes for f in registry):g} min")
        return 0
    only = args.only.split(",") if args.only else names
    if unknown := [n for n in only if n not in names]:
        ap.error(f"unknown rows {unknown}; the rows: {', '.join(names)}")
    now = code_id(root)
    stored = json.loads(args.store.read_text()) if args.store.exists() else {}
    rows = {n: r for n, r in stored.items() if n in names and same_code(root, r, now)}
    failed = []
    for f in (f for f in registry if f.name in only):
        try:
            rows[f.name] = {**now, **measure(f, args.quick)}
        except (ValueError, OSError, subprocess.SubprocessError) as e:  # reported below; the other rows go on
            print(f"[figures] {f.name}: FAILED: {e}", file=sys.stderr, flush=True)
            failed.append(f.name)
            rows.pop(f.name, None)  # a row that failed now is not shown from an earlier run either
        args.store.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
        write_readme(args.readme, section(registry, rows, now))
    if failed:
        print(f"[figures] not written (their output did not parse): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
