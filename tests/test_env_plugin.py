"""The plugin API: tools from functions (schemas by transformers' get_json_schema, checked against the config's
action_space), tasks from files, environment.name as a registered name, an import path, an entry point or
``tau2:<domain>``, and the generic no-op-pass detector."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path
from typing import Literal

import pytest

from tether.config import ConfigError, EnvironmentConfig, RunConfig, ToolSpec, load_config
from tether.config.environment import CS_OBSERVATION_FIELDS, CS_RULE_CHECKS
from tether.env.anti_hacking import HackingDetector, hacking_counts, reset_hacking_counts
from tether.env.customer_service import CustomerServiceEnv, grading
from tether.env.plugin import ToolEnvironment, bind, function_schema, load_task_file, registry, resolve
from tether.env.plugin.tasks import TaskFileError
from tether.runtime import env_factory

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_env"


def stock(state: dict, sku_id: str, unit: Literal["items", "boxes"], limit: int = 10, verbose: bool = False) -> dict:
    """Get the stock level of a product.

    Args:
        sku_id: Product id, e.g. SKU-123.
        unit: How to count.
        limit: At most this many.
        verbose: Say more.
    """
    state.setdefault("asked", []).append(sku_id)
    return {"sku_id": sku_id, "stock": min(state["stock"], limit), "unit": unit}


async def slow_echo(text: str) -> str:
    """Echo text, asynchronously.

    Args:
        text: Some text.
    """
    await asyncio.sleep(0)
    return text


def spec(name, params, timeout_ms=1000):
    return ToolSpec(name=name, params=params, timeout_ms=timeout_ms)


# ------------------------------------------------------------------------------------------ tools from functions

def test_schema_comes_from_type_hints_and_docstring_state_hidden():
    assert function_schema(stock, ["sku_id", "unit", "limit"]) == {"type": "function", "function": {
        "name": "stock", "description": "Get the stock level of a product.",
        "parameters": {"type": "object", "properties": {
            "sku_id": {"type": "string", "description": "Product id, e.g. SKU-123."},
            "unit": {"type": "string", "description": "How to count.", "enum": ["items", "boxes"]},
            "limit": {"type": "integer", "description": "At most this many."}},
            "required": ["sku_id", "unit"], "additionalProperties": False}}}
    # the config's order is the schema's order
    reordered = function_schema(stock, ["unit", "sku_id"])["function"]["parameters"]
    assert list(reordered["properties"]) == ["unit", "sku_id"]


def test_customer_service_schemas_are_the_ones_the_model_always_saw():
    """Rebuilt on functions, the customer-service tools keep their exact schema text (prompts and the tiny
    tokenizer's corpus are made of it): every parameter a required string, enums after descriptions."""
    schemas = CustomerServiceEnv().tool_schemas()
    assert [s["function"]["name"] for s in schemas] == ["query_inventory", "check_refund_policy", "escalate_to_human",
                                                        "respond_to_user"]
    assert json.dumps(schemas[2]) == (
        '{"type": "function", "function": {"name": "escalate_to_human", "description": "Hand the case to a human '
        'agent. Ends the conversation.", "parameters": {"type": "object", "properties": {"summary": {"type": '
        '"string", "description": "One line: the order id and the issue."}, "priority": {"type": "string", '
        '"description": "Priority the policy gave.", "enum": ["low", "medium", "high"]}}, "required": ["summary", '
        '"priority"], "additionalProperties": false}}}')


@pytest.mark.parametrize("action_space, message", [
    ([spec("nope", [])], r"environment.action_space\[0\]: tool 'nope' is not a tool of this environment; "
                         r"its tools: \['stock', 'slow_echo'\]"),
    ([spec("stock", ["sku", "unit"])], r"action_space\[0\]: stock takes params \['sku_id', 'unit', 'limit', 'verbose'\]"
                                       r".*not parameters of it: sku; required and not listed: sku_id"),
    ([spec("slow_echo", ["text"]), spec("slow_echo", ["text"])],
     r"action_space\[1\]: tool 'slow_echo' is listed twice"),
])
def test_action_space_is_checked_against_signatures(action_space, message):
    with pytest.raises(ValueError, match=message):
        bind({"stock": stock, "slow_echo": slow_echo}, action_space)


def test_a_function_without_docs_or_hints_is_refused_with_transformers_reason():
    def bare(x):
        """Does something.

        Args:
            x: A thing.
        """
        return x

    def undocumented(x: int) -> int:
        """Does something."""
        return x

    with pytest.raises(ValueError, match=r"action_space\[0\]: tool bare: Argument x is missing a type hint"):
        bind({"bare": bare}, [spec("bare", ["x"])])
    with pytest.raises(ValueError, match="no description for the argument 'x'"):
        bind({"undocumented": undocumented}, [spec("undocumented", ["x"])])


def test_bound_tools_get_the_state_check_types_and_run_sync_or_async():
    a, e = bind({"stock": stock, "slow_echo": slow_echo}, [spec("stock", ["sku_id", "unit", "limit"]),
                                                           spec("slow_echo", ["text"])])
    state = {"stock": 7}
    tool = a.tool(state)
    from tether.env.tools import run_tool

    ok = asyncio.run(run_tool(tool, {"sku_id": "SKU-1", "unit": "BOXES", "limit": 5}))
    assert (ok.error, ok.value) == (False, {"sku_id": "SKU-1", "stock": 5, "unit": "BOXES"})
    assert state["asked"] == ["SKU-1"]  # the episode's state, passed by the environment
    bad = asyncio.run(run_tool(tool, {"sku_id": "SKU-1", "unit": "boxes", "limit": "5"}))
    assert json.loads(bad.text) == {"error": "stock: limit must be an integer, got str"}
    hidden = asyncio.run(run_tool(tool, {"sku_id": "SKU-1", "unit": "boxes", "verbose": True}))
    assert json.loads(hidden.text) == {"error": "stock takes (sku_id, unit, limit): unexpected verbose"}
    echoed = asyncio.run(run_tool(e.tool(), {"text": "hi"}))
    assert (echoed.error, echoed.text) == (False, "hi")


# ------------------------------------------------------------------------------------------------ task files

def test_tasks_from_jsonl_and_yaml(tmp_path):
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"split": "train", "prompt": "1+1?", "answer": 2}\n\n'
                  '{"split": "eval", "id": "e", "kind": "k", "tools": ["calc"], "prompt": "2+2?", "answer": 4}\n'
                  '{"split": "train", "prompt": "3+3?", "answer": 6}\n')
    got = load_task_file(jl)
    assert [t.id for t in got["train"]] == ["train_000", "train_001"]
    (e,) = got["eval"]
    assert (e.id, e.split, e.kind, e.tools, e.data) == ("e", "eval", "k", ("calc",), {"prompt": "2+2?", "answer": 4})
    ym = tmp_path / "t.yaml"
    ym.write_text("train:\n  - {prompt: a, answer: 1}\neval:\n  - {prompt: b, answer: 2}\n")
    got = load_task_file(ym)
    assert [(t.id, t.data["answer"]) for t in got["train"] + got["eval"]] == [("train_000", 1), ("eval_000", 2)]


@pytest.mark.parametrize("name, text, message", [
    ("a.jsonl", '{"split": "train"}\n{"split": "test", "x": 1}\n',
     r"a.jsonl:2: split must be one of \['train', 'eval'\]"),
    ("b.jsonl", '{"split": "train", "id": "x"}\n{"split": "eval", "id": "x"}\n',
     "b.jsonl:2: task id 'x' is also used at"),
    ("c.jsonl", '{"split": "train"}\n{"split": \n', "c.jsonl:2: not valid JSON"),
    ("d.jsonl", '{"split": "eval"}\n', "d.jsonl: no train tasks"),
    ("e.yaml", "train:\n  - {split: eval}\n", r"e.yaml: train\[0\]: the record's split 'eval' differs"),
    ("f.txt", "", "task files are .jsonl, .yaml or .yml"),
])
def test_bad_task_files_name_the_file_and_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(TaskFileError, match=message):
        load_task_file(tmp_path / name)


# ----------------------------------------------------------------------------------- environment.name resolves

def example_config(name: str = "calc_env:environment", *sets: str):
    return load_config([EXAMPLE / "config.yaml"], [f"environment.name={name}", *sets])


def test_import_path_selects_a_users_environment(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    make_env, list_tasks = env_factory(example_config())
    train, held = list_tasks("train"), list_tasks("eval")
    assert (len(train), len(held)) == (24, 8) and train[0].data == {"prompt": "What is 14 * 15 - 2?", "answer": 208}
    env = make_env()
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculate", "respond_to_user"]
    obs = env.reset(task_id="train_000")
    assert obs["user_reply"] == "What is 14 * 15 - 2?"
    obs, reward, done, info = env.step({"name": "calculate", "params": {"expression": "14 * 15 - 2"}})
    assert (obs["last_tool_result"], obs["last_result"], done) == ("208", 208, False)
    obs, reward, done, info = env.step({"name": "respond_to_user", "params": {"message": "It is 208."}})
    assert (obs["user_reply"], done, info["termination"]) == ("Thanks.", True, "user_issue_resolved")
    # 0.6 correct + 0.2 computed + 0.2 brief (2 turns: 2/2)
    assert info["reward_components"] == {"correct": 1.0, "computed": 1.0, "brief": 1.0} and reward == 1.0
    # num_train_tasks caps a plugin's own tasks
    assert len(env_factory(example_config("calc_env:environment", "environment.num_train_tasks=5"))[1]("train")) == 5


def test_entry_point_of_an_installed_package_selects_it(tmp_path, monkeypatch):
    dist = tmp_path / "fake_calc-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-calc\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tether.environments]\ncalculator = calc_env:environment\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    assert registry.entry_points()["calculator"].value == "calc_env:environment"
    make_env, list_tasks = env_factory(example_config("calculator"))
    assert list_tasks("eval")[0].id == "eval_000" and make_env().reset()["user_reply"].startswith("What is")


def test_unknown_names_say_what_was_tried(monkeypatch):
    with pytest.raises(ValueError, match=r"'nowhere' is not a known environment; registered: "
                                         r"\['customer_service_agent'\]; installed tether.environments entry points"):
        resolve("nowhere")
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        resolve("no_such_module:environment")
    with pytest.raises(ValueError, match="module json has no 'nothing'"):
        resolve("json:nothing")
    with pytest.raises(ValueError, match="json:dumps.* calling it with no arguments failed"):
        resolve("json:dumps")


def test_tau2_names_import_the_adapter_only_then(monkeypatch):
    seen = []
    fake = types.ModuleType("tether.env.tau2")
    fake.environment = lambda domain: seen.append(domain) or (lambda cfg: "env", lambda split, cfg: [])
    monkeypatch.setitem(sys.modules, "tether.env.tau2", fake)
    make, list_tasks = resolve("tau2:retail")
    assert seen == ["retail"] and make(None) == "env"

    def missing(name, package=None):
        raise ModuleNotFoundError("No module named 'tau2'", name="tau2")

    monkeypatch.setattr(registry.importlib, "import_module", missing)
    with pytest.raises(ValueError, match=r"needs tau2-bench, which is not installed.*pip install 'tether\[tau2\]'"):
        resolve("tau2:airline")


def test_registered_names_and_pairs(monkeypatch):
    monkeypatch.setitem(registry.ENVIRONMENTS, "mine", (lambda cfg: "made", lambda split, cfg: [split]))
    make, list_tasks = resolve("mine")
    assert (make(None), list_tasks("eval", None)) == ("made", ["eval"])
    with pytest.raises(ValueError, match="must not contain ':'"):
        registry.register("a:b", None)


# ------------------------------------------------------------------------------------------ config names

def test_customer_service_names_are_checked_at_load_plugin_names_at_build(tmp_path, monkeypatch):
    assert set(CS_RULE_CHECKS) == set(grading.RULES) and set(CS_OBSERVATION_FIELDS[1:]) == {
        "user_intent", "order_status", "inventory_snapshot"}
    with pytest.raises(ConfigError, match=r"`environment.state.observation_fields\[1\]` = 'last_result'"):
        load_config([], ["environment.state.observation_fields=[last_tool_result, last_result]"])
    monkeypatch.syspath_prepend(str(EXAMPLE))
    cfg = example_config("calc_env:environment", "environment.state.observation_fields=[last_tool_result, nope]")
    with pytest.raises(ValueError, match=r"observation_fields lists \['nope'\]; this environment observes "
                                         r"\['last_tool_result', 'last_result'\]"):
        env_factory(cfg)
    cfg = example_config("calc_env:environment", "environment.verifier.rule_based=[{check: nope, weight: 1}]")
    with pytest.raises(ValueError, match=r"unknown checks \['nope'\]; known: \['computed', 'correct'\]"):
        env_factory(cfg)


# ------------------------------------------------------------------------------------------------ no-op pass

def _lookup(state: dict, key: str) -> str:
    """Read a value.

    Args:
        key: Which one.
    """
    return state["values"].get(key, "none")


def _write(state: dict, key: str, value: str) -> str:
    """Write a value.

    Args:
        key: Which one.
        value: What.
    """
    state["values"][key] = value
    return "ok"


def _done(state: dict) -> str:
    """Finish the episode."""
    return "bye"


KV = ToolEnvironment(
    tools=[_lookup, _write, _done],
    tasks=lambda split, cfg: [{"prompt": "set a to 1", "gold": {"a": "1"}}, {"prompt": "read a", "gold": {}}],
    system_prompt="Keep the store.",
    new_state=lambda task: {"values": {}},
    rules={"store_matches": lambda state, tr, task: float(state["values"] == task.data["gold"])},
    terminal_tools=("_done",), terminal_reason="done",
)


def kv_env(patterns, penalty=None):
    cfg = EnvironmentConfig.model_validate({
        "name": "kv", "state": {"observation_fields": ["last_tool_result"]},
        "action_space": [{"name": "_lookup", "params": ["key"], "timeout_ms": 100},
                         {"name": "_write", "params": ["key", "value"], "timeout_ms": 100},
                         {"name": "_done", "params": [], "timeout_ms": 100}],
        "verifier": {"rule_based": [{"check": "store_matches", "weight": 1.0}], "model_based": [],
                     "anti_hacking": {"detect_patterns": patterns, "penalty": penalty or {}}}})
    return KV.make_env(cfg)


def episode(env, task_id, actions):
    env.reset(task_id=task_id)
    for a in actions:
        obs, reward, done, info = env.step(a)
    assert done
    return reward, info


DONE = {"name": "_done", "params": {}}


def test_no_op_pass_is_flagged_where_it_applies_and_only_there():
    reset_hacking_counts()
    env = kv_env(["no_op_pass"])
    # the read-only task passes a do-nothing episode: flagged (the database-diff hole)
    reward, info = episode(env, "train_001", [DONE])
    assert (reward, info["success"], info["hacking_flags"]) == (1.0, True, {"no_op_pass": 1})
    # a reading episode of it is a no-op pass too: reads write nothing
    _, info = episode(env, "train_001", [{"name": "_lookup", "params": {"key": "a"}}, DONE])
    assert info["hacking_flags"] == {"no_op_pass": 1}
    # the write task: doing nothing fails (not a pass: not flagged); doing the write passes, not flagged
    reward, info = episode(env, "train_000", [DONE])
    assert (reward, info["success"], info["hacking_flags"]) == (0.0, False, {})
    reward, info = episode(env, "train_000", [{"name": "_write", "params": {"key": "a", "value": "1"}}, DONE])
    assert (reward, info["hacking_flags"]) == (1.0, {})
    assert hacking_counts().get("no_op_pass") == 2
    # not configured: never flagged
    assert episode(kv_env(["repeated_tool_calls"]), "train_001", [DONE])[1]["hacking_flags"] == {}


def test_no_op_pass_penalty_changes_the_reward():
    reward, info = episode(kv_env(["no_op_pass"], {"no_op_pass": 0.75}), "train_001", [DONE])
    assert (reward, info["hacking_penalty"], info["reward_components"]) == (0.25, 0.75, {"store_matches": 1.0})
    clean, _ = episode(kv_env(["no_op_pass"], {"no_op_pass": 0.75}), "train_000",
                       [{"name": "_write", "params": {"key": "a", "value": "1"}}, DONE])
    assert clean == 1.0


def test_detector_finish_is_a_plain_building_block():
    d = HackingDetector(patterns=["no_op_pass"])
    assert d.finish(wrote=False, passed=True) == ["no_op_pass"]
    assert d.finish(wrote=True, passed=True) == [] and d.finish(wrote=False, passed=False) == []
    assert HackingDetector(enabled=False, patterns=["no_op_pass"]).finish(wrote=False, passed=True) == []


def test_spawned_environments_share_the_config_work_and_run_their_own_episodes():
    """``spawn``: what is built per config is shared (the bound tools and their schemas, the verifier, the task
    lists); the episodes are not — two interleaved episodes of spawned environments score as if run alone."""
    first = kv_env(["no_op_pass"])
    a, b = first.spawn(), first.spawn()
    assert a._bound is first._bound and a.verifier is first.verifier and a._tasks is first._tasks
    a.reset(task_id="train_000")
    b.reset(task_id="train_000")
    a.step({"name": "_write", "params": {"key": "a", "value": "1"}})
    _, reward_b, done_b, _ = b.step(DONE)  # b's store is still empty
    _, reward_a, done_a, _ = a.step(DONE)
    assert (reward_a, reward_b, done_a, done_b) == (1.0, 0.0, True, True)
    assert first._ep is None  # the original never began an episode


def test_env_factory_spawns_episodes_from_one_built_environment():
    cfg = RunConfig()  # the customer-service environment, a ToolEnv
    make_env, tasks = env_factory(cfg)
    a, b = make_env(), make_env()
    assert a is not b and a._bound is b._bound and a.definition is b.definition
    assert [t.id for t in tasks("eval")][:2] == ["test_000", "test_001"]
