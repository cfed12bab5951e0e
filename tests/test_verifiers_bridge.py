"""verifiers (0.4.0) tasksets through agent programs (tether.programs.verifiers): verifiers' own rollout plays each
episode against the episode's endpoint and its own @vf.reward functions score it. Needs verifiers, which pins openai
and mcp versions the test extra does not take: these tests skip unless run in a venv that has it
(``pip install -e '.[verifiers]' pytest``)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from transformers import AutoTokenizer  # noqa: E402

from tether.agent.loop import LoopLimits, make_agent_loop  # noqa: E402
from tether.engine.base import SamplingParams  # noqa: E402
from tether.engine.scripted import ScriptedEngine  # noqa: E402
from tether.programs.verifiers import VerifiersTaskset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "verifiers_taskset"


def arith_module():
    spec = importlib.util.spec_from_file_location("arith_example", EXAMPLE / "arith.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def world(tiny_model):
    return arith_module(), AutoTokenizer.from_pretrained(tiny_model)


def program_loop(tokenizer, texts, program, *, turns=2):
    return make_agent_loop("program", engine=ScriptedEngine(tokenizer, texts, logprob=-0.5), tokenizer=tokenizer,
                           sampling=SamplingParams(max_tokens=64),
                           limits=LoopLimits(max_user_turns=1, max_assistant_turns=turns, max_parallel_calls=1,
                                             context_window=2048),
                           program=program, timeout_s=60)


def play(loop, bridge, tasks):
    async def episodes():
        return await asyncio.gather(*(loop.run(t, bridge.make_env(), seed=i) for i, t in enumerate(tasks)))

    try:
        return asyncio.run(episodes())
    finally:
        loop.close()


def test_a_right_answer_gets_verifiers_score_and_a_wrong_one_does_not(world):
    """Four episodes at once (one question, so whichever reply reaches whichever episode): the reward is verifiers'
    (correct 1.0 + shows_a_number 0.1), each of its rewards a component, and the engine saw the row's system prompt
    and question through verifiers' interception, token for token as the chat template renders them."""
    arith, tok = world

    class Same(arith.vf.Taskset[arith.ArithTask]):
        def load(self):
            for i in range(4):
                yield arith.ArithTask(arith.ArithData(id=f"s{i}", prompt="What is 6 * 7?", system_prompt=arith.SYSTEM,
                                                      answer="42"))

    bridge = VerifiersTaskset(Same(arith.vf.TasksetConfig()))
    tasks = bridge.list_tasks("train")
    loop = program_loop(tok, ["\\boxed{42}", "the result is 43", "no idea", "It is 42"], bridge.agent)
    engine = loop.engine
    trajs = play(loop, bridge, tasks)
    prompt = tok.apply_chat_template([{"role": "system", "content": arith.SYSTEM},
                                      {"role": "user", "content": "What is 6 * 7?"}],
                                     tokenize=False, add_generation_prompt=True)
    assert [tok.decode(p) for p in engine.prompts] == [prompt] * 4
    expected = {"\\boxed{42}": (1.0, 0.1), "the result is 43": (0.0, 0.1), "no idea": (0.0, 0.0),
                "It is 42": (1.0, 0.1)}
    assert sorted(t.messages[-1]["content"] for t in trajs) == sorted(expected)
    for traj in trajs:
        correct, number = expected[traj.messages[-1]["content"]]
        assert traj.reward == pytest.approx(correct + number)
        assert traj.reward_components == pytest.approx({"verifiers/correct": correct,
                                                        "verifiers/shows_a_number": number,
                                                        "program": correct + number})
        assert traj.success is (correct == 1.0) and traj.termination == "no_action" and traj.errors == []
        assert tok.decode(traj.prompt_ids) == prompt
        assert sum(traj.response_mask) == len(traj.response_mask) > 0 and set(traj.logprobs) == {-0.5}


def test_the_scripted_replies_score_exactly_as_verifiers_scores_them(world):
    """One episode at a time (the engine's order is the episode's): right boxed, right bare, wrong, no number."""
    arith, tok = world
    bridge = arith.VerifiersTaskset(arith.ArithTaskset(size=8))
    tasks = bridge.list_tasks("train")[:4]
    a = [bridge.row(t).data.answer for t in tasks]
    texts = [f"\\boxed{{{a[0]}}}", f"so {a[1]}", f"\\boxed{{{int(a[2]) + 1}}}", "hello"]
    got = []
    for task, text in zip(tasks, texts):
        got.append(play(program_loop(tok, [text], bridge.agent), bridge, [task])[0].reward)
    assert got == pytest.approx([1.1, 1.1, 0.1, 0.0])


def test_a_refused_call_and_a_failing_reward_end_the_episode_with_their_cause(world):
    """A prompt that fills the context window: the endpoint refuses the call, the episode ends on context_window,
    scored 0. A @vf.reward that raises: verifiers' trace fails, the episode is a program_error naming the error."""
    arith, tok = world
    bridge = arith.VerifiersTaskset(arith.ArithTaskset(size=4))
    task = bridge.list_tasks("train")[0]
    loop = make_agent_loop("program", engine=ScriptedEngine(tok, ["\\boxed{1}"]), tokenizer=tok,
                           sampling=SamplingParams(max_tokens=64),
                           limits=LoopLimits(max_user_turns=1, max_assistant_turns=2, max_parallel_calls=1,
                                             context_window=8), program=bridge.agent, timeout_s=60)
    cut = play(loop, bridge, [task])[0]
    assert (cut.termination, cut.reward, cut.success, loop.engine.prompts) == ("context_window", 0.0, False, [])

    class Broken(arith.ArithTask):
        @arith.vf.reward
        async def correct(self, task, trace) -> float:
            raise RuntimeError("the grader is down")

    class BrokenSet(arith.vf.Taskset[Broken]):
        def load(self):
            yield Broken(arith.ArithData(prompt="What is 1 + 1?", answer="2"))

    broken = VerifiersTaskset(BrokenSet(arith.vf.TasksetConfig()))
    failed = play(program_loop(tok, ["\\boxed{2}"], broken.agent), broken, broken.list_tasks("train"))[0]
    assert failed.termination == "program_error" and failed.reward == 0.0 and not failed.success
    assert len(failed.errors) == 1 and "the grader is down" in failed.errors[0], failed.errors


def test_success_reward_and_agent_config_reach_the_episode(world):
    """success_reward 1.0 → 0.05: a wrong reply with a number (0.1) becomes a success. agent_config's rollout
    timeout (verifiers' own stage deadline) of 1 µs: the right reply is never scored, reward 1.1 → 0."""
    arith, tok = world

    def one(bridge, text):
        task = bridge.list_tasks("train")[0]
        return play(program_loop(tok, [text.format(bridge.row(task).data.answer)], bridge.agent), bridge, [task])[0]

    wrong = "it is 1{}"
    assert [(t.reward, t.success) for t in (one(VerifiersTaskset(arith.ArithTaskset(size=2)), wrong),
                                            one(VerifiersTaskset(arith.ArithTaskset(size=2), success_reward=0.05),
                                                wrong))] == [(pytest.approx(0.1), False), (pytest.approx(0.1), True)]
    right = "\\boxed{{{}}}"
    assert one(VerifiersTaskset(arith.ArithTaskset(size=2)), right).reward == pytest.approx(1.1)
    late = one(VerifiersTaskset(arith.ArithTaskset(size=2), agent_config={"timeout": {"rollout": 1e-6}}), right)
    assert late.reward == 0.0 and late.reward_components["verifiers/correct"] == 0.0


def test_splits_are_disjoint_rows_and_an_eval_taskset_replaces_the_held_out_rows(world):
    arith, _ = world

    class Env:
        num_train_tasks, num_eval_tasks = 5, 3

    class Cfg:
        environment = Env

    bridge = VerifiersTaskset(arith.ArithTaskset(size=10))
    train, held_out = bridge.list_tasks("train", Cfg), bridge.list_tasks("eval", Cfg)
    assert [t.data["idx"] for t in train] == [0, 1, 2, 3, 4] and [t.data["idx"] for t in held_out] == [5, 6, 7]
    assert {t.data["key"] for t in train}.isdisjoint(t.data["key"] for t in held_out)
    other = VerifiersTaskset(arith.ArithTaskset(size=10), eval_taskset=arith.ArithTaskset(size=10, seed=9))
    assert [t.data["prompt"] for t in other.list_tasks("eval", Cfg)] == [
        r.data.prompt for r in list(arith.ArithTaskset(size=10, seed=9))[:3]]
    with pytest.raises(ValueError, match="bridge sets those"):
        VerifiersTaskset(arith.ArithTaskset(), agent_config={"model": "x"})
    with pytest.raises(ValueError, match="'train' and 'eval'"):
        bridge.list_tasks("test", Cfg)


@pytest.mark.slow
def test_tether_train_runs_the_example_with_verifiers_rewards(tmp_path, tiny_model):
    """`tether train examples/verifiers_taskset/config.yaml` for 2 steps: finite metrics, verifiers' rewards."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "tether", "train", str(EXAMPLE / "config.yaml"), "--run-dir", str(run),
                          "--set", "model.preset=null", "--set", f"model.path={tiny_model}", "--set",
                          "trainer.total_steps=2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "optim/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in ("optim/loss", "optim/grad_norm", "optim/kl_divergence", "optim/entropy", "reward/mean"):
            assert math.isfinite(r[key]), (key, r[key])
        assert r["reward/program"] == pytest.approx(r["reward/mean"])
        parts = r["reward/verifiers/correct"] + r["reward/verifiers/shows_a_number"]
        assert r["reward/program"] == pytest.approx(parts)
    assert "rollout/episode_errors" not in {k for r in rows for k in r}
