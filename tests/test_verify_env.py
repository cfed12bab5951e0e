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
    assert reward_range(cfg.environment) == (-4.0, 1.0)
    check = check_range(probes)
    assert check.status == "fail" and "got reward 1.5, outside [-4, 1]" in check.diagnosis


def test_policy_calls_the_parser_does_not_read() -> None:
    cfg = load_config([ENV_CONFIG])
    call = '<tool_call>{"name": "query_inventory", "arguments": {"sku_id": "SKU-123"}}</tool_call>'
    unparsed = Trajectory("t", [1], messages=[{"role": "user", "content": "How many SKU-123?"},
                                              {"role": "assistant", "content": call}], reward=0.0)
    checks = {c.name: c for c in check_policy(cfg.environment, cfg.tool_parser.name, [unparsed, unparsed])}
    assert checks["policy/reward range"].status == "pass"
    assert checks["policy/tool calls"].status == "fail"
    assert "tool_parser.name = hermes" in checks["policy/tool calls"].diagnosis
    parsed = Trajectory("t", [1], messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "query_inventory"}}]},
        {"role": "tool", "content": '{"sku_id": "SKU-123", "stock": 30}\nstate: {}'}], reward=1.0, num_tool_calls=1)
    assert all(c.status == "pass" for c in check_policy(cfg.environment, cfg.tool_parser.name, [parsed]))


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


# ------------------------------------------------------------------------------------- environments of one's own
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_env"


def test_custom_env_example_through_the_real_cli() -> None:
    """examples/custom_env with its own expert, through the installed ``tether`` command run beside the config."""
    import os
    import subprocess
    import sys

    tether = Path(sys.executable).with_name("tether")
    result = subprocess.run([str(tether), "verify", "env", "config.yaml"], cwd=EXAMPLE, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "2 tools: calculate, respond_to_user, all well-formed" in out
    assert "every tool and parameter name shown" in out
    assert "2 calls (one per tool) written as hermes reads them, each parsed back" in out
    # 2 valid calls (the expert's) + per tool: missing, mistyped, unexpected; + 3 malformed actions = 11 probes
    assert "tool observations                 pass    11 tool probes" in out
    assert "calculate" in out.split("timeouts")[1].split("\n")[0] and "/1000 ms" in out
    # weights 0.6 + 0.2 + 0.2 = 1; penalties 0.1 + 0.1 per step × max_turns 20 = 4
    assert "configured range [-4, 1]" in out
    assert "10 episodes that do nothing and stop (no_action): rewards in [0, 0], each scored" in out
    assert "none of 10 do-nothing episodes passed" in out
    assert "the expert's 10 episodes succeeded, reward 1 each" in out
    # repeat: 3 turns, brief 2/3 → 0.6 + 0.2 + 0.2·2/3 − 0.1 = 0.833; stuffing: 2 turns → 1 − 0.1 = 0.9
    assert "flagged 1×, penalty 0.1, reward 0.833 vs 1 clean" in out
    assert "flagged 1×, penalty 0.1, reward 0.9 vs 1 clean" in out


def bump(state: dict) -> int:
    """Add one to the counter."""
    state["n"] += 1
    return state["n"]


def respond_to_user(state: dict, message: str) -> str:
    """Send a message to the user; returns their reply.

    Args:
        message: The message.
    """
    return "ok"


def _hole_tasks(split: str, cfg: object) -> list[Task]:
    return [Task(id=f"{split}_{i}", split=split, kind="bump", data={"prompt": "Bump it."}) for i in range(3)]


HOLE_CONFIG = """
environment:
  name: hole
  action_space:
    - {name: bump, params: [], timeout_ms: 1000}
    - {name: respond_to_user, params: [message], timeout_ms: 100}
  state: {observation_fields: [last_tool_result]}
  verifier: {type: rule, rule_based: [{check: bumped, weight: 1.0}], model_based: []}
"""


@pytest.fixture
def hole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A plugin environment whose check passes whatever happened (a do-nothing episode passes), no expert."""
    from tether.env.plugin import ToolEnvironment, registry

    env = ToolEnvironment(tools=[bump, respond_to_user], tasks=_hole_tasks, system_prompt="Bump the counter.",
                          new_state=lambda task: {"n": 0}, rules={"bumped": lambda state, transcript, task: 1.0},
                          resolved=lambda state: state["n"] > 0)
    monkeypatch.setitem(registry.ENVIRONMENTS, "hole", env)
    path = tmp_path / "hole.yaml"
    path.write_text(HOLE_CONFIG)
    return path


def test_a_plugin_env_without_an_expert_skips_its_probes_and_its_no_op_hole_fails(hole: Path) -> None:
    result = runner.invoke(app, ["verify", "env", str(hole), "--tasks", "3", "--random", "2"])
    assert result.exit_code == 1, result.output
    out = result.output
    for name in ("termination/success", "anti_hacking/repeated_tool_calls", "anti_hacking/context_stuffing"):
        assert f"{name} " in out and "environment 'hole' offers no expert (its ToolEnvironment's expert is None" in \
            out.split(f"{name} ")[1].split("\n")[0]
    # no expert: each tool's one valid-looking call has schema-built arguments, judged for its form only
    assert "9 tool probes, 39 observations (2 calls judged for form only)" in out
    assert "no-op pass                        fail    3/3 do-nothing episodes passed (train_0, train_1, train_2), " \
           "0 flagged no_op_pass" in out
    assert "FAIL no-op pass: doing nothing passes task train_0 unflagged" in out
    # the check stuck at 1 is a warning here, not a failure: no expert ran to earn it
    assert "WARN verifier components: bumped scored only [1.0]" in out
    assert "FAIL" not in out.replace("FAIL no-op pass", "")


@pytest.mark.parametrize(("penalty", "status", "seen"), [
    (0.0, "warn", "3/3 do-nothing episodes passed (train_0, train_1, train_2), 3 flagged no_op_pass, penalty 0"),
    (0.5, "pass", "3/3 do-nothing episodes passed (train_0, train_1, train_2), 3 flagged no_op_pass, each costs 0.5"),
])
def test_the_no_op_hole_flagged_is_a_warning_until_it_costs(hole: Path, penalty: float, status: str,
                                                            seen: str) -> None:
    cfg = load_config([hole], ["environment.verifier.anti_hacking.detect_patterns=[no_op_pass]",
                               f"environment.verifier.anti_hacking.penalty={{no_op_pass: {penalty}}}"])
    checks = {c.name: c for c in verify_env(cfg, num_tasks=3, random_episodes=0)}
    assert (checks["no-op pass"].status, checks["no-op pass"].seen) == (status, seen)
    # the flagged do-nothing episode costs the penalty: reward 1 − 0.5
    assert checks["do nothing"].seen.endswith(f"rewards in [{1 - penalty:g}, {1 - penalty:g}], each scored")


def test_a_malformed_schema_and_a_template_without_tools_are_named(tiny_model: str, tmp_path: Path) -> None:
    import shutil

    from tether.verify.env_generic import check_rendered, schema_problem

    ok = {"type": "function", "function": {"name": "lookup_widget", "parameters": {
        "type": "object", "properties": {"widget_code": {"type": "string"}}, "required": ["widget_code"]}}}
    assert schema_problem(ok) is None
    assert schema_problem({**ok, "function": {**ok["function"], "parameters": {
        "type": "object", "properties": {"widget_code": {"type": "string"}}, "required": ["colour"]}}}) == \
        "lookup_widget: required ['colour'] are not among its properties ['widget_code']"
    assert schema_problem({**ok, "function": {**ok["function"], "parameters": {
        "type": "object", "properties": {"widget_code": {"description": "x"}}}}}) == \
        "lookup_widget: parameters ['widget_code'] have no type (a type hint on the function's argument)"
    # a chat template that ignores the tools: the model would never see them
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n")
    good = check_rendered(Probes(load_config([ENV_CONFIG], ["model.preset=null", f"model.path={tiny_model}"]),
                                 schemas=[ok], system_prompt="S"))
    assert good.status == "pass" and "every tool and parameter name shown" in good.seen
    bad = check_rendered(Probes(load_config([ENV_CONFIG], ["model.preset=null", f"model.path={model}"]),
                                schemas=[ok], system_prompt="S"))
    assert bad.status == "fail" and "the prompt does not show ['lookup_widget', 'lookup_widget.widget_code']" in \
        bad.diagnosis


def test_tau2_mock_runs_the_generic_probes_and_reports_its_no_op_hole(tmp_path: Path) -> None:
    pytest.importorskip("tau2")
    path = tmp_path / "tau2.yaml"
    path.write_text('environment: {name: "tau2:mock"}\n')
    result = runner.invoke(app, ["verify", "env", str(path), "--tasks", "5", "--random", "1"])
    out = result.output
    assert result.exit_code == 0, out
    assert "5 tools: create_task, get_users, update_task_status, transfer_to_human_agents, done" in out
    assert "all structured, Tau2Env's own result text" in out
    assert "10 bad calls ended the episode with too_many_errors (tool_error_threshold 10)" in out  # tau2's own
    assert "anti_hacking/gold replays         pass    0/9 gold episodes flagged (repeated_tool_calls 0/9, " \
           "context_stuffing 0/9), 0 cut by the limits" in out
    # tau2's database check passes doing nothing where the gold actions write nothing: flagged, free by default
    assert "no-op pass                        warn    1/5 do-nothing episodes passed (create_task_1_nl_eval), " \
           "1 flagged no_op_pass, penalty 0" in out
    assert "termination/success               skip    no expert to solve a task: tau2's gold actions are no solo " \
           "expert" in out


def test_tau2_gold_replays_row_names_the_keys_that_flag_or_cut_gold() -> None:
    """The gold row fails where the detectors flag tau2's gold (retail under the old repeat_window 4: 21, 31, 32
    re-read a record 3-4 calls later with nothing written between) and warns where the limits cut it (mock's gold
    trajectories longer than max_turns 1)."""
    pytest.importorskip("tau2")
    from tether.verify.env_gold import check_gold_replays

    assert check_gold_replays(load_config([ENV_CONFIG])) is None  # not a tau2 environment: no row
    wide = check_gold_replays(load_config([], ["environment.name=tau2:retail",
                                               "environment.verifier.anti_hacking.repeat_window=4"]))
    assert wide is not None and wide.status == "fail"
    assert wide.seen == ("3/114 gold episodes flagged (repeated_tool_calls 3/114, context_stuffing 0/114), "
                         "0 cut by the limits")
    assert "task 21: {'repeated_tool_calls': 1}" in wide.diagnosis and "repeat_window = 4" in wide.diagnosis
    short = check_gold_replays(load_config([], ["environment.name=tau2:mock", "environment.state.max_turns=1"]))
    assert short is not None and short.status == "warn" and "environment.state.max_turns = 1" in short.diagnosis
