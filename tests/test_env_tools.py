"""Generic environment pieces: tools (schema, validation, timeout, latency), memory, termination,
anti-hacking detectors and the verifier's arithmetic."""

import asyncio
import json
import random
import time

import pytest

from tether.env.anti_hacking import HackingDetector, is_stuffed, numbers, penalty_of, unique_token_ratio
from tether.env.memory import KeepRecentK, TurnRecord
from tether.env.termination import TerminationRule
from tether.env.tools import Latency, Param, Tool, ToolBox, ToolError, parse_action, run_tool
from tether.env.verifier import DeterministicJudge, HybridVerifier, Transcript
from tether.types import Task


def _echo(text: str, mode: str) -> dict:
    if text == "boom":
        raise ZeroDivisionError("division by zero")
    if text == "bad":
        raise ToolError("bad text")
    return {"text": text, "mode": mode}


ECHO = Tool("echo", "Echo text.", (Param("text", "Some text."), Param("mode", "How.", ("loud", "quiet"))), _echo, 1000)


def run(coro):
    return asyncio.run(coro)


def test_schema_is_openai_function_format():
    s = ECHO.schema()
    assert s["type"] == "function"
    fn = s["function"]
    assert fn["name"] == "echo" and fn["description"] == "Echo text."
    assert fn["parameters"]["required"] == ["text", "mode"]
    assert fn["parameters"]["additionalProperties"] is False
    mode = {"type": "string", "description": "How.", "enum": ["loud", "quiet"]}
    assert fn["parameters"]["properties"]["mode"] == mode


@pytest.mark.parametrize("params, message", [
    ({"text": "a"}, "echo takes (text, mode): missing mode"),
    ({"text": "a", "mode": "loud", "x": 1}, "echo takes (text, mode): unexpected x"),
    ({"text": 3, "mode": "loud"}, "echo: text must be a string, got int"),
    ({"text": "a", "mode": "shout"}, "echo: mode must be one of loud, quiet"),
    (["a"], "arguments of echo must be a JSON object, got list"),
    ({"text": "boom", "mode": "loud"}, "tool echo failed: ZeroDivisionError: division by zero"),
    ({"text": "bad", "mode": "loud"}, "bad text"),
])
def test_every_failure_is_an_error_result(params, message):
    r = run(run_tool(ECHO, params))
    assert r.error is True
    assert json.loads(r.text) == {"error": message}


def test_ok_result_is_short_json():
    r = run(run_tool(ECHO, {"text": "hi", "mode": "LOUD"}))  # enum check is case-insensitive
    assert (r.error, r.text, r.value) == (False, '{"text": "hi", "mode": "LOUD"}', {"text": "hi", "mode": "LOUD"})


def test_unknown_tool_and_selection():
    box = ToolBox([ECHO])
    r = run(box.call("nope", {}))
    assert r.error and json.loads(r.text)["error"] == "unknown tool 'nope'; available: echo"
    assert ToolBox([ECHO], allowed=()).names == []
    with pytest.raises(ValueError, match="does not have"):
        ToolBox([ECHO], allowed=("missing",))


def test_timeout_is_enforced_on_simulated_latency():
    calls = []
    slow = Tool("slow", "Slow.", (), lambda: calls.append(1) or "done", timeout_ms=30, latency=Latency(200.0))
    t = time.perf_counter()
    r = run(run_tool(slow, {}))
    assert time.perf_counter() - t < 0.15  # answered at the timeout, not after the latency
    assert r.error and json.loads(r.text) == {"error": "tool slow timed out after 30 ms"}
    assert calls == []  # a call that timed out never ran: no side effect


def test_timeout_is_enforced_on_an_async_tool():
    async def hang() -> str:
        await asyncio.sleep(5)
        return "never"

    r = run(run_tool(Tool("hang", "Hangs.", (), hang, timeout_ms=20), {}))
    assert r.error and "timed out after 20 ms" in r.text


def test_latency_is_lognormal_capped_and_seeded():
    lat = Latency(median=100.0, sigma=1.0, max=250.0)
    a = [lat.sample(random.Random(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]  # same seed, same draw
    draws = [lat.sample(random.Random(i)) for i in range(400)]
    assert max(draws) == 250.0  # capped
    assert 80 < sorted(draws)[200] < 125  # median ≈ 100
    assert Latency(100.0).sample(random.Random(0)) == 100.0  # sigma 0: the median


def test_parse_action_accepts_arguments_and_json_strings():
    assert parse_action({"name": "a", "arguments": '{"x": "1"}'}) == ("a", {"x": "1"}, None)
    assert parse_action({"name": "a"}) == ("a", {}, None)
    assert parse_action("a")[2] is not None
    assert "not valid JSON" in parse_action({"name": "a", "params": "{x"})[2]


def test_memory_keeps_recent_k_and_summarises_the_rest():
    mem = KeepRecentK(k=2, summary_enabled=True)
    for i, tool in enumerate(["query_inventory", "query_inventory", "respond_to_user", "check_refund_policy"], 1):
        mem.add(TurnRecord(i, tool, {}, f"r{i}", user="ok" if tool == "respond_to_user" else None))
    view = mem.view()
    assert [r["turn"] for r in view["recent"]] == [3, 4]
    assert view["recent"][0] == {"turn": 3, "tool": "respond_to_user", "args": {}, "result": "r3", "user": "ok"}
    assert view["summary"] == "turns 1-2: query_inventory x2 (last: r2)"
    mem.summary_enabled = False
    assert mem.view()["summary"] is None


def test_termination_order_and_modes():
    rule = TerminationRule(max_turns=3, tool_error_threshold=2, terminal_tools=frozenset({"esc"}))
    assert rule.check(resolved=False, terminal_call=False, tool_errors=1, turns=2) is None
    assert rule.check(resolved=True, terminal_call=True, tool_errors=5, turns=9).reason == "user_issue_resolved"
    assert rule.check(resolved=False, terminal_call=True, tool_errors=5, turns=9).reason == "escalated"
    assert rule.check(resolved=False, terminal_call=False, tool_errors=2, turns=9).reason == "tool_errors"
    end = rule.check(resolved=False, terminal_call=False, tool_errors=0, turns=3)
    assert (end.reason, end.truncated) == ("max_turns", True)
    fail = TerminationRule(max_turns=3, max_turns_exceeded="fail")
    assert fail.check(resolved=False, terminal_call=False, tool_errors=0, turns=3).truncated is False
    assert TerminationRule.external("max_assistant_turns").truncated is True
    assert TerminationRule.external("no_action").truncated is False


def test_stuffing_detectors():
    assert numbers("Refund $1,200.50 for O-1042 and SKU-123, x2, 3 items.") == [1200.5, 3.0]
    assert unique_token_ratio("a a a b") == 0.5
    assert not is_stuffed("Your refund of 45.00 for O-1042 is approved.")
    assert is_stuffed("Your refund is 10, 20, 30 or 40.")  # 4 candidate numbers > 3
    assert is_stuffed("refund approved " * 30)  # 480 chars, unique ratio 2/60
    assert not is_stuffed(" ".join(f"word{i}" for i in range(50)))  # 339 chars but dense: ratio 1.0


def test_detector_window_flags_and_disable():
    det = HackingDetector(repeat_window=2)
    seq = [("q", {"a": "1"}), ("q", {"a": "2"}), ("q", {"a": "1"}), ("x", {}), ("y", {}), ("q", {"a": "1"})]
    found = [det.observe(n, p) for n, p in seq]
    # call 3 repeats call 1, which is within the last 2 calls; call 6 repeats call 3, 3 calls back: not flagged
    assert found == [[], [], ["repeated_tool_calls"], [], [], []]
    assert det.flags == {"repeated_tool_calls": 1}
    off = HackingDetector(enabled=False)
    assert [off.observe("q", {}) for _ in range(3)] == [[], [], []]
    only = HackingDetector(patterns=["context_stuffing"])
    assert [only.observe("q", {}) for _ in range(2)] == [[], []]
    assert penalty_of({"repeated_tool_calls": 3, "context_stuffing": 1},
                      {"repeated_tool_calls": 0.1, "context_stuffing": 0.25}) == pytest.approx(0.55)


def _verifier(type="hybrid", gate=True, rule_value=1.0, rubric_value=0.5):
    return HybridVerifier(
        rules=[("r1", 0.4), ("r2", 0.3)], rubrics=[("q", 0.2), ("e", 0.1)],
        rule_fns={"r1": lambda w, tr, t: rule_value, "r2": lambda w, tr, t: 1.0},
        judge=DeterministicJudge({"q": lambda tr, t: rubric_value, "e": lambda tr, t: 1.0}),
        gate=lambda tr, t: gate, gated=("r1", "r2", "e"), penalty={"repeated_tool_calls": 0.1}, type=type)


def test_verifier_arithmetic_gate_and_types():
    task, tr = Task("t", "train", "k"), Transcript([], "user_issue_resolved")
    v = _verifier().verify(None, tr, task, {"repeated_tool_calls": 2})
    # 0.4·1 + 0.3·1 + 0.2·0.5 + 0.1·1 − 2·0.1 = 0.7
    assert v.reward == pytest.approx(0.7) and v.success and v.hacking_penalty == pytest.approx(0.2)
    assert v.components == {"r1": 1.0, "r2": 1.0, "q": 0.5, "e": 1.0}
    closed = _verifier(gate=False).verify(None, tr, task)
    # gate closed: r1, r2, e score 0; q still judged: 0.2·0.5 = 0.1
    assert closed.components == {"r1": 0.0, "r2": 0.0, "q": 0.5, "e": 0.0}
    assert closed.reward == pytest.approx(0.1) and not closed.success
    assert _verifier(type="rule").verify(None, tr, task).components == {"r1": 1.0, "r2": 1.0}  # 0.7
    assert _verifier(type="model").verify(None, tr, task).reward == pytest.approx(0.2)  # 0.2·0.5 + 0.1·1
    assert not _verifier(rule_value=0.0).verify(None, tr, task).success
    with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
        _verifier(rubric_value=1.5).verify(None, tr, task)
    with pytest.raises(ValueError, match="unknown checks"):
        HybridVerifier(rules=[("nope", 1.0)], rubrics=[], rule_fns={}, judge=DeterministicJudge({}))
