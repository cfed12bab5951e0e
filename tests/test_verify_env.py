"""``tether verify env``: passes on the seed's environment and fails, naming the config key, on environments the
config breaks (issue 14 item 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli import app
from tether.config import load_config
from tether.types import Task, Trajectory
from tether.verify.env import (
    Check,
    Episode,
    Probes,
    check_components,
    check_policy,
    check_range,
    reward_range,
    verify_env,
)

ENV_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "seeds" / "env_config.yaml")
runner = CliRunner()


def checks_of(*overrides: str) -> dict[str, Check]:
    cfg = load_config([ENV_CONFIG], overrides)
    return {c.name: c for c in verify_env(cfg, num_tasks=5, random_episodes=3)}


def failed(checks: dict[str, Check]) -> dict[str, Check]:
    return {name: c for name, c in checks.items() if c.status == "fail"}


def test_seed_environment_passes() -> None:
    result = runner.invoke(app, ["verify", "env", ENV_CONFIG])
    assert result.exit_code == 0, result.output
    out = result.output
    for name in ("tool observations", "reward range", "termination/success", "termination/tool_errors",
                 "verifier components", "anti_hacking/repeated_tool_calls", "anti_hacking/context_stuffing"):
        assert f"{name} " in out and f"FAIL {name}" not in out
    # weights 0.4 + 0.3 + 0.2 + 0.1 = 1; penalties 0.1 + 0.1 per step × max_turns 20 = 4
    assert "configured range [-4, 1]" in out
    assert "the expert's 10 episodes ended resolved or escalated as required, reward 1 each" in out
    assert "3 bad calls ended the episode with tool_errors (tool_error_threshold 3)" in out
    # repeat: efficiency 2/3 → 0.4 + 0.3 + 0.2 + 0.1·2/3 − 0.1 = 0.867; stuffing: response_quality 0.5 → 0.9 − 0.1
    assert "flagged 1×, penalty 0.1, reward 0.867 vs 1 clean" in out
    assert "flagged 1×, penalty 0.1, reward 0.8 vs 1 clean" in out
    # the seed's max_turns 20 fires in the env but not under its agent loop (5 turns × 2 calls): a warning, not a fail
    assert "WARN termination/max_turns" in out and "= 10 steps < environment.state.max_turns = 20" in out


def test_max_turns_fail_behaviour_scores_a_failure() -> None:
    checks = checks_of("environment.termination.max_turns_exceeded=fail", "agent_loop.max_assistant_turns=10")
    assert not failed(checks)
    assert checks["termination/max_turns"].status == "pass"
    seen = checks["termination/max_turns"].seen
    assert seen == "20 do-nothing steps ended the episode with max_turns, reward 0 (fail)"


def test_tool_error_threshold_above_max_turns_never_fires() -> None:
    result = runner.invoke(app, ["verify", "env", ENV_CONFIG, "--set",
                                 "environment.termination.tool_error_threshold=25", "--tasks", "3", "--random", "2"])
    assert result.exit_code == 1, result.output
    assert "fail    20 bad calls ended the episode with max_turns (tool_error_threshold 25)" in result.output
    assert ("FAIL termination/tool_errors: environment.termination.tool_error_threshold = 25 is above "
            "environment.state.max_turns = 20") in result.output


def test_free_hack_names_the_penalty() -> None:
    free = "environment.verifier.anti_hacking.penalty={repeated_tool_calls: 0, context_stuffing: 0.1}"
    checks = failed(checks_of(free))
    assert list(checks) == ["anti_hacking/repeated_tool_calls"]
    assert "environment.verifier.anti_hacking.penalty.repeated_tool_calls = 0" in checks[
        "anti_hacking/repeated_tool_calls"].diagnosis


def test_weights_above_one_leave_the_reward_scale() -> None:
    checks = failed(checks_of("environment.verifier.model_based=[{rubric: response_quality, weight: 0.2}, "
                              "{rubric: efficiency, weight: 0.9}]"))
    assert list(checks) == ["reward range"]
    diagnosis = checks["reward range"].diagnosis
    assert "sum to 1.8" in diagnosis and "model_based[1].weight (efficiency) = 0.9" in diagnosis


def test_hidden_tool_results_name_observation_fields() -> None:
    checks = failed(checks_of("environment.state.observation_fields=[user_intent, order_status]"))
    assert list(checks) == ["tool observations"]
    assert "environment.state.observation_fields (add last_tool_result)" in checks["tool observations"].diagnosis


def test_max_turns_below_the_solution_and_timeouts() -> None:
    checks = failed(checks_of("environment.state.max_turns=2"))
    # refund_ask_id needs 3 steps (ask, check, tell); tool_error_threshold 3 > 2 can never fire either
    assert set(checks) == {"termination/success", "termination/tool_errors"}
    assert "environment.state.max_turns = 2 cuts the episode before the expert's 3-step solution" in checks[
        "termination/success"].diagnosis
    slow = ("environment.action_space=[{name: query_inventory, params: [sku_id], timeout_ms: 50, latency_ms: "
            "{median: 200}}, {name: check_refund_policy, params: [order_id, reason_code], timeout_ms: 2000}, "
            "{name: escalate_to_human, params: [summary, priority], timeout_ms: 500}, "
            "{name: respond_to_user, params: [message], timeout_ms: 100}]")
    checks = failed(checks_of(slow))
    assert {"tool observations", "termination/success"} <= set(checks)
    assert "timeout_ms against latency_ms" in checks["termination/success"].diagnosis


def test_a_stuck_component_and_an_out_of_range_reward_are_flagged() -> None:
    cfg = load_config([ENV_CONFIG])
    task = Task(id="t", split="train", kind="synthetic")

    def ended(reward: float, **components: float) -> Episode:
        full = {"refund_amount_correct": 0.0, "policy_compliance": 0.0, "response_quality": 0.0, "efficiency": 0.0}
        return Episode("synthetic", task, actions=[{}], observations=[{}, {}], rewards=[reward], done=True,
                       info={"reward_components": {**full, **components}})

    probes = Probes(cfg, random=[ended(0.0), ended(1.0, refund_amount_correct=1, policy_compliance=1,
                                                   response_quality=1), ended(1.5, response_quality=1)])
    check = check_components(probes)
    assert check.status == "fail"
    assert "efficiency scored only [0.0]" in check.diagnosis
    assert "environment.verifier.model_based[1] (efficiency)" in check.diagnosis
    assert reward_range(cfg) == (-4.0, 1.0)
    check = check_range(probes)
    assert check.status == "fail" and "got reward 1.5, outside [-4, 1]" in check.diagnosis


def test_policy_calls_the_parser_does_not_read() -> None:
    cfg = load_config([ENV_CONFIG])
    call = '<tool_call>{"name": "query_inventory", "arguments": {"sku_id": "SKU-123"}}</tool_call>'
    unparsed = Trajectory("t", [1], messages=[{"role": "user", "content": "How many SKU-123?"},
                                              {"role": "assistant", "content": call}], reward=0.0)
    checks = {c.name: c for c in check_policy(cfg, [unparsed, unparsed])}
    assert checks["policy/reward range"].status == "pass"
    assert checks["policy/tool calls"].status == "fail"
    assert "tool_parser.name = hermes" in checks["policy/tool calls"].diagnosis
    parsed = Trajectory("t", [1], messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "query_inventory"}}]},
        {"role": "tool", "content": '{"sku_id": "SKU-123", "stock": 30}\nstate: {}'}], reward=1.0, num_tool_calls=1)
    assert all(c.status == "pass" for c in check_policy(cfg, [parsed]))


def test_policy_episodes_through_the_agent_loop(tiny_model: str) -> None:
    # the tiny model is untrained: its episodes are structured and in range, but it never calls a tool
    result = runner.invoke(app, ["verify", "env", ENV_CONFIG, "--policy", "--tasks", "2", "--random", "1", "--set",
                                 "model.preset=null", "--set", f"model.path={tiny_model}", "--set",
                                 "engine.max_tokens=8", "--set", "agent_loop.max_assistant_turns=2"])
    assert result.exit_code == 1, result.output
    out = result.output
    assert "policy/reward range               pass    8 policy episodes" in out
    assert "FAIL policy/tool calls: the policy made no tool call in any episode" in out


@pytest.mark.parametrize("args", [["missing.yaml"], [ENV_CONFIG, "--set", "environment.name=nowhere"]])
def test_bad_input_exits_2(args: list[str]) -> None:
    result = runner.invoke(app, ["verify", "env", *args])
    assert result.exit_code == 2, result.output
