"""Fuzz: whatever the model writes, its episode goes on with an error observation — no exception escapes the
parser, the environment or the agent loop — and no tool call reaches another episode's database. What the
environment, the verifier or the engine raise fails that one episode, counted by cause, never the group."""

import asyncio
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.agent.loop import LoopLimits, make_agent_loop
from tether.agent.parsers import MAX_CALLS_PER_TURN, get_parser
from tether.config import EnvironmentConfig
from tether.engine.base import SamplingParams
from tether.engine.scripted import ScriptedEngine
from tether.env.customer_service import CustomerServiceEnv, tasks
from tether.env.tools import argument_problem, parse_action
from tether.learner.model import load_model_and_tokenizer
from tether.metrics import MetricsRecorder, set_recorder
from tether.pipeline.evaluate import evaluate
from tether.pipeline.rollouter import Rollouter, RolloutError

PARSERS = ("hermes", "function_call_parser")
FUZZ = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


def block(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def call(name, args) -> str:
    return block(json.dumps({"name": name, "arguments": args}))


def deep(n: int) -> str:
    return "[" * n + "]" * n


def sku_call(value: str) -> str:
    """query_inventory with ``value`` written verbatim as the JSON of its sku_id."""
    return block('{"name": "query_inventory", "arguments": {"sku_id": ' + value + "}}")


# model text -> what the error observation says. Each one raised, hung or was silently accepted before.
HOSTILE = {
    "nested_500": (sku_call(deep(500)), "nested deeper than 32 levels"),  # RecursionError in memory.view
    "nested_1000": (sku_call(deep(1000)), "nested deeper than 32 levels"),  # RecursionError in json
    "nested_in_string_arguments": (call("query_inventory", '{"a": ' + deep(3000) + "}"), "nested deeper than 32"),
    "int_5000_digits": (sku_call("9" * 5000), "number longer than 100 characters"),  # ValueError in json
    "float_400_digits": (sku_call("1" * 400 + ".5"), "number longer than 100 characters"),
    "nan": (sku_call("NaN"), "NaN is not a JSON number"),
    "lone_surrogate": (sku_call('"SKU-\\ud800"'), "lone surrogate U+D800"),  # UnicodeEncodeError in sqlite
    "lone_surrogate_key": (block('{"name": "query_inventory", "arguments": {"\\udfff": "x"}}'), "lone surrogate"),
    "surrogate_in_name": (block('{"name": "query_\\udc00", "arguments": {}}'), "lone surrogate"),
    "nul": (sku_call('"SKU-1\\u0000; DROP TABLE skus"'), "NUL character"),
    "enormous": (sku_call('"' + "x" * 100_000 + '"'), "a call may have at most 65536"),
    "list_arguments": (block('{"name": "query_inventory", "arguments": [1, 2]}'), "'arguments' must be a JSON object"),
    "null_arguments": (block('{"name": "query_inventory", "arguments": null}'), "'arguments' must be a JSON object"),
    "string_arguments_not_json": (call("query_inventory", "[unclosed"), "not valid JSON"),
    "numeric_name": (block('{"name": 5, "arguments": {}}'), "missing string field 'name'"),
    "long_name": (call("q" * 1000, {}), "at most 128 characters"),
    "not_an_object": (block("[1, 2]"), "must be a JSON object"),
    "too_many_calls": (call("query_inventory", {"sku_id": "SKU-1"}) * 40, "8 more tool calls were ignored"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_model_and_tokenizer(tiny_model)[1]


# ------------------------------------------------------------------------------------------------ parser

@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_calls_are_parse_errors_with_a_reason(parser, case):
    text, reason = HOSTILE[case]
    turn = get_parser(parser)(text)
    assert any(reason in e.reason for e in turn.errors), [e.reason for e in turn.errors]
    assert len(turn.calls) == (MAX_CALLS_PER_TURN if case == "too_many_calls" else 0)
    assert len(turn.errors) <= MAX_CALLS_PER_TURN + 2


def test_bare_json_of_function_call_parser_is_bounded_too():
    p = get_parser("function_call_parser")
    assert "nested deeper" in p('{"name": "f", "arguments": {"a": ' + deep(5000) + "}}").errors[0].reason
    long_number = '```json\n{"name": "f", "arguments": {"a": ' + "7" * 4400 + "}}\n```"
    assert "longer than 100" in p(long_number).errors[0].reason


@pytest.mark.parametrize("text", ["<tool_call>" * 20_000, "```{" * 20_000, "```json {" * 20_000,
                                  "</tool_call><tool_call>" * 10_000])
def test_parsing_is_linear_in_the_text(text):
    # The regular expressions this replaced took 80 s on the first text (a lookahead per unclosed tag).
    for parser in PARSERS:
        t = time.perf_counter()
        get_parser(parser)(text)
        assert time.perf_counter() - t < 1.0


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
NAMES = st.sampled_from(["query_inventory", "check_refund_policy", "escalate_to_human", "respond_to_user", "",
                         "no_such_tool"]) | st.text(max_size=20)
RAW_VALUES = st.one_of(
    st.integers(1, 3000).map(deep),  # nesting
    st.integers(1, 3000).map(lambda n: "{\"k\": " * n + "1" + "}" * n),
    st.integers(90, 6000).map(lambda n: "-" + "9" * n),  # huge numbers
    st.sampled_from(["NaN", "Infinity", "-Infinity", '"\\ud800"', '"\\udfff\\ud800"', '"a\\u0000"', "1e999999",
                     '"SKU-1\' OR 1=1 --"', "{}", "[]", "null", "true"]),
    JSON.map(json.dumps),
)


@st.composite
def model_text(draw):
    """What a model might write: prose, well-formed calls with random JSON, hostile raw values, cut or spliced
    text. No raw lone surrogates: token ids always decode to valid text (as JSON escapes they are here)."""
    prose = st.text(st.characters(blacklist_categories=("Cs",)), max_size=120)
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(prose)
    if kind == 1:
        return call(draw(NAMES), draw(JSON))
    if kind == 2:
        return block('{"name": ' + json.dumps(draw(NAMES)) + ', "arguments": {"sku_id": ' + draw(RAW_VALUES) + "}}")
    text = call(draw(NAMES), draw(JSON)) + draw(prose) + call("query_inventory", {"sku_id": draw(RAW_VALUES)})
    if kind == 3:  # cut anywhere
        return text[: draw(st.integers(0, len(text)))]
    at = draw(st.integers(0, len(text)))
    return text[:at] + draw(st.sampled_from(["<tool_call>", "</tool_call>", "```", "{", "}", "\\", '"'])) + text[at:]


@FUZZ
@given(text=model_text())
def test_parsers_never_raise_and_return_only_bounded_arguments(text):
    for parser in PARSERS:
        turn = get_parser(parser)(text)
        for c in turn.calls:
            assert isinstance(c.name, str) and isinstance(c.arguments, dict)
            assert argument_problem(c.arguments) is None


# ------------------------------------------------------------------------------------------- environment

def nested(n: int) -> list:
    out: list = []
    for _ in range(n):
        out = [out]
    return out


def cyclic() -> dict:
    d: dict = {"sku_id": "SKU-1"}
    d["self"] = d
    return d


@pytest.mark.parametrize("action, reason", [
    ({"name": "query_inventory", "params": {"sku_id": nested(100_000)}}, "nested deeper"),
    ({"name": "query_inventory", "params": cyclic()}, "nested deeper"),
    ({"name": "query_inventory", "params": {"sku_id": 10 ** 5000}}, "more than 100 digits"),
    ({"name": "query_inventory", "params": {"sku_id": float("nan")}}, "finite"),
    ({"name": "query_inventory", "params": {"sku_id": b"SKU-1"}}, "JSON values"),
    ({"name": "query_inventory", "params": {"sku_id": "x" * 100_000}}, "larger than 65536"),
    ({"name": "query_inventory", "params": '{"sku_id": ' + deep(5000) + "}"}, "nested deeper"),
    ({"name": "query_inventory", "params": '{"sku_id": ' + "1" * 5000 + "}"}, "longer than 100"),
    ({"name": nested(5000), "params": {}}, "must be a string"),
    ({"name": "query_inventory\x00", "params": {}}, "NUL"),
    ({"name": "q" * 10_000, "params": {}}, "at most 128"),
])
def test_the_environment_answers_hostile_actions_with_an_error_observation(action, reason):
    assert reason in parse_action(action)[2]
    env = CustomerServiceEnv(EnvironmentConfig())
    task = tasks("eval")[2]
    env.reset(task.id)
    obs, _, done, _ = env.step(action)
    assert obs["tool_error"] and reason in obs["last_tool_result"] and not done
    json.dumps(obs)  # the memory view and everything else in it is plain, bounded JSON
    obs, _, _, _ = env.step({"name": "query_inventory", "params": {"sku_id": task.data["sku_id"]}})
    assert not obs["tool_error"]  # the episode goes on
    env.close()


# -------------------------------------------------------------------------------------------- agent loop

REFUND = next(t for t in tasks("eval") if t.kind == "refund_stated")


def control_texts(task=REFUND) -> list[str]:
    d = task.data
    return [call("check_refund_policy", {"order_id": d["order_id"], "reason_code": d["reason_code"]}),
            f"Your refund of {d['expected_refund']:.2f} for {d['order_id']} is approved."]


def attack_texts(task=REFUND) -> list[str]:
    """Valid calls that would change the control episode's outcome if they reached its database."""
    d = task.data
    return [call("check_refund_policy", {"order_id": d["order_id"], "reason_code": d["reason_code"]}),
            call("escalate_to_human", {"summary": f"{d['order_id']} fraud", "priority": "high"})]


def loop_for(tokenizer, texts, *, tool_selection="per_sample", max_tokens=64):
    engine = ScriptedEngine(tokenizer, list(texts) + ["..."] * 8)
    return make_agent_loop("tool_agent", engine=engine, tokenizer=tokenizer,
                           sampling=SamplingParams(max_tokens=max_tokens),
                           limits=LoopLimits(max_user_turns=4, max_assistant_turns=len(texts) + 1,
                                             tool_selection=tool_selection, context_window=10 ** 7))


async def play(loop, task):
    env = CustomerServiceEnv(EnvironmentConfig())
    try:
        traj = await loop.run(task, env, seed=0)
        world = env.world
        return traj, (world.refunds(), world.policy_checks(), world.escalations())
    finally:
        env.close()


def outcome(traj):
    return traj.reward, traj.success, traj.termination, traj.reward_components


@pytest.fixture(scope="module")
def control(tokenizer):
    traj, db = asyncio.run(play(loop_for(tokenizer, control_texts()), REFUND))
    assert traj.success and db[0], traj.errors
    return outcome(traj), db


def play_beside_control(tokenizer, fuzz_texts):
    """One fuzz episode (every tool callable, any length) and one control episode at once, on one event loop."""
    async def both():
        return await asyncio.gather(
            play(loop_for(tokenizer, fuzz_texts, tool_selection="all", max_tokens=10 ** 6), REFUND),
            play(loop_for(tokenizer, control_texts()), REFUND))
    return asyncio.run(both())


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_text_through_the_loop_is_an_error_observation_and_touches_no_other_episode(tokenizer, control, case):
    text, reason = HOSTILE[case]
    (traj, db), (ctrl, ctrl_db) = play_beside_control(tokenizer, [text, *attack_texts()])
    assert any(reason in e for e in traj.errors), traj.errors
    seen = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert any("could not parse tool call" in s and reason in s for s in seen)
    assert db[0] and db[2], "the episode went on: its own refund and escalation happened in its own database"
    assert (outcome(ctrl), ctrl_db) == control


@FUZZ
@given(texts=st.lists(model_text(), min_size=1, max_size=3))
def test_random_model_text_never_escapes_an_episode_nor_reaches_another(tokenizer, control, texts):
    (traj, _), (ctrl, ctrl_db) = play_beside_control(tokenizer, [*texts, *attack_texts()])
    traj.check()
    assert traj.termination
    assert (outcome(ctrl), ctrl_db) == control
    fresh = CustomerServiceEnv(EnvironmentConfig())  # and the base world every episode copies is untouched
    fresh.reset(REFUND.id)
    assert (fresh.world.refunds(), fresh.world.policy_checks(), fresh.world.escalations()) == ([], [], [])
    fresh.close()


# ------------------------------------------------------------------------------ failures, counted by cause

class BrokenEnv(CustomerServiceEnv):
    """Fails on purpose: ``where`` = "astep" or "finalize", for every other episode (by construction order)."""

    made = 0

    def __init__(self, where, every=2):
        super().__init__(EnvironmentConfig())
        BrokenEnv.made += 1
        self.where, self.broken = where, BrokenEnv.made % every == 0

    async def astep(self, action):
        if self.broken and self.where == "astep":
            raise RuntimeError("sandbox lost")
        return await super().astep(action)

    def finalize(self, termination):
        if self.broken and self.where == "finalize":
            raise ValueError("judge returned garbage")
        return super().finalize(termination)


def rollouter_for(tokenizer, make_env, texts, *, turns=2):
    engine = ScriptedEngine(tokenizer, list(texts) * 50)
    loop = make_agent_loop("tool_agent", engine=engine, tokenizer=tokenizer, sampling=SamplingParams(max_tokens=64),
                           limits=LoopLimits(max_assistant_turns=turns))
    return Rollouter(loop, make_env)


def metrics_of(fn):
    rec = MetricsRecorder([])
    prev = set_recorder(rec)
    try:
        result = fn()
    finally:
        set_recorder(prev)
    return result, rec.flush(0)


@pytest.mark.parametrize("where, texts, cause", [
    ("astep", control_texts(), "env"),
    ("finalize", ["Let me see."], "verifier"),  # ends by max_assistant_turns: finalize scores it
])
def test_a_failing_environment_or_verifier_fails_that_episode_only(tokenizer, where, texts, cause):
    BrokenEnv.made = 0
    r = rollouter_for(tokenizer, lambda: BrokenEnv(where), texts, turns=1 if where == "finalize" else 2)
    group, m = metrics_of(lambda: asyncio.run(r.group(REFUND, 4, seed=1)))
    assert len(group.trajectories) == 2  # episodes 2 and 4 failed; the group goes on with 1 and 3
    assert m[f"rollout/episode_failures/{cause}"] == 2


def test_a_group_whose_every_episode_failed_is_an_error_naming_the_cause(tokenizer):
    BrokenEnv.made = 0
    r = rollouter_for(tokenizer, lambda: BrokenEnv("astep", every=1), control_texts())
    with pytest.raises(RolloutError, match="all 3 episodes of the group failed.*env: RuntimeError: sandbox lost") as e:
        asyncio.run(r.group(REFUND, 3, seed=1))
    assert e.value.cause == "env"


def test_an_engine_failure_is_counted_as_engine(tokenizer):
    r = rollouter_for(tokenizer, lambda: CustomerServiceEnv(EnvironmentConfig()), [])  # the engine has no text
    _, m = metrics_of(lambda: pytest.raises(RolloutError, asyncio.run, r.rollout(REFUND, seed=1)))
    assert m["rollout/episode_failures/engine"] == 1


def test_groups_leave_out_failed_episodes_and_evaluation_counts_them_as_not_solved(tokenizer):
    refunds = [t for t in tasks("eval") if t.kind == "refund_stated"][:2]
    BrokenEnv.made = 0
    r = rollouter_for(tokenizer, lambda: BrokenEnv("astep"), control_texts())
    groups = asyncio.run(r.groups(refunds, 1, seed=1))
    assert [g.task_id for g in groups] == [refunds[0].id]  # the second task's only episode failed
    BrokenEnv.made = 0
    metrics, trajs = asyncio.run(evaluate(r, refunds, seed=1))
    assert [t.termination for t in trajs][1] == "failed:env" and not trajs[1].success
    assert metrics["eval/success_rate"] == pytest.approx(trajs[0].success / 2)
