"""``environment.mcp_servers``: a real MCP server (``tests/mcp_server_fixture.py``, FastMCP) started over stdio (and one
served over streamable HTTP), its tools called by episodes of a plugin environment — through ``astep`` and through the
agent loop (model text → parser → MCP → observation in the next prompt) — with the scopes, timeouts, a killed server
and the clean-up checked on the server processes themselves."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tether.config import ConfigError, RunConfig, load_config
from tether.env.plugin import ToolEnvironment

pytest.importorskip("mcp")
pytest.importorskip("fastmcp")

FIXTURE = str(Path(__file__).resolve().with_name("mcp_server_fixture.py"))
STDIO = {"name": "fx", "command": [sys.executable, FIXTURE]}


def submit(state: dict, answer: str) -> str:
    """Submit the answer.

    Args:
        answer: The answer.
    """
    state["answer"] = answer
    return "ok"


DEFINITION = ToolEnvironment(tools=[submit], system_prompt="Use the tools.",
                             tasks=lambda split, cfg: [{"id": f"{split}_{i}", "prompt": "Add 2 and 3.5."}
                                                       for i in range(2)])


def config(*servers: dict, action_space: tuple[dict, ...] = (), **env) -> dict:
    return {"environment": {"name": "tests:mcp", "mcp_servers": list(servers),
                            "action_space": [{"name": "submit", "params": ["answer"], "timeout_ms": 100},
                                             *action_space],
                            "state": {"observation_fields": ["last_tool_result"]},
                            "verifier": {"rule_based": [], "model_based": []}, **env}}


def call(env, name: str, **params) -> tuple[str, bool]:
    obs, _, _, info = asyncio.run(env.astep({"name": name, "params": params}))
    return obs["last_tool_result"], info["tool_error"]


def alive(pid: int) -> bool:
    """Not exited (as tests.conftest.process_gone; a script below imports this module from its own folder)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # reaped, also between the open and the read
        return False
    return state != "Z"


def test_server_tools_are_episode_tools_and_their_results_the_observations():
    env = DEFINITION.make_env(config(STDIO))
    try:
        schemas = {s["function"]["name"]: s["function"] for s in env.tool_schemas()}
        assert list(schemas) == ["submit", "add", "bump", "nap", "fail", "pid", "shape", "whoami",
                                 "env_var"]
        assert schemas["add"]["description"].startswith("Add two numbers.")
        assert schemas["add"]["parameters"]["properties"] == {  # the server's JSON schema, docstring lines included
            "a": {"type": "number", "description": "The first number."},
            "b": {"type": "number", "description": "The second number."}}
        assert schemas["add"]["parameters"]["required"] == ["a", "b"]
        env.reset()
        assert call(env, "add", a=2, b=3.5) == ("5.5", False)  # the server's text content
        assert call(env, "shape") == ('{"rows": 2, "cols": 3}', False)  # no text: the structured content as JSON
        text, error = call(env, "fail", reason="no")  # isError: an error observation, counted
        assert error and json.loads(text) == {"error": "Error calling tool 'fail': refused: no"}
        assert call(env, "add", a="x", b=1) == ('{"error": "add: a must be a number, got str"}', True)  # schema
        assert env._ep.tool_errors == 2
        assert call(env, "submit", answer="5.5") == ("ok", False)  # the environment's own tool beside them
    finally:
        env.close()


@pytest.mark.parametrize("scope, counts", [("episode", [1, 2, 1, 2]), ("shared", [1, 2, 3, 4])])
def test_scope_episode_gives_each_episode_a_fresh_server_and_shared_keeps_it(scope, counts):
    env = DEFINITION.make_env(config({**STDIO, "scope": scope}))
    got, pids = [], set()
    try:
        for _ in range(2):
            episode = env.spawn()  # as the rollouter makes them
            episode.reset()
            got += [int(call(episode, "bump")[0]) for _ in range(2)]
            pids.add(int(call(episode, "pid")[0]))
            episode.close()
        assert got == counts
        assert len(pids) == (2 if scope == "episode" else 1)
    finally:
        env.close()
    assert not any(alive(p) for p in pids), "a server process outlived env.close()"


def test_timeout_from_the_action_space_entry_else_the_servers_timeout_ms():
    # 1 s, not less: the same limit holds for the `add` after it, a round trip to the server that took over 200 ms on
    # two cores loaded by other work (a fresh-clone CI run beside a benchmark)
    server = {**STDIO, "scope": "shared", "timeout_ms": 1000}
    env = DEFINITION.make_env(config(server))
    try:
        env.reset()
        t = time.perf_counter()
        assert call(env, "nap", seconds=6) == ('{"error": "tool nap timed out after 1000 ms"}', True)
        assert time.perf_counter() - t < 4.0
        assert call(env, "add", a=1, b=1) == ("2.0", False)  # the episode goes on, the session too
    finally:
        env.close()
    env = DEFINITION.make_env(config(server, action_space=({"name": "nap", "params": ["seconds"],
                                                            "timeout_ms": 3000},)))
    try:
        env.reset()
        assert call(env, "nap", seconds=1.5) == ("awake", False)  # past the server's 1000 ms, within the entry's 3000
    finally:
        env.close()


def test_a_killed_server_is_an_error_observation_and_the_next_episode_gets_a_new_one():
    env = DEFINITION.make_env(config({**STDIO, "scope": "shared"}))
    try:
        env.reset()
        pid = int(call(env, "pid")[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 10
        while alive(pid) and time.time() < deadline:
            time.sleep(0.05)
        text, error = call(env, "add", a=1, b=2)
        assert error and "MCP server fx could not run add: Connection closed" in text
        assert call(env, "submit", answer="3") == ("ok", False)  # the episode goes on
        env.reset()  # the broken shared session is replaced
        assert call(env, "add", a=1, b=2) == ("3.0", False)
        assert int(call(env, "pid")[0]) != pid
    finally:
        env.close()


def test_tools_subset_and_clashes_and_unknown_names_are_checked_at_start():
    env = DEFINITION.make_env(config({**STDIO, "tools": ["add"]}))
    try:
        assert [s["function"]["name"] for s in env.tool_schemas()] == ["submit", "add"]
    finally:
        env.close()
    with pytest.raises(ConfigError, match=r"`environment.mcp_servers\[0\].tools` names \['mul'\]"):
        DEFINITION.make_env(config({**STDIO, "tools": ["add", "mul"]}))

    def add(a: float) -> float:
        """Add.

        Args:
            a: A number.
        """
        return a

    clash = ToolEnvironment(tools=[submit, add], tasks=DEFINITION.tasks, system_prompt="x")
    with pytest.raises(ConfigError) as e:
        clash.make_env(config(STDIO))
    assert str(e.value).startswith("`environment.mcp_servers[0]`: MCP tool 'add' of server fx has the name of the "
                                   "environment's tool 'add'")
    bad = {**STDIO, "command": [sys.executable, "-c", "raise SystemExit(3)"]}
    with pytest.raises(ConfigError, match="MCP server fx did not start or list its tools"):
        DEFINITION.make_env(config(bad))


def test_env_and_cwd_of_a_stdio_server(monkeypatch):
    """``python`` runs tether's interpreter; ``cwd`` is where the relative script is found; ``env`` reaches it."""
    monkeypatch.setenv("MCP_TEST_VALUE", "v42")
    tests = str(Path(FIXTURE).parent)
    server = {"name": "fx", "command": ["python", "mcp_server_fixture.py"], "cwd": tests,
              "env": {"FIXTURE_VAR": "${MCP_TEST_VALUE}"}}
    env = DEFINITION.make_env(config(server))
    try:
        env.reset()
        assert call(env, "env_var", var="FIXTURE_VAR") == ("v42 in tests", False)
    finally:
        env.close()
    monkeypatch.chdir(Path(tests).parent)
    with pytest.raises(ConfigError, match="did not start"):  # without cwd the script is not found from here
        DEFINITION.make_env(config({k: v for k, v in server.items() if k != "cwd"}))


def test_the_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ConfigError, match=r"pip install 'tether\[mcp\]'"):
        DEFINITION.make_env(config(STDIO))


def test_config_is_checked_and_header_secrets_never_reach_a_dump(monkeypatch):
    with pytest.raises(ConfigError, match="exactly one of command"):
        load_config([], ["environment.mcp_servers=[{name: a, command: [x], url: 'http://h/mcp'}]"])
    with pytest.raises(ConfigError, match="no secret sits in a config file"):
        load_config([], ["environment.mcp_servers=[{name: a, url: 'http://h/mcp', headers: {X-Key: abc}}]"])
    with pytest.raises(ConfigError, match="tau2's environments keep their own tools"):
        load_config([], ["environment.name=tau2:mock", "environment.mcp_servers=[{name: a, command: [x]}]"])
    cfg = load_config([], ["environment.mcp_servers=[{name: a, url: 'http://h/mcp', "
                           "headers: {Authorization: 'Bearer ${MCP_TEST_TOKEN}'}}]"])
    monkeypatch.setenv("MCP_TEST_TOKEN", "s3cret")
    assert cfg.environment.mcp_servers[0].headers["Authorization"].get() == "Bearer s3cret"
    assert "s3cret" not in cfg.to_yaml() and "Authorization: '***'" in cfg.to_yaml()


def test_explain_describes_the_keys():
    from tether.config.explain import explain

    text = explain("environment.mcp_servers.scope")
    assert "a server process (or HTTP session) per episode" in text and "default: episode" in text


@pytest.fixture
def http_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, FIXTURE, "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(timeout=10)


def test_streamable_http_server_with_a_header_from_the_environment(http_server, monkeypatch):
    monkeypatch.setenv("MCP_TEST_TOKEN", "s3cret")
    server = {"name": "web", "url": http_server, "headers": {"Authorization": "Bearer ${MCP_TEST_TOKEN}"}}
    env = DEFINITION.make_env(RunConfig.model_validate(config(server)))
    try:
        env.reset()
        assert call(env, "add", a=2, b=3.5) == ("5.5", False)
        assert call(env, "whoami") == ("Bearer s3cret", False)
        assert [int(call(env, "bump")[0]) for _ in range(2)] == [1, 2]
    finally:
        env.close()


def test_a_tool_call_goes_from_model_text_through_mcp_into_the_next_prompt(tiny_model):
    """The agent loop: the scripted model's hermes call is parsed, run by the MCP server, and its result is in the
    prompt of the next turn (and the trajectory counts the call)."""
    from tether.engine.scripted import ScriptedEngine
    from tether.learner.model import load_model_and_tokenizer
    from tether.runtime import agent_loop

    tok = load_model_and_tokenizer(tiny_model)[1]
    cfg = RunConfig.model_validate({**config(STDIO), "model": {"preset": None, "path": tiny_model}})
    env = DEFINITION.make_env(cfg)
    try:
        call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3.25}}\n</tool_call>'
        engine = ScriptedEngine(tok, [call_text, '<tool_call>\n{"name": "submit", "arguments": {"answer": "5.25"}}'
                                                 '\n</tool_call>', "Done."])
        task = env.tasks("train")[0]
        traj = asyncio.run(agent_loop(cfg, engine, tok).run(task, env.spawn(), seed=0))
        first, second = (tok.decode(p) for p in engine.prompts[:2])
        assert "add(a, b): Add two numbers." in first  # the chat template shows the MCP tool
        assert second.startswith(first) and "5.25" in second[len(first):]  # the server's answer, next turn
        assert traj.num_tool_calls >= 2 and not traj.errors
    finally:
        env.close()


def test_no_server_outlives_a_process_that_exits_without_closing(tmp_path):
    """``atexit`` closes what is still open: a shared and an episode's server of a process that never called close."""
    script = tmp_path / "leave.py"
    script.write_text(f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_env_mcp import DEFINITION, STDIO, config, call
env = DEFINITION.make_env(config({{**STDIO, "scope": "shared"}}, ))
env.reset()
print(call(env, "pid")[0])
episode = DEFINITION.make_env(config(STDIO))
episode.reset()
print(call(episode, "pid")[0], flush=True)
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pids = [int(line) for line in out.stdout.split()]
    assert len(pids) == 2 and pids[0] != pids[1], out.stdout + out.stderr
    assert not any(alive(p) for p in pids)


def test_the_customer_service_environment_takes_mcp_servers_too():
    from tether.env.customer_service.env import CustomerServiceEnv

    servers = f"environment.mcp_servers=[{{name: fx, command: [python, {FIXTURE}], tools: [add]}}]"
    env = CustomerServiceEnv(load_config([], ["environment.num_train_tasks=2", servers]))
    try:
        names = [s["function"]["name"] for s in env.tool_schemas()]
        assert names[-1] == "add" and "query_inventory" in names
        env.reset()
        obs, _, _, info = asyncio.run(env.astep({"name": "add", "params": {"a": 1, "b": 2}}))
        assert obs["last_tool_result"] == "3.0" and not info["tool_error"]
    finally:
        env.close()
