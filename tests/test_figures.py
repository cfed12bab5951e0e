"""``benchmarks/figures.py`` (``make figures``): a fake registry of one-line ``python -c`` commands in a throwaway
git repository, and parsers of real benchmarks against their printed output."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("figures", REPO / "benchmarks" / "figures.py")
assert spec is not None and spec.loader is not None
figures = importlib.util.module_from_spec(spec)
sys.modules["figures"] = figures  # dataclasses resolve the module by name
spec.loader.exec_module(figures)

HEAD_TEXT = "# a project\n\nprose the script must not touch: ü, `code`, | pipes |\n\n## Measured\n\n"
TAIL_TEXT = "\n\nmore prose after the table, no newline at the end"
README = f"{HEAD_TEXT}{figures.BEGIN}\n| old | table |\n{figures.END}{TAIL_TEXT}"


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def commit(root: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    git(root, "add", *files)
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    """A repository with README.md and code.py committed twice (the code changed): (root, first sha, HEAD sha)."""
    git(tmp_path, "init", "-q")
    first = commit(tmp_path, {"README.md": README, "code.py": "a = 1\n"}, "first")
    head = commit(tmp_path, {"code.py": "a = 2\n"}, "the code changes")
    (tmp_path / "benchmarks").mkdir()
    return tmp_path, first, head


def fake(name: str, value: str) -> Any:  # a figures.Figure (the module is loaded from its path)
    return figures.Figure(name, f"what {name} measures", f"python -c 'print(\"value: {value}\")'",
                          lambda out: figures.find(r"^value: (.+)$", out, "value").group(1), 0.01)


def stored_row(sha: str, value: str, changes: str = "") -> dict:
    return {"commit": sha, "changes": changes, "command": "python -c …", "figure": value, "block": None,
            "load_before": [0.5, 0.4, 0.3], "load_after": [0.6, 0.4, 0.3], "wall_s": 1.0, "date": "2024-01-02",
            "machine": "2 cores (a CPU)", "output_tail": f"value: {value}\n"}


def run(root: Path, registry: list, *argv: str) -> tuple[int, str]:
    rc = figures.main([*argv, "--readme", str(root / "README.md"), "--store", str(root / figures.STORE)],
                      registry=registry, root=root)
    return rc, (root / "README.md").read_text(encoding="utf-8")


def test_only_the_marked_section_is_rewritten_with_the_commit_and_the_load(repo):
    root, first, head = repo
    (root / figures.STORE).write_text(json.dumps({"kept": stored_row(head, "kept figure 7"),
                                                  "stale": stored_row(first, "stale figure 9")}))
    registry = [fake("fresh", "41.5 %"), fake("kept", "unused"), fake("stale", "unused")]
    rc, text = run(root, registry, "--only", "fresh")
    assert rc == 0
    assert text.startswith(HEAD_TEXT + figures.BEGIN + "\n") and text.endswith(figures.END + TAIL_TEXT)
    body = text[len(HEAD_TEXT) + len(figures.BEGIN):-len(figures.END + TAIL_TEXT)]
    assert f"Measured on commit {head[:7]}, " in body and "uncommitted" not in body and "| old |" not in body
    header = body.split("\n")[1]
    assert "2 cores (a CPU)" in header and re.search(r"\d+ cores \((?!a CPU).+\)", header)  # the kept row's, this
    fresh = next(line for line in body.splitlines() if line.startswith("| what fresh"))
    assert re.fullmatch(r"\| what fresh measures \| 41\.5 % \| `python -c 'print\(\"value: 41\.5 %\"\)'` \| "
                        r"\d+\.\d\d → \d+\.\d\d, \d+ s \|", fresh), fresh
    assert "| what kept measures | kept figure 7 |" in body and "0.50 → 0.60, 1 s" in body  # HEAD's row stays
    assert "stale" not in body  # measured on the first commit: removed, not marked
    stored = json.loads((root / figures.STORE).read_text())
    assert set(stored) == {"fresh", "kept"} and stored["fresh"]["commit"] == head
    assert stored["fresh"]["output_tail"] == "value: 41.5 %\n" and len(stored["fresh"]["load_before"]) == 3
    assert git(root, "status", "--porcelain", "--", "code.py") == ""  # the code was not touched


def test_committing_the_figures_keeps_them_and_changed_code_drops_them(repo):
    root, _, head = repo
    registry = [fake("one", "1"), fake("two", "2")]
    assert run(root, registry)[0] == 0
    commit(root, {"README.md": (root / "README.md").read_text(encoding="utf-8")}, "the figures")
    rc, text = run(root, [fake("one", "1"), fake("two", "22")], "--only", "two")
    assert rc == 0 and "| what one measures | 1 |" in text and "| 22 |" in text  # same code: row one stays
    assert f"commit {git(root, 'rev-parse', 'HEAD')[:7]}," in text
    (root / "code.py").write_text("a = 3\n")  # uncommitted code: every earlier row is of other code
    rc, text = run(root, [fake("one", "1"), fake("two", "222")], "--only", "two")
    assert rc == 0 and "+ uncommitted changes" in text and "| 222 |" in text and "what one" not in text


def test_an_output_that_does_not_parse_is_not_written_and_exits_1(repo):
    root, _, head = repo
    (root / figures.STORE).write_text(json.dumps({"broken": stored_row(head, "earlier figure")}))
    rc, text = run(root, [fake("ok", "5"), figures.Figure("broken", "w", "python -c 'print(1)'",
                                                          lambda out: figures.find("^value", out, "value"), 0.01)])
    assert rc == 1 and "| 5 |" in text and "earlier figure" not in text and "what broken" not in text


def test_no_markers_is_an_error_that_names_them(repo):
    root, _, _ = repo
    (root / "README.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="figures:begin"):
        run(root, [fake("one", "1")])


# The printed block of `python benchmarks/async_vs_sync.py` in README.md (session 7's run).
ASYNC_VS_SYNC = """\
[train] step 8 ...
workload: 8 steps x 32 trajectories, tools lognormal median 500 ms, sigma 1.2, cap 8 s; 2 threads
sync stage times (median per step): rollout 8.74 s (slowest episode), learner busy 0.19 s, engine busy 0.27 s, \
mean episode 4.04 s, mean group 4.07 s
mode                     wall s  samples/s  speed-up   ideal  of ideal
sync                       66.1       3.87     1.00x   1.00x     100%
one_step_off_policy        22.2      11.52     2.98x   4.07x      73%
fully_async                11.2      22.76     5.88x  10.17x      58%
speedup one_step_off_policy/sync = 2.98 (ideal 4.07; with C / T_episode, no bound: 4.09)
speedup fully_async/sync = 5.88 (ideal 10.17; with C / T_episode, no bound: 10.23)
"""


def test_async_vs_sync_parser_reads_the_benchmarks_printed_table():
    f = next(f for f in figures.REGISTRY if f.name == "async-vs-sync")
    assert f.parse(ASYNC_VS_SYNC) == ("one_step_off_policy **2.98×** sync (ideal 4.07×, 73% of it); "
                                      "fully_async **5.88×** sync (ideal 10.17×, 58% of it)")
    assert f.block is not None
    block = f.block(ASYNC_VS_SYNC)
    assert block.startswith("workload: 8 steps") and block.endswith("no bound: 10.23)") and "[train]" not in block


def test_pytest_summary_as_printed_by_xdist_and_by_a_plain_run():
    xdist = "....\n953 passed, 2 skipped in 247.12s (0:04:07)\n"
    assert figures.pytest_summary(xdist) == "953 passed, 2 skipped in 247 s"
    out = "x\n========= 1 passed, 5 deselected in 3.40s =========\n"
    assert figures.pytest_summary(out) == "1 passed in 3 s"
    assert figures.printed_max_diff("max |engine logprob - forward logprob| over 64 trajectories: 9.52e-07\n" + out) \
        == "max abs difference 9.5e-07 over 64 trajectories (1 passed in 3 s)"
    assert figures.printed_max_diff("remote engine: max |behaviour logprob - teacher-forced logprob| = 4.80e-07 over "
                                    "288 tokens\n" + out).startswith("max abs difference 4.8e-07 over 288 tokens")


def test_demo_parser_counts_the_real_verify_optim_table(tmp_path):
    """``tether verify optim`` run as the registry runs it, on a run whose step 3 has too large a gradient."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("policy_optimization: {kl_control: {max_kl: 0.05}}\n")
    healthy = {"optim/raw_reward_std_within_group": 0.35, "optim/grad_norm": 0.8, "optim/kl_divergence": 0.004}
    rows = [{"step": 0, "eval/success_rate": 0.3}] + [{"step": s, **healthy} for s in range(1, 5)]
    rows[3]["optim/grad_norm"] = 40.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"seed": 0, "sft_success": 0.359, "rl_success": 0.812, "gain": 0.453, "total_s": 513.2}
    out = f"[figures] summary {json.dumps(summary)}\n" + figures.execute(f"tether verify optim {run}")
    assert figures.demo(out) == (
        "held-out success after SFT → after RL, seed 0: 35.9% → 81.2% (RL 513 s); **mean gain +45.3 points**; "
        "verify optim: optim/raw_reward_std_within_group > 0.1 on 4 of 4, optim/grad_norm in [0.1, 10] on 3 of 4, "
        "optim/kl_divergence < max_kl = 0.05 on 4 of 4")


def test_engine_parser_reads_the_benchmarks_aligned_summary_lines():
    out = """repeat 1: engine 3244 tok/s (85% of prompt tokens from cached prefixes), generate 1481 tok/s
engine   (LocalEngine, 64 async conversations): 3244 tok/s (median of 3)
generate (batched per turn, left padding):      1435 tok/s (median of 3)
ratio engine/generate = 2.26
"""
    assert figures.engine_throughput(out) == "3244 vs 1435 tokens/s, **ratio 2.26** (medians of 3)"


def test_serve_parser_reads_the_median_ratios_and_their_rounds():
    row = "{:8s}  192 req   13499 tok    4.75 s     {} tok/s   40.4 req/s   latency p50   1.33 s  p99   2.78 s"
    out = "\n".join([
        "round 1:", "streamed: first content after 0.11 s (median) of 2.71 s per request", row.format("local", 2839),
        row.format("server", 2073), "round 2:", "streamed: first content after 0.09 s (median) of 2.5 s per request",
        row.format("local", 3001),
        "ratio server/local tokens/s = 0.73 (median of 2 rounds: 0.71 0.75)",
        "ratio stream/local tokens/s = 0.52 (median of 2 rounds: 0.50 0.54)",
        "ratio stream (--stream-interval 1)/local tokens/s = 0.47 (median of 2 rounds: 0.47 0.47)"])
    assert figures.serve_throughput(out) == (
        "**ratio 0.73** (0.71 / 0.75); streamed **0.52** (0.50 / 0.54), 0.47 at a chunk every token (0.47 / 0.47); "
        "in-process 2839 / 3001 tokens/s; first content after 0.09 s (median)")


def test_time_to_target_parser_counts_each_seed_once():
    line = ("seed {}: to 75%: {} s wall / {} s CPU (step {}); held-out success at step 16: 80.0%; training 40 s "
            "(50 s CPU), evaluation 12 s; generated per trained trajectory 1.90; curve 0:36% 16:80%")
    seeds = [line.format(0, 21, 26, 8), "seed 1: to 75%: not reached; held-out success at step 16: 70.0%",
             line.format(2, 30, 39, 12)]
    out = "\n".join([*seeds, *seeds, "CPU time to target (median): 26 s; held-out success at the last step: 80.0%, "
                     "70.0%, 81.2%", "time to 75% = 30 s (median of 3 seeds)"])
    assert figures.time_to_target(out) == ("to 75 %: **median 30 s** over 3 seeds (step 8, 21 s / not reached / step "
                                           "12, 30 s); CPU 26 s; held-out success at the last step 80.0%, 70.0%, 81.2%")


def test_time_to_target_parser_gives_every_target():
    seeds = ["seed 0: to 75%: 18 s wall / 24 s CPU (step 8); to 85%: 40 s wall / 52 s CPU (step 16); held-out success "
             "at step 16: 85.9%; training 34 s", "seed 1: to 75%: 20 s wall / 26 s CPU (step 10); to 85%: not reached; "
             "held-out success at step 16: 78.1%; training 35 s"]
    out = "\n".join([*seeds, *seeds, "CPU time to target (median): 25 s; held-out success at the last step: 85.9%, "
                     "78.1%", "time to 75% = 19 s (median of 2 seeds)",
                     "time to 85% = not reached (median of 2 seeds)"])
    assert figures.time_to_target(out) == (
        "to 75 %: **median 19 s** over 2 seeds (step 8, 18 s / step 10, 20 s); CPU 25 s; to 85 %: **median not "
        "reached** over 2 seeds (step 16, 40 s / not reached); held-out success at the last step 85.9%, 78.1%")


def test_serve_load_parser_reads_the_ratio_and_the_rss():
    out = """round 1:
idle    200 requests in   4.1 s: p50    60.2 ms  p99   110.5 ms
loaded  200 requests in   7.5 s: p50    80.0 ms  p99   170.3 ms   (heavy requests abandoned 96 after at most 2.10 s)
round 1: p99 loaded/idle = 1.54
round 2:
idle    200 requests in   4.0 s: p50    58.0 ms  p99   100.0 ms
loaded  200 requests in   7.1 s: p50    79.0 ms  p99   210.0 ms   (heavy requests abandoned 96 after at most 2.20 s)
round 2: p99 loaded/idle = 2.10
p99 loaded/idle = 1.82 (median of 2 rounds: 1.54 2.10) (goal <= 2); serve/aborted = 90
server RSS: start 600 MB, peak 900 MB, end 640 MB (end/start = 1.07, goal <= 1.10)
"""
    assert figures.serve_load(out) == (
        "small requests' p99 170.3 / 210.0 ms loaded vs 110.5 / 100.0 ms idle (**ratio 1.82**, median of the rounds' "
        "1.54 / 2.10; goal <= 2); server RSS 600 -> peak 900 -> end 640 MB (**end/start 1.07**, goal <= 1.10)")
    with pytest.raises(ValueError, match="ratio line"):
        figures.serve_load(out.replace(" (median of 2 rounds: 1.54 2.10)", ""))
