"""OpenEnv environments (``environment.name: openenv:<url | app>``) driven directly, without a model: sessions, MCP
tools as tool calls, the server's reward and done, faults counted by cause, every ``environment.openenv`` key
flipped, and no server left behind. The servers are real uvicorn processes serving openenv-core apps
(examples/openenv_env/guess_server.py, tests/openenv_apps.py)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("openenv")

from tests.conftest import process_gone
from tether.config import load_config  # noqa: E402
from tether.config.openenv import OpenEnvConfig  # noqa: E402
from tether.env.openenv import environment, list_tasks  # noqa: E402
from tether.env.openenv.env import OpenEnvEpisode  # noqa: E402
from tether.env.openenv.pool import OpenEnvError, ServerPool  # noqa: E402
from tether.env.openenv.server import AppSpec, ServerProcess, ServerStartError  # noqa: E402
from tether.env.plugin.registry import EnvironmentNotFound, resolve  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openenv_env"
TESTS = Path(__file__).resolve().parent




def served(spec: AppSpec, index: int):
    """A server started by the test as a user would (uvicorn), not by tether: its URL while the fixture lives."""
    server = ServerProcess(spec, index=index)
    server.start(60)
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def guess_url():
    yield from served(AppSpec("guess_server:app", EXAMPLE), 90)


@pytest.fixture(scope="module")
def probe_url():
    yield from served(AppSpec("openenv_apps:app", TESTS), 91)


def episode(url: str, **keys) -> OpenEnvEpisode:
    cfg = OpenEnvConfig(**keys)
    return OpenEnvEpisode(ServerPool(url, cfg), cfg)


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, 20)  # guess_server.reset's choice


async def binary_search(env: OpenEnvEpisode) -> list[tuple]:
    low, high, steps = 1, 20, []
    while True:
        mid = (low + high) // 2
        obs, reward, done, info = await env.astep({"name": "guess", "params": {"number": mid}})
        steps.append((mid, obs["last_tool_result"], reward, done, info))
        if done:
            return steps
        low, high = (mid + 1, high) if obs["last_tool_result"] == "higher" else (low, mid - 1)


def test_a_running_server_by_url_concurrent_sessions_score_by_the_server(guess_url, metrics):
    first = episode(guess_url)
    envs = [first, *(first.spawn() for _ in range(3))]
    seeds = [0, 1, 2, 1_000_000]
    for env, seed in zip(envs, seeds):
        obs = env.reset(f"seed-{seed}")
        assert obs["user_reply"].startswith("I am thinking of a number between 1 and 20")
    [schema] = first.tool_schemas()  # the server's MCP tool, as an OpenAI function
    assert schema["function"]["name"] == "guess"
    assert schema["function"]["parameters"]["properties"]["number"]["type"] == "integer"

    async def play():  # four sessions at once, each with its own secret
        return await asyncio.gather(*(binary_search(e) for e in envs))

    for seed, steps in zip(seeds, asyncio.run(play())):
        mid, text, reward, done, info = steps[-1]
        if mid == secret(seed):  # found within the server's 5 guesses
            assert (text, reward, info["success"]) == ("correct", 1.0, True)
        else:
            assert (reward, info["success"]) == (0.0, False) and len(steps) == 5
        assert done and info["termination"] == "env_done" and info["success_from"] == "server"
        assert info["reward_components"] == {"openenv": reward}
        assert all(s[1] in ("higher", "lower") for s in steps[:-1])
    # a tool error is the model's: an error observation, no server fault
    env = first.spawn()
    env.reset("seed-5")
    obs, _, done, _ = env.step({"name": "guess", "params": {"number": "seven"}})
    assert obs["tool_error"] and obs["last_tool_result"].startswith("error: execution_error") and not done
    obs, _, _, _ = env.step({"name": "nope", "params": {}})
    assert obs["last_tool_result"] == "error: tool_not_found: Unknown tool: 'nope'"
    reward, info = env.finalize("max_assistant_turns")  # the agent loop ended it: the server's rewards so far
    assert (reward, info["termination"], info["success"], info["num_turns"]) == (0.0, "max_assistant_turns", False, 2)
    assert not any(k.startswith("env/openenv_errors") for k in metrics.peek())
    for e in [*envs, env]:
        e.close()
    first.shutdown()


def test_tasks_are_seeds_counted_by_the_task_keys():
    cfg = load_config([], ["environment.name=openenv:http://127.0.0.1:1", "environment.num_train_tasks=3",
                           "environment.num_eval_tasks=2"])
    assert [t.id for t in list_tasks("train", cfg)] == ["seed-0", "seed-1", "seed-2"]
    assert [t.data["seed"] for t in list_tasks("eval", cfg)] == [1_000_000, 1_000_001]


def test_request_timeout_s_fails_a_slow_call_counted_as_timeout(probe_url, metrics):
    slow = episode(probe_url, request_timeout_s=0.5)
    slow.reset("seed-0")
    with pytest.raises(OpenEnvError, match="timeout: no answer within 0.5 s .environment.openenv.request_timeout_s"):
        asyncio.run(slow.astep({"name": "wait", "params": {"seconds": 1.5}}))
    assert metrics.peek()["env/openenv_errors/timeout"] == 1
    patient = episode(probe_url, request_timeout_s=5)
    patient.reset("seed-0")
    obs, *_ = asyncio.run(patient.astep({"name": "wait", "params": {"seconds": 1.5}}))
    assert obs["last_tool_result"] == "waited" and metrics.peek()["env/openenv_errors/timeout"] == 1
    for e in (slow, patient):
        e.close()
        e.shutdown()


@pytest.mark.parametrize("threshold, success", [(0.5, True), (1.0, False)])
def test_success_threshold_decides_without_a_server_flag(probe_url, threshold, success):
    env = episode(probe_url, success_threshold=threshold, system_prompt="Probe.")
    env.reset()
    _, reward, done, info = env.step({"name": "finish", "params": {"reward": 0.6}})
    assert (reward, done, info["success"], info["success_from"]) == (0.6, True, success, "threshold")
    assert env.system_prompt() == "Probe." and episode(probe_url).system_prompt().startswith("Solve the task")
    env.close()
    env.shutdown()


def test_servers_starts_that_many_and_deals_episodes_out_then_stops_them():
    cfg = load_config([], ["environment.name=openenv:guess_server.py", "environment.openenv.servers=2"])
    make_env, _ = resolve(f"openenv:{EXAMPLE / 'guess_server.py'}")
    first = make_env(cfg)
    pids = [s.pid for s in first.pool.servers]
    assert len(set(pids)) == 2 and all(not process_gone(p) for p in pids)
    envs = [first.spawn() for _ in range(4)]
    for e in envs:
        e.reset("seed-0")
    assert [e._where.url for e in envs] == [first.pool.servers[i % 2].url for i in range(4)]
    for e in envs:
        e.close()
    first.shutdown()
    assert all(process_gone(p) for p in pids)


def test_start_timeout_s_waits_for_a_slow_server_or_fails_naming_the_key(monkeypatch):
    monkeypatch.setenv("SLOW_START_S", "2")
    target = str(TESTS / "openenv_apps.py")
    t = time.monotonic()
    with pytest.raises(ServerStartError, match=r"did not answer GET /health within 1 s .environment.openenv"):
        ServerPool(target, OpenEnvConfig(start_timeout_s=1))
    assert time.monotonic() - t < 10
    pool = ServerPool(target, OpenEnvConfig(start_timeout_s=60))
    assert pool.servers[0].alive()
    pool.shutdown()


def test_a_killed_tether_leaves_no_server(tmp_path):
    """SIGKILL, no atexit: the server goes with the process that started it (PR_SET_PDEATHSIG)."""
    script = ("import sys, time\nfrom tether.config.openenv import OpenEnvConfig\n"
              "from tether.env.openenv.pool import ServerPool\n"
              f"pool = ServerPool({str(EXAMPLE / 'guess_server.py')!r}, OpenEnvConfig())\n"
              "print(pool.servers[0].pid, flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    pid = int(proc.stdout.readline())
    assert not process_gone(pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(pid)


def test_bad_targets_and_keys_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="no_such_file.py is not a file or folder"):
        ServerPool("no_such_file.py", OpenEnvConfig())
    with pytest.raises(ValueError, match="environment.openenv.servers = 2: tether starts servers for an app"):
        ServerPool("http://127.0.0.1:1", OpenEnvConfig(servers=2))
    cfg = load_config([], ["environment.name=openenv:http://127.0.0.1:1", "environment.state.max_turns=7"])
    with pytest.raises(ValueError, match=r"environment.state.max_turns: not read by OpenEnv environments"):
        environment("http://127.0.0.1:1")[0](cfg)
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openenv" else real(name, *a))
    with pytest.raises(EnvironmentNotFound, match=r"needs openenv-core.*pip install 'tether\[openenv\]'"):
        resolve("openenv:http://127.0.0.1:1")
