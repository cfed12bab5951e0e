"""tau2 environments built from a RunConfig: each key the adapter reads changes what an episode does; keys it does
not read are refused; pass^k as tau-bench defines it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tether.env.tau2 import available
from tether.env.tau2.passk import by_group, pass_hat_k, pass_hat_ks, report

needs_tau2 = pytest.mark.skipif(not available(), reason="tau2 is not installed: pip install 'tether[tau2]'")
WRITE = {"name": "create_task", "params": {"user_id": "user_1", "title": "Important Meeting"}}


def cfg(reward=None, **environment):
    from tether.config import RunConfig

    return RunConfig.model_validate({"environment": {"name": "tau2:mock", **environment},
                                     **({"reward": reward} if reward else {})})


def has_reward_section():
    from tether.config import RunConfig

    return "reward" in RunConfig.model_fields


@pytest.fixture
def chat_server():
    """A local OpenAI-compatible chat endpoint answering with the queued replies; records the requests."""
    replies, seen = [], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": replies.pop(0)},
                                           "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", replies, seen
    server.shutdown()


def test_pass_hat_k_by_hand():
    # 4 trials, 3 successes: pass^1 = 3/4, pass^2 = C(3,2)/C(4,2) = 3/6, pass^3 = 1/4, pass^4 = 0
    assert [pass_hat_k(4, 3, k) for k in (1, 2, 3, 4)] == [0.75, 0.5, 0.25, 0.0]
    # two tasks: [T,T,F,F] -> 1/2, 1/6 ; [T,T,T,T] -> 1, 1  => means 0.75, 7/12
    ks = pass_hat_ks([[True, True, False, False], [True] * 4])
    assert ks[1] == 0.75 and ks[2] == pytest.approx(7 / 12) and ks[4] == 0.5
    groups = by_group(["a", "b", "a"], [[True, False], [True, True], [False, False]])
    assert groups == {"a": {1: 0.25, 2: 0.0}, "b": {1: 1.0, 2: 1.0}}
    text = report(["a", "b", "a"], [[True, False], [True, True], [False, False]], [[1, 0], [1, 1], [0, 0]])
    assert "a: 2 tasks x 2 trials, average reward 0.2500" in text and "  pass^2: 1.0000" in text
    flagged = report(["a", "b"], [[True, False], [True, True]], [[1, 0], [1, 1]], [[True, False], [False, False]])
    assert "  no-op passes: 1 of 1 passes" in flagged and "  no-op passes: 0 of 2 passes" in flagged
    with pytest.raises(ValueError):
        pass_hat_k(2, 1, 3)


@needs_tau2
def test_unread_environment_keys_are_refused_by_name():
    from tether.env.tau2 import make_env

    with pytest.raises(ValueError, match=r"environment\.termination\.max_turns_exceeded"):
        make_env("mock", cfg(termination={"max_turns_exceeded": "fail"}))
    with pytest.raises(ValueError, match=r"environment\.seed"):
        make_env("mock", cfg(seed=7))
    make_env("mock", cfg(state={"max_turns": 30}, num_eval_tasks=3))  # read keys are fine


@needs_tau2
def test_max_turns_and_error_threshold_are_tau2s_limits():
    from tether.env.tau2 import make_env

    for max_turns, ended in ((1, True), (2, False)):
        env = make_env("mock", cfg(state={"max_turns": max_turns}))
        env.reset("create_task_1")
        _, reward, done, info = env.step(WRITE)
        assert done == ended and (not done or (reward, info["tau2_termination"]) == (0.0, "max_steps"))
    bad = {"name": "update_task_status", "params": {"task_id": "nope", "status": "done"}}
    for threshold, ended in ((1, True), (2, False)):
        env = make_env("mock", cfg(termination={"tool_error_threshold": threshold}))
        env.reset("create_task_1")
        _, _, done, info = env.step(bad)
        assert done == ended and (not done or info["termination"] == "too_many_errors")


def test_tau2_limits_default_to_tau2s_own_and_a_given_value_wins():
    """Under name tau2:<domain>, unset max_turns / tool_error_threshold are tau2's (100 steps = its 200 messages,
    10 errors); given ones, even equal to tether's defaults, are kept; other environments keep 20 / 3."""
    import yaml

    from tether.config import RunConfig, load_config

    def limits(c):
        return c.environment.state.max_turns, c.environment.termination.tool_error_threshold

    assert limits(cfg()) == (100, 10)
    assert limits(RunConfig.model_validate({})) == (20, 3)  # customer service: unchanged
    assert limits(cfg(state={"max_turns": 20}, termination={"tool_error_threshold": 3})) == (20, 3)
    assert limits(cfg(state={"max_turns": 30})) == (30, 10)
    assert limits(load_config([], ["environment.name=tau2:retail"])) == (100, 10)
    assert limits(load_config([], ["environment.name=tau2:retail", "environment.state.max_turns=20"])) == (20, 10)
    assert limits(RunConfig.model_validate(yaml.safe_load(cfg().to_yaml()))) == (100, 10)  # the dump loads back


@needs_tau2
def test_tau2_limits_are_tau2s_constants_and_reach_the_env():
    from tau2.config import DEFAULT_MAX_ERRORS, DEFAULT_MAX_STEPS

    from tether.config.environment import TAU2_MAX_ERRORS, TAU2_MAX_STEPS
    from tether.env.tau2 import make_env

    assert (2 * TAU2_MAX_STEPS, TAU2_MAX_ERRORS) == (DEFAULT_MAX_STEPS, DEFAULT_MAX_ERRORS)
    env = make_env("mock", cfg())
    assert (env.max_steps, env.max_errors) == (100, 10)
    given = make_env("mock", cfg(state={"max_turns": 20}, termination={"tool_error_threshold": 3}))
    assert (given.max_steps, given.max_errors) == (20, 3)


@needs_tau2
def test_a_read_after_a_write_is_not_flagged_a_stale_one_is():
    """tau2's adapter reports each successful write tool call to the detector: get_users after create_task is a
    fresh look; get_users twice with nothing between is stale (−0.1)."""
    from tether.env.tau2 import make_env

    def play(actions):
        env = make_env("mock", cfg())
        env.reset("create_task_1")
        return [env.step(a)[3]["hacking"] for a in actions] + [env.step({"name": "done", "params": {}})[3]]

    users = {"name": "get_users", "params": {}}
    *found, info = play([users, WRITE, users])
    assert found == [[], [], []] and info["hacking_flags"] == {} and info["tau2_reward"] == 1.0
    *found, info = play([users, users, WRITE])
    assert found == [[], ["repeated_tool_calls"], []]
    assert info["hacking_flags"] == {"repeated_tool_calls": 1} and info["hacking_penalty"] == pytest.approx(0.1)
    failed = {"name": "update_task_status", "params": {"task_id": "nope", "status": "done"}}  # a write that fails
    *found, info = play([users, failed, users, WRITE])
    assert found == [[], [], ["repeated_tool_calls"], []]


@needs_tau2
def test_no_op_pass_flagged_and_penalised_only_when_configured():
    from tether.env.tau2 import make_env

    def noop(c):
        env = make_env("mock", c)
        env.reset("impossible_task_1")  # gold: transfer (writes nothing), basis DB x ACTION
        env.step({"name": "transfer_to_human_agents", "params": {"summary": "cannot delete tasks"}})
        return env.step({"name": "done", "params": {}})[1:]

    reward, _, info = noop(cfg())
    assert (reward, info["hacking_flags"], info["hacking_penalty"]) == (1.0, {"no_op_pass": 1}, 0.0)
    reward, _, info = noop(cfg(verifier={"anti_hacking": {"penalty": {"no_op_pass": 0.5}}}))
    assert (reward, info["tau2_reward"], info["hacking_penalty"]) == (0.5, 1.0, 0.5)
    reward, _, info = noop(cfg(verifier={"anti_hacking": {"enabled": False, "penalty": {"no_op_pass": 0.5}}}))
    assert (reward, info["hacking_flags"]) == (1.0, {})


@needs_tau2
def test_task_caps_and_splits():
    from tether.env.tau2 import list_tasks

    assert [len(list_tasks("retail", s)) for s in ("train", "eval", "all")] == [74, 40, 114]
    assert [len(list_tasks("airline", s)) for s in ("train", "test")] == [30, 20]
    assert len(list_tasks("mock", "eval")) == 7  # 9, less the 2 that open with a user turn (solo)
    assert [t.id for t in list_tasks("retail", "eval", cfg(num_eval_tasks=3))] == \
        [t.id for t in list_tasks("retail", "eval")][:3]
    assert {t.kind for t in list_tasks("airline", "train")} == {"airline"}


@needs_tau2
def test_user_simulator_llm_plays_the_user_through_the_client(chat_server):
    from tether.env.tau2 import list_tasks, make_env

    url, replies, seen = chat_server
    user = {"user_simulator": "llm", "user_llm": {"client": {"base_url": url, "model": "sim"}, "max_tokens": 64,
                                                   "temperature": 0.5},
            "action_space": [{"name": "respond_to_user", "params": ["message"], "timeout_ms": 60000}]}
    c = cfg(**user)
    assert len(list_tasks("mock", "eval", c)) == 9  # with a user, mock's history tasks are playable
    env = make_env("mock", c)
    replies += ["I need a task called Important Meeting.", "Great, thanks! ###STOP###"]
    obs = env.reset("create_task_1")
    assert obs["user_reply"] == "I need a task called Important Meeting."
    assert seen[0]["model"] == "sim" and seen[0]["max_tokens"] == 64 and seen[0]["temperature"] == 0.5
    env.step(WRITE)
    _, reward, done, info = env.step({"name": "respond_to_user", "params": {"message": "Created it."}})
    assert done and reward == 1.0 and info["termination"] == "user_stop"
    assert [s["function"]["name"] for s in env.tool_schemas()][-1] == "respond_to_user"
    solo_env = make_env("mock", cfg())  # the default: solo, no user, the done tool
    assert [s["function"]["name"] for s in solo_env.tool_schemas()][-1] == "done"


@needs_tau2
@pytest.mark.skipif(not has_reward_section(), reason="this tether has no reward section (reward.judge_client)")
def test_judge_llm_answers_tau2s_nl_evaluator(chat_server):
    from tau2.data_model.message import AssistantMessage, UserMessage
    from tau2.data_model.tasks import RewardType

    from tether.env.tau2 import make_env, scoring
    from tether.env.tau2._load import tasks_by_id

    url, replies, seen = chat_server
    judged = cfg(verifier={"judge": "llm"}, reward={"judge_client": {"base_url": url, "model": "judge"}})
    assert make_env("mock", cfg()).judge is None
    env = make_env("mock", judged)
    task = tasks_by_id("mock")["create_task_1_nl_eval"].model_copy(deep=True)
    task.evaluation_criteria.reward_basis = [RewardType.NL_ASSERTION]
    replies.append(json.dumps({"results": [{"expectedOutcome": a, "reasoning": "ok", "metExpectation": True}
                                           for a in task.evaluation_criteria.nl_assertions]}))
    msgs = [AssistantMessage(role="assistant", content="Done, and you are great!"),
            UserMessage(role="user", content="###STOP###")]
    s = scoring.score("mock", task, msgs, "user_stop", solo=False, judge=env.judge)
    assert (s.reward, s.components, s.passed) == (1.0, {"nl": 1.0}, True)
    assert seen[0]["model"] == "judge" and "Done, and you are great!" in seen[0]["messages"][1]["content"]


@needs_tau2
def test_a_user_slower_than_the_respond_timeout_is_a_failed_call():
    import time

    from tether.env.tau2.env import Tau2Env

    class SlowUser:
        def __call__(self, conversation):
            if len(conversation) > 1:
                time.sleep(0.5)
            return "Hi, I need a task."

    for timeout, error in ((0.1, True), (5.0, False)):
        env = Tau2Env("mock", solo=False, user_factory=lambda task: SlowUser(), user_timeout_s=timeout)
        env.reset("create_task_1")
        obs, _, done, info = env.step({"name": "respond_to_user", "params": {"message": "What title?"}})
        assert obs["tool_error"] == error and not done
        assert ("did not answer within 0.1 s" in obs["last_tool_result"]) == error
        assert len(env.tau2_messages) == (2 if error else 4)  # a timed-out message is not in the conversation


def test_eval_trials_reports_pass_hat_k_for_any_environment(tiny_model, tmp_path):
    """``tether eval --trials 2`` on the customer-service env: pass^1 per kind is the kind's success rate, and
    pass^2 is the mean of C(c, 2) / C(2, 2) = 1 only where both trials succeeded."""
    from typer.testing import CliRunner

    from tether.cli import app

    config = tmp_path / "cs.yaml"
    config.write_text("environment: {num_train_tasks: 4, num_eval_tasks: 4}\n"
                      "engine: {max_tokens: 12, temperature: 1.0}\n"
                      "agent_loop: {max_assistant_turns: 2, max_user_turns: 2}\n")
    result = CliRunner().invoke(app, ["eval", tiny_model, "--config", str(config), "--trials", "2", "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output[result.output.index("{"):])
    kinds = sorted(k.split("/")[-1] for k in metrics if k.startswith("eval/pass^1/"))
    assert kinds and kinds == sorted(k.split("/")[-1] for k in metrics if k.startswith("eval/success_rate/"))
    for kind in kinds:
        assert metrics[f"eval/pass^1/{kind}"] == pytest.approx(metrics[f"eval/success_rate/{kind}"])
        assert metrics[f"eval/pass^2/{kind}"] <= metrics[f"eval/pass^1/{kind}"]


@needs_tau2
def test_the_gpu_example_config_loads_and_builds_its_environment(monkeypatch):
    from tether.config import load_config
    from tether.env.tau2 import make_env

    monkeypatch.setenv("TAU2_USER_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("TAU2_USER_MODEL", "user-model")
    monkeypatch.setenv("TAU2_USER_API_KEY", "sk-test")
    c = load_config(["examples/tau2_retail/config.yaml"], [])
    assert c.warnings() == []
    env = make_env("retail", c)
    assert (env.solo, env.max_steps, env.max_errors, env.user_timeout_s, len(env._train)) == (False, 30, 10, 60.0, 74)
