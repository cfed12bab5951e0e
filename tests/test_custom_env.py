"""examples/custom_env: a user's calculator environment (under 100 lines) trained by the real ``tether train``, and its
episodes through the real agent loop with the reward breakdown computed by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import read_rows
from tether.cli import app
from tether.config import load_config
from tether.engine.scripted import ScriptedEngine
from tether.learner.model import load_model_and_tokenizer
from tether.runtime import agent_loop, env_factory

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_env"
COMPONENTS = ("correct", "computed", "brief")  # weights 0.6, 0.2, 0.2 (config.yaml)


def test_the_users_code_is_under_100_lines():
    assert len((EXAMPLE / "calc_env.py").read_text().splitlines()) < 100


def counting(fn, calls):
    @functools.wraps(fn)  # the same signature and docstring: the same schema
    def counted(*args, **kwargs):
        calls[fn.__name__] += 1
        return fn(*args, **kwargs)
    return counted


def test_tether_train_runs_the_custom_env_end_to_end(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(EXAMPLE)  # as the README runs it: the module is found beside the config
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import calc_env

    calls: Counter[str] = Counter()
    spied = dataclasses.replace(calc_env.environment, tools=[counting(f, calls) for f in calc_env.environment.tools])
    monkeypatch.setattr(calc_env, "environment", spied)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "config.yaml", "--set", "model.preset=null", "--set",
                                      f"model.path={tiny_model}", "--set", "trainer.total_steps=2",
                                      "--run-dir", str(run_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = read_rows(run_dir)
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the user's rule checks and rubric land in the breakdown, each a mean in [0, 1]
        assert all(0.0 <= r[f"reward/{c}"] <= 1.0 for c in COMPONENTS)
        assert math.isfinite(r["reward/mean"]) and math.isfinite(r["optim/loss"])
        assert r["rollout/generated_trajectories"] == 8
    evals = [json.loads(line) for f in sorted((run_dir / "validation").glob("step_*.jsonl"))
             for line in f.read_text().splitlines()]
    assert len(evals) == 16 and all(set(e["reward_components"]) == set(COMPONENTS) for e in evals)
    # the sampled rollouts' texts went to the user through the env's own respond_to_user function (the random tiny
    # model's text is rarely a parsable call; the scripted episodes below call calculate)
    assert calls["respond_to_user"] > 0, calls
    assert (run_dir / "checkpoints" / "step_2" / "config.json").is_file()


def test_the_module_is_found_beside_the_config_from_another_directory(tiny_model, tmp_path):
    """`tether train examples/custom_env/config.yaml` from the repository root (a fresh process: nothing on sys.path
    but what tether puts there): ``calc_env:environment`` is looked up beside the config file, not only in the current
    directory."""
    root = EXAMPLE.parents[1]
    tether = Path(sys.executable).with_name("tether")
    result = subprocess.run([str(tether), "train", str(EXAMPLE.relative_to(root) / "config.yaml"),
                             "--set", "model.preset=null", "--set", f"model.path={tiny_model}",
                             "--set", "trainer.total_steps=1", "--set", "environment.num_eval_tasks=2",
                             "--run-dir", str(tmp_path / "run")],
                            cwd=root, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "run directory:" in result.stdout
    assert "reward/correct" in (tmp_path / "run" / "metrics.jsonl").read_text()


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.mark.parametrize("texts, components, reward", [
    # calculate, then the right number: 0.6 + 0.2 + 0.2 (two turns: brief = 2/2)
    ([call("calculate", expression="14 * 15 - 2"), "It is 208."], {"correct": 1, "computed": 1, "brief": 1}, 1.0),
    # computed but told the wrong number: 0.2 + 0.2
    ([call("calculate", expression="14 * 15 - 2"), "It is 207."], {"correct": 0, "computed": 1, "brief": 1}, 0.4),
    # guessed right without the tool: 0.6 + 0.2
    (["It is 208."], {"correct": 1, "computed": 0, "brief": 1}, 0.8),
    # a bad expression is an error observation; four turns: brief = 2/4
    ([call("calculate", expression="import os"), call("calculate", expression="14*15-2"), "Hmm.", "208"],
     {"correct": 1, "computed": 1, "brief": 0.5}, 0.9),
])
def test_episodes_through_the_agent_loop_score_by_hand(tiny_model, monkeypatch, texts, components, reward):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    cfg = load_config([EXAMPLE / "config.yaml"], ["model.preset=null", f"model.path={tiny_model}",
                                                  "agent_loop.max_assistant_turns=4"])
    tok = load_model_and_tokenizer(tiny_model)[1]
    make_env, list_tasks = env_factory(cfg)
    task = list_tasks("train")[0]  # What is 14 * 15 - 2? -> 208
    traj = asyncio.run(agent_loop(cfg, ScriptedEngine(tok, texts), tok).run(task, make_env(), seed=0))
    assert traj.reward_components == components and traj.reward == pytest.approx(reward)
    assert traj.num_tool_calls == sum(t.startswith("<tool_call>") for t in texts)
    assert traj.termination == "user_issue_resolved"
