"""Agent programs as rollouts (tether.programs): a program written with the official openai SDK plays episodes
against its own endpoint; the recorded calls become the same trajectories the tool_agent loop makes."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from conftest import SMALL_RUN, read_rows
from tether.agent.loop import LoopLimits, make_agent_loop
from tether.agent.replay import action_text, play_actions
from tether.config import ConfigError, load_config
from tether.engine.base import GenerationResult, SamplingParams
from tether.engine.scripted import ScriptedEngine
from tether.env.customer_service.expert import ScriptedExpert
from tether.programs.recording import Call
from tether.programs.stitch import stitch
from tether.runtime import Runtime, agent_program, env_factory

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"


def example_agent():
    spec = importlib.util.spec_from_file_location("openai_agent_example", EXAMPLE / "agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.agent


def call(prompt, out, lp=-0.5, version=0):
    return Call(list(prompt), GenerationResult(list(out), [lp] * len(out), "stop", [version] * len(out)), 0.0)


def test_stitch_continues_extended_prompts_and_splits_the_rest():
    calls = [call([1, 2], [3, 4]),                 # segment A
             call([1, 2, 3, 4, 5, 6], [7], -1.0),  # extends A: context 5 6, then 7
             call([9, 9], [8]),                    # a side conversation: segment B
             call([1, 2, 3, 4, 5, 6, 7, 10], [11], -2.0, 1),  # extends A again (B does not prefix it)
             call([1, 2, 3, 0], [12])]             # rewrote A's history: segment C
    a, b, c = stitch(calls)
    assert a.prompt_ids == [1, 2] and a.response_ids == [3, 4, 5, 6, 7, 10, 11]
    assert a.response_mask == [1, 1, 0, 0, 1, 0, 1]
    assert a.logprobs == [-0.5, -0.5, 0.0, 0.0, -1.0, 0.0, -2.0]
    assert a.versions == [0, 0, -1, -1, 0, -1, 1]
    assert (b.prompt_ids, b.response_ids, b.response_mask) == ([9, 9], [8], [1])
    assert (c.prompt_ids, c.response_ids) == ([1, 2, 3, 0], [12])
    # two choices of one prompt: the one the next prompt extends is continued, the other is a segment of its own
    x, y = stitch([call([1], [2]), call([1], [3]), call([1, 3, 4], [5])])
    assert (x.prompt_ids, x.response_ids) == ([1], [2]) and (y.prompt_ids, y.response_ids) == ([1], [3, 4, 5])


@pytest.fixture(scope="module")
def world(tiny_model):
    cfg = load_config([], [f"model.path={tiny_model}", "environment.num_train_tasks=6", "environment.num_eval_tasks=2",
                           "agent_loop.max_assistant_turns=5", "agent_loop.max_user_turns=3"])
    rt = Runtime.build(cfg)
    yield cfg, rt
    rt.close()


def loops(rt, engine_a, engine_b, program, **kw):
    args = dict(tokenizer=rt.tokenizer, sampling=SamplingParams(max_tokens=256),
                limits=LoopLimits(max_user_turns=3, max_assistant_turns=5, max_parallel_calls=2, context_window=4096))
    return (make_agent_loop("tool_agent", engine=engine_a, **args),
            make_agent_loop("program", engine=engine_b, **args, program=program, **kw))


def test_the_openai_sdk_agent_makes_the_tool_agent_loops_trajectories(world):
    """The expert's actions as the model's texts: the example agent (official openai SDK, over HTTP) and the
    tool_agent loop give the same tokens, masks, rewards, terminations and counts, episode for episode."""
    cfg, rt = world
    make_env, tasks = env_factory(cfg)
    for task in tasks("train")[:4]:
        actions, _ = play_actions(make_env(), task, ScriptedExpert().act, LoopLimits(3, 5, 2))
        texts = [action_text(a) for a in actions]
        native, program = loops(rt, ScriptedEngine(rt.tokenizer, texts, logprob=-0.25),
                                ScriptedEngine(rt.tokenizer, texts, logprob=-0.25), example_agent())
        try:
            a = asyncio.run(native.run(task, make_env(), seed=7))
            b = asyncio.run(program.run(task, make_env(), seed=7))
        finally:
            program.close()
        assert len(b.segments) == 1, b.errors
        for name in ("prompt_ids", "response_ids", "response_mask", "logprobs", "versions", "reward", "success",
                     "termination", "truncated", "num_tool_calls", "num_user_turns", "num_assistant_turns",
                     "reward_components", "hacking_flags", "errors"):
            assert getattr(a, name) == getattr(b, name), (task.id, name)
        assert [m["role"] for m in a.messages] == [m["role"] for m in b.messages]
        assert a.num_tool_calls >= 1 and a.reward > 0
        # both loops time the environment's steps and its scoring (agent/tool_calls, agent/compute_score)
        assert a.metrics.tool_calls > 0 and b.metrics.tool_calls > 0, (a.metrics, b.metrics)
        assert (a.metrics.compute_score > 0) == (b.metrics.compute_score > 0), (a.metrics, b.metrics)


def test_recorded_logprobs_are_the_policys_teacher_forced(world):
    """A real engine behind the endpoint: every recorded token's logprob equals log_softmax(logits / T) of a
    teacher-forced forward pass of the same model over the stitched segment."""
    cfg, rt = world
    make_env, tasks = env_factory(cfg)
    program = make_agent_loop("program", engine=rt.engine, tokenizer=rt.tokenizer,
                              sampling=SamplingParams(temperature=1.0, max_tokens=24),
                              limits=LoopLimits(3, 3, 2, 4096), program=example_agent())

    async def episodes():
        return await asyncio.gather(*(program.run(t, make_env(), seed=i) for i, t in enumerate(tasks("train"))))

    try:
        trajs = asyncio.run(episodes())
    finally:
        program.close()
    worst, tokens = 0.0, 0
    model = rt.engine.model
    for traj in trajs:
        assert traj.num_assistant_turns >= 1 and traj.termination
        for seg in traj.segments:
            ids = torch.tensor([seg.prompt_ids + seg.response_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(seg.prompt_ids)
            for j, (tok, m, lp) in enumerate(zip(seg.response_ids, seg.response_mask, seg.logprobs)):
                if m:
                    worst = max(worst, abs(float(logp[p + j - 1, tok]) - lp))
                    tokens += 1
    assert tokens > 50
    assert worst < 1e-4, worst


def test_limits_failures_timeouts_and_a_returned_reward(world):
    cfg, rt = world
    make_env, tasks = env_factory(cfg)
    task = tasks("train")[0]
    chatty = [action_text({"name": "query_inventory", "params": {"sku_id": "SKU-1"}})] * 10

    def forever(ep):  # never stops by itself: the endpoint's call limit ends it
        from openai import OpenAI

        client = OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        while True:
            client.chat.completions.create(model=ep.model, messages=ep.messages(), tools=ep.tools)

    def crash(ep):
        raise KeyError("boom")

    def slow(ep):
        import time

        time.sleep(5)

    async def scored(ep):  # async programs run on the rollout's loop; a returned number is the reward
        obs = await ep.acall_tool("query_inventory", {"sku_id": "SKU-1"})
        assert not obs.error or obs.text
        return 0.375

    def run(program, **kw):
        loop = make_agent_loop("program", engine=ScriptedEngine(rt.tokenizer, list(chatty)), tokenizer=rt.tokenizer,
                               sampling=SamplingParams(max_tokens=64), limits=LoopLimits(3, 4, 2, 4096),
                               program=program, **kw)
        try:
            return asyncio.run(loop.run(task, make_env(), seed=1))
        finally:
            loop.close()

    t = run(forever)
    assert t.termination == "max_assistant_turns" and t.num_assistant_turns == 4 and t.truncated and not t.errors
    t = run(crash)
    assert t.termination == "program_error" and t.errors == ["program raised KeyError: 'boom'"]
    assert t.response_ids == [] and len(t.prompt_ids) > 10  # the opening prompt, nothing generated
    t = run(slow, timeout_s=0.3)
    assert t.termination == "program_timeout"
    t = run(scored)
    assert t.reward == 0.375 and t.reward_components["program"] == 0.375 and t.num_tool_calls == 1


def test_the_gateway_refuses_other_routes_ended_episodes_and_a_wrong_key(world):
    import httpx

    cfg, rt = world
    make_env, tasks = env_factory(cfg)
    seen = {}

    def probe(ep):
        root = ep.base_url.rsplit("/sessions/", 1)[0]
        head = {"Authorization": f"Bearer {ep.api_key}"}
        seen["models"] = httpx.get(ep.base_url + "/models", headers=head, trust_env=False).json()["data"][0]["id"]
        seen["wrong key"] = httpx.get(ep.base_url + "/models", headers={"Authorization": "Bearer x"},
                                      trust_env=False).status_code
        seen["weights"] = httpx.post(root + "/update_weights_from_disk", headers=head, json={},
                                     trust_env=False).status_code
        seen["other episode"] = httpx.get(root + "/sessions/nope/v1/models", headers=head,
                                          trust_env=False).status_code
        seen["url"] = ep.base_url

    loop = make_agent_loop("program", engine=rt.engine, tokenizer=rt.tokenizer, sampling=SamplingParams(),
                           limits=LoopLimits(), program=probe)
    try:
        asyncio.run(loop.run(tasks("train")[0], make_env(), seed=0))
        after = httpx.get(seen["url"] + "/models", headers={"Authorization": f"Bearer {loop.gateway().api_key}"},
                          trust_env=False).status_code
    finally:
        loop.close()
    assert seen == {"models": "policy", "wrong key": 401, "weights": 404, "other episode": 404, "url": seen["url"]}
    assert after == 404  # the episode's endpoint ends with the episode


def test_program_keys_are_checked_at_load(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="agent_loop.program"):
        load_config([], ["agent_loop.name=program"])
    with pytest.raises(ConfigError, match="agent_loop.program"):
        load_config([], ["agent_loop.program=agent:agent"])
    with pytest.raises(ConfigError, match="agent_loop.program 'no_such_module:agent'"):
        agent_program("no_such_module:agent")


def test_tether_train_runs_the_example_agent_and_its_timeout_key_acts(tiny_model, tmp_path):
    """`tether train` with examples/openai_agent/config.yaml: the program plays every episode (its steps train,
    finite metrics); program_timeout_s flipped to a tiny value times every episode out, counted."""
    from typer.testing import CliRunner

    from tether.cli import app

    cfg = tmp_path / "run.yaml"
    cfg.write_text(SMALL_RUN + "trainer: {total_steps: 2, eval_every: 0, save_every: 2, seed: 3}\n")

    def train(name: str, *sets: str) -> list[dict]:
        args = ["train", str(cfg), str(EXAMPLE / "config.yaml"), "--run-dir", str(tmp_path / name), "--set",
                f"model.path={tiny_model}"]
        for s in sets:
            args += ["--set", s]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        return [r for r in read_rows(tmp_path / name) if "rollout/response_tokens" in r]  # the training steps

    rows = train("program")
    assert len(rows) == 2 and all(math.isfinite(r["optim/loss"]) for r in rows)
    assert all(r["rollout/response_tokens"] > 0 for r in rows)
    assert not any("agent/program_errors" in r or "agent/program_timeouts" in r for r in rows)
    slow = train("timeouts", "agent_loop.program_timeout_s=0.001")
    assert all(r["agent/program_timeouts"] >= 1 for r in slow)


def test_a_recorded_call_keeps_the_runs_sampling_and_limits():
    """Whatever the request asks, the engine samples with the run's temperature and top_p (the learner recomputes
    logprobs under them) and the episode's turn seeds, the request's stop ids added to the run's; the call limit and
    the context window end the episode."""
    from tether.agent.loop import turn_seed
    from tether.programs.recording import Session, SessionLimit

    run = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=32, stop_token_ids=(5,))
    session = Session("s", sampling=run, seed=3, window=100, max_calls=2)
    asked = SamplingParams(temperature=0.0, top_p=0.1, max_tokens=64, stop_token_ids=(9,), seed=42)
    got = session.admit([1] * 90, asked)
    assert (got.temperature, got.top_p, got.max_tokens, got.stop_token_ids) == (0.7, 0.9, 10, (5, 9))
    assert got.seed == turn_seed(3, 0) and session.admit([1], asked).seed == turn_seed(3, 1) != turn_seed(3, 0)
    with pytest.raises(SessionLimit, match="max_assistant_turns"):
        session.admit([1], asked)
    assert session.ending == "max_assistant_turns"
    full = Session("t", sampling=run, seed=None, window=100, max_calls=2)
    with pytest.raises(SessionLimit, match="context window"):
        full.admit([1] * 100, asked)
    assert full.ending == "context_window" and full.started == 0


COMMAND = '''
import json, os, sys, httpx
from openai import OpenAI
episode = json.loads(os.environ["TETHER_EPISODE"])
if sys.argv[1:] == ["fail"]:
    raise SystemExit("no luck: " + episode["task_id"])
if sys.argv[1:] == ["sleep"]:
    import time; time.sleep(30)
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY point at the episode's endpoint
messages = [{"role": "system", "content": episode["system_prompt"]}, {"role": "user", "content": episode["prompt"]}]
reply = client.chat.completions.create(model=os.environ["TETHER_MODEL"], messages=messages, tools=episode["tools"])
call = reply.choices[0].message.tool_calls[0]
head = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
url = os.environ["TETHER_EPISODE_URL"]
obs = httpx.post(f"{url}/tools/{call.function.name}", json=json.loads(call.function.arguments), headers=head,
                 trust_env=False).json()
done = httpx.get(url, headers=head, trust_env=False).json()["done"]
print(json.dumps(obs), done, file=sys.stderr)
print("0.5" if "SKU-1" in obs["text"] else "-1")  # the tool answered about SKU-1 (not found)
'''


def test_a_command_program_plays_through_its_environment_variables(world, tmp_path):
    """agent_loop.program_command: a process per episode, pointed at its endpoint by OPENAI_BASE_URL / _API_KEY,
    its tools over TETHER_EPISODE_URL; its last stdout line is the reward; a failure and a timeout are counted."""
    import sys

    cfg, rt = world
    make_env, tasks = env_factory(cfg)
    script = tmp_path / "agent_cmd.py"
    script.write_text(COMMAND)
    text = action_text({"name": "query_inventory", "params": {"sku_id": "SKU-1"}})

    def run(*args, timeout_s=60.0):
        loop = make_agent_loop("program", engine=ScriptedEngine(rt.tokenizer, [text]), tokenizer=rt.tokenizer,
                               sampling=SamplingParams(max_tokens=64), limits=LoopLimits(3, 4, 2, 4096),
                               program=[sys.executable, str(script), *args], timeout_s=timeout_s)
        try:
            return asyncio.run(loop.run(tasks("train")[0], make_env(), seed=1))
        finally:
            loop.close()

    t = run()
    assert (t.reward, t.num_tool_calls, t.num_assistant_turns, len(t.segments)) == (0.5, 1, 1, 1), t.errors
    assert t.termination == "no_action" and t.response_mask.count(1) == len(rt.tokenizer.encode(text)) + 1
    t = run("fail")
    assert t.termination == "program_error"
    assert t.errors == [f"program command exited with status 1: no luck: {tasks('train')[0].id}"]
    t = run("sleep", timeout_s=1.0)
    assert t.termination == "program_timeout"


def test_a_langchain_agent_is_recorded_too(world):
    """LangChain's ChatOpenAI with bound tools, pointed at the episode's endpoint: its calls are the trajectory's."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    cfg, rt = world
    make_env, tasks = env_factory(cfg)
    texts = [action_text({"name": "query_inventory", "params": {"sku_id": "SKU-1"}}), "Checked: SKU-1 is unknown."]

    def agent(ep):
        llm = ChatOpenAI(base_url=ep.base_url, api_key=ep.api_key, model=ep.model, max_retries=0).bind_tools(ep.tools)
        messages = [SystemMessage(ep.system_prompt), HumanMessage(ep.prompt)]
        reply = llm.invoke(messages)
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(ToolMessage(ep.call_tool(call["name"], call["args"]).text, tool_call_id=call["id"]))
        final = llm.invoke(messages)
        ep.call_tool("respond_to_user", {"message": final.content})

    loop = make_agent_loop("program", engine=ScriptedEngine(rt.tokenizer, texts, logprob=-0.5), tokenizer=rt.tokenizer,
                           sampling=SamplingParams(max_tokens=64), limits=LoopLimits(3, 4, 2, 4096), program=agent)
    try:
        t = asyncio.run(loop.run(tasks("train")[0], make_env(), seed=0))
    finally:
        loop.close()
    assert (t.num_assistant_turns, t.num_tool_calls, t.num_user_turns) == (2, 1, 1), t.errors
    assert len(t.segments) == 1  # LangChain's re-rendered history is the tokens the engine produced
    generated = [i for i, m in zip(t.response_ids, t.response_mask) if m]
    assert generated == [i for text in texts for i in rt.tokenizer.encode(text) + [t.response_ids[-1]]]
    assert set(lp for lp, m in zip(t.logprobs, t.response_mask) if m) == {-0.5}
