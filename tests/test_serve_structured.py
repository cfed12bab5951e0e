"""`tether serve` with constrained decoding (tether.serve.structured), driven by the official `openai` package.

The server wraps a LocalEngine over the tests' untrained tiny model, which left alone almost never writes a valid
tool call or JSON: what it returns under tool_choice / response_format is the grammar's doing.
"""

from __future__ import annotations

import copy
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tether.engine.local import LocalEngine
from tether.learner.model import load_model_and_tokenizer
from tether.serve import ServerThread, make_app

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

ORDER = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^O-[0-9]{4}$"},
                                          "urgent": {"type": "boolean"}}, "required": ["order_id", "urgent"]}
REFUND = {"type": "object", "properties": {"reason": {"type": "string", "enum": ["late", "damaged", "wrong item"]},
                                           "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["reason", "quantity"]}
TOOLS = [{"type": "function", "function": {"name": "get_order_status", "description": "Look up an order.",
                                           "parameters": ORDER}},
         {"type": "function", "function": {"name": "refund", "description": "Refund an order.", "parameters": REFUND}}]
SCHEMAS = {"get_order_status": ORDER, "refund": REFUND}
ASK = [{"role": "system", "content": "You are a support agent."},
       {"role": "user", "content": "Where is my order O-1234?"}]


@pytest.fixture(scope="module")
def server(tiny_model):
    model, tokenizer = load_model_and_tokenizer(tiny_model)
    with LocalEngine(copy.deepcopy(model)) as engine, ServerThread(make_app(engine, tokenizer,
                                                                            model_name="tiny")) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def valid_calls(message) -> list[tuple[str, dict]]:
    """The message's tool calls whose name is a tool's and whose arguments its schema accepts."""
    out = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        if call.function.name in SCHEMAS and jsonschema.Draft202012Validator(SCHEMAS[call.function.name]).is_valid(
                args):
            out.append((call.function.name, args))
    return out


def many(server, n: int, **kw) -> list:
    c = client(server)
    with ThreadPoolExecutor(16) as pool:  # concurrent: the engine batches them
        return list(pool.map(lambda i: c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, seed=i,
                                                                 max_tokens=160, **kw).choices[0], range(n)))


def test_tool_choice_required_returns_a_schema_valid_call_for_100_seeded_requests(server):
    required = many(server, 100, tool_choice="required", parallel_tool_calls=False)
    assert [len(valid_calls(ch.message)) for ch in required] == [1] * 100  # 0 invalid
    assert all(ch.finish_reason == "tool_calls" and not ch.message.content for ch in required)
    assert {name for ch in required for name, _ in valid_calls(ch.message)} == {"get_order_status", "refund"}
    free = many(server, 100)  # tool_choice auto: the untrained model left alone
    assert sum(len(valid_calls(ch.message)) for ch in free) <= 2  # measured 0 of 100


def test_a_named_function_is_the_only_tool_called(server):
    named = many(server, 30, tool_choice={"type": "function", "function": {"name": "get_order_status"}},
                 parallel_tool_calls=False)
    for ch in named:
        ((name, args),) = valid_calls(ch.message)
        assert name == "get_order_status" and len(args["order_id"]) == 6
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                               tool_choice={"type": "function", "function": {"name": "cancel"}})
    assert err.value.body["param"] == "tool_choice" and "'cancel'" in err.value.body["message"]


def test_parallel_calls_are_one_or_more_valid_calls(server):
    # parallel_tool_calls (OpenAI's default): after a call the grammar allows another or the end; a run of calls can
    # reach max_tokens (finish_reason length, the last call cut) as any text can
    choices = many(server, 20, tool_choice="required")
    done = [ch for ch in choices if ch.finish_reason == "tool_calls"]
    assert len(done) >= 10 and all(len(valid_calls(ch.message)) == len(ch.message.tool_calls) >= 1 for ch in done)


class Status(BaseModel):
    status: Literal["shipped", "pending"]
    quantity: int = Field(ge=1, le=9)
    note: str = Field(max_length=12)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(server):
    c = client(server)
    for seed in range(10):
        r = c.chat.completions.parse(model="tiny", messages=ASK, response_format=Status, seed=seed, max_tokens=80)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Status) and 1 <= parsed.quantity <= 9 and len(parsed.note) <= 12


def test_json_object_returns_a_json_object(server):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"}, seed=0,
                                  temperature=1.0, max_tokens=300, n=8)
    done = [ch for ch in r.choices if ch.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(ch.message.content), dict) for ch in done)  # 4 of 8 measured
    # strings are not bounded by json_object: the untrained model may run one on to max_tokens; what it wrote is then
    # a prefix of a JSON object
    assert all(ch.message.content.startswith("{") for ch in r.choices)


def test_streaming_a_constrained_request_ends_in_a_valid_call(server):
    chunks = list(client(server).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=3,
        max_tokens=160, stream=True))
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in (tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []):
        if delta.function.name:  # the first delta of a call names it; its arguments may come in pieces
            names[delta.index] = delta.function.name
        arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert list(names) == [0] and names[0] in SCHEMAS
    assert jsonschema.Draft202012Validator(SCHEMAS[names[0]]).is_valid(json.loads(arguments[0]))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    schema = {"type": "json_schema", "json_schema": {"name": "status", "schema": Status.model_json_schema(),
                                                     "strict": True}}
    chunks = list(client(server).chat.completions.create(model="tiny", messages=ASK, response_format=schema, seed=3,
                                                         max_tokens=80, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert isinstance(Status.model_validate_json(text), Status) and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "strin"}}}, "strict": True}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "yaml"}])
def test_a_bad_response_format_is_a_400_naming_it(server, response_format):
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model="tiny", messages=ASK, response_format=response_format)
    assert err.value.body["param"] == "response_format"


def test_a_tool_schema_the_grammar_cannot_compile_is_a_400_naming_the_tool(server):
    bad = [TOOLS[0], {"type": "function", "function": {"name": "refund", "parameters": {
        "type": "object", "properties": {"reason": {"type": "strin"}}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model="tiny", messages=ASK, tools=bad, tool_choice="required")
    assert err.value.body["param"] == "tools.1.function.parameters" and "strin" in err.value.body["message"]


def test_response_format_with_a_forced_tool_call_is_refused(server):
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                               response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"


def test_strict_tools_under_auto_constrain_the_calls_the_model_opens(server, tiny_model):
    open_id = load_model_and_tokenizer(tiny_model)[1].convert_tokens_to_ids("<tool_call>")
    c = client(server)

    def calls(tools: list) -> list:  # a logit bias on "<tool_call>" makes the model open calls: 40 seeded requests
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda i: c.chat.completions.create(
                model="tiny", messages=ASK, tools=tools, seed=i, max_tokens=160, parallel_tool_calls=False,
                logit_bias={str(open_id): 6.0}).choices[0], range(40)))

    strict = calls([{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS])
    loose = calls(TOOLS)
    opened = [ch for ch in strict if ch.message.tool_calls or "<tool_call>" in (ch.message.content or "")]
    assert len(opened) >= 30
    # every call the model opened under strict tools is a valid call of one of them, and ends the turn
    assert all(ch.finish_reason == "tool_calls" and len(valid_calls(ch.message)) == 1 for ch in opened)
    assert sum(len(valid_calls(ch.message)) for ch in loose) <= 2  # the same requests without strict: measured 0
    assert sum("<tool_call>" in (ch.message.content or "") for ch in loose) >= 30  # opened, malformed


def test_without_xgrammar_a_constrained_request_is_a_400_naming_the_extra(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required")
    assert err.value.body["param"] == "tool_choice" and "tether[grammar]" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format"
    assert c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4).choices  # the rest works


def test_langchain_structured_output_and_forced_tool_calls(server):
    """LangChain's ChatOpenAI as users call it: with_structured_output (response_format json_schema) and bind_tools
    with tool_choice "any" (OpenAI's "required") and a named tool."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model="tiny", max_retries=0,
                                      max_tokens=160, temperature=1.0, seed=3)
    for seed in range(3):
        parsed = llm.bind(seed=seed).with_structured_output(Status).invoke("Where is my order O-1234?")
        assert isinstance(parsed, Status) and 1 <= parsed.quantity <= 9
    for choice, names in [("any", set(SCHEMAS)), ("refund", {"refund"})]:
        for seed in range(3):
            message = llm.bind(seed=seed).bind_tools(TOOLS, tool_choice=choice).invoke(ASK)
            assert message.tool_calls, message
            for call in message.tool_calls:
                assert call["name"] in names
                assert jsonschema.Draft202012Validator(SCHEMAS[call["name"]]).is_valid(call["args"]), call
