"""The LLM judge: the strict answer format, the prompt it is sent, n samples averaged, and the verifier's deferral
of rubrics to it (``verifier.judge: llm``) — against a stub OpenAI-compatible server."""

from __future__ import annotations

import asyncio

import pytest

from tether.config import ConfigError, RunConfig, load_config
from tether.env.customer_service import CustomerServiceEnv
from tether.env.verifier import BUILTIN_PROMPTS, JudgeView, PendingRubrics
from tether.llm import LLMClient, MalformedResponse
from tether.reward.judge_llm import LLMJudge
from tether.reward.rubrics import FORMAT, UnparseableJudgeAnswer, parse_score, render
from tether.reward.stub import StubChatServer


@pytest.mark.parametrize("answer, score", [
    ("SCORE: 0.75", 0.75),
    ("The answer is right and short.\nScore: 1", 1.0),
    ("**SCORE:** 0.5", 0.5),
    ("score : .25\n", 0.25),
    ("<think>maybe SCORE: 0.1</think>\nFine.\nSCORE: 0.9", 0.9),  # the reasoning block is not the answer
    ("SCORE: 0", 0.0),
])
def test_parse_score_reads_the_one_score_line(answer, score):
    assert parse_score(answer, "response_quality") == score


@pytest.mark.parametrize("answer, says", [
    ("", "has no line"),
    ("Looks good, 0.8", "has no line"),
    ("SCORE: 0.2\nSCORE: 0.3", "has 2 lines"),
    ("SCORE: 7/10", "is not a number from 0 to 1"),
    ("SCORE: high", "is not a number from 0 to 1"),
    ("SCORE: 1.5", "outside [0, 1]"),
    ("SCORE: -0.1", "is not a number from 0 to 1"),
])
def test_parse_score_refuses_anything_else_naming_the_rubric_and_showing_the_answer(answer, says):
    with pytest.raises(UnparseableJudgeAnswer) as e:
        parse_score(answer, "politeness")
    assert says in str(e.value) and "'politeness'" in str(e.value) and repr(answer[:20])[1:-1] in str(e.value)


def _episode_view() -> tuple[JudgeView, dict]:
    """A real episode (refund stated, approved): policy check, then the answer; judged by the LLM judge."""
    cfg = RunConfig.model_validate({"environment": {"verifier": {"judge": "llm"}},
                                    "reward": {"judge_client": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}})
    env = CustomerServiceEnv(cfg)
    task = next(t for t in env.tasks("train") if t.kind == "refund_stated")
    env.reset(task.id)
    d = task.data
    env.step({"name": "check_refund_policy", "params": {"order_id": d["order_id"], "reason_code": d["reason_code"]}})
    message = f"Your refund of {d['answer_number']} is approved."
    _, reward, done, info = env.step({"name": "respond_to_user", "params": {"message": message}})
    assert done and info["termination"] == "user_issue_resolved"
    return info["pending_judge"].view, {"reward": reward, "info": info, "task": task, "message": message}


def test_verifier_scores_rules_now_and_defers_the_rubrics_with_the_episode_rendered():
    view, ep = _episode_view()
    info, d = ep["info"], ep["task"].data
    # the rule part only: refund_amount_correct 0.4 × 1 + policy_compliance 0.3 × 1; the rubrics are pending
    assert ep["reward"] == pytest.approx(0.7)
    assert info["reward_components"] == {"refund_amount_correct": 1.0, "policy_compliance": 1.0}
    pending: PendingRubrics = info["pending_judge"]
    assert [(n, w) for n, w, _ in pending.rubrics] == [("response_quality", 0.2), ("efficiency", 0.1)]
    assert pending.rubrics[0][2] == BUILTIN_PROMPTS["response_quality"]
    assert view.task == d["opening"] and view.final_answer == ep["message"]
    assert view.conversation == f"user: {d['opening']}\nagent: {ep['message']}\nuser: Thanks, that solves it."
    assert view.tool_calls.startswith(f'1. check_refund_policy({{"order_id": "{d["order_id"]}", "reason_code"')
    prompt = render(BUILTIN_PROMPTS["response_quality"], view)
    assert ep["message"] in prompt and d["opening"] in prompt and prompt.endswith(FORMAT)


def test_a_gated_rubric_of_an_episode_that_did_not_end_as_required_scores_0_without_the_judge():
    cfg = RunConfig.model_validate({"environment": {"verifier": {"judge": "llm"}},
                                    "reward": {"judge_client": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}}})
    env = CustomerServiceEnv(cfg)
    env.reset("train_000")
    reward, info = env.finalize("max_assistant_turns")
    assert info["reward_components"]["efficiency"] == 0.0  # gated: 0 now, never sent to the judge
    assert [n for n, _, _ in info["pending_judge"].rubrics] == ["response_quality"]
    assert reward == 0.0


def test_rubric_prompt_and_name_come_from_the_config_and_a_bad_template_is_refused_at_load(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("environment:\n  verifier:\n    judge: llm\n    model_based:\n"
                 "      - {rubric: politeness, weight: 0.3, prompt: 'Is this polite? {final_answer}'}\n"
                 "reward: {judge_client: {base_url: 'http://127.0.0.1:9/v1', model: m}}\n")
    cfg = load_config([f])
    env = CustomerServiceEnv(cfg)
    env.reset("train_000")
    _, info = env.finalize("max_assistant_turns")
    assert info["pending_judge"].rubrics == [("politeness", 0.3, "Is this polite? {final_answer}")]
    f.write_text(f.read_text().replace("{final_answer}", "{answer}"))
    with pytest.raises(ConfigError, match=r"model_based\[0\]\.prompt.*refers to \['answer'\]"):
        load_config([f])
    f.write_text("environment:\n  verifier:\n    model_based:\n      - {rubric: politeness, weight: 0.3}\n")
    with pytest.raises(ValueError, match=r"model_based\[0\] \(politeness\): the deterministic judge scores only"):
        CustomerServiceEnv(load_config([f]))
    with pytest.raises(ConfigError, match="judge: llm needs the judge's endpoint: set reward.judge_client"):
        load_config([], ["environment.verifier.judge=llm"])


def test_llm_judge_averages_n_samples_and_sends_the_configured_sampling():
    answers = ["ok\nSCORE: 0.2", "SCORE: 0.5", "SCORE: 0.8"]
    with StubChatServer(lambda body: answers[: body.get("n", 1)]) as stub:
        judge = LLMJudge(LLMClient(stub.base_url, model="judge-m"), samples=3, temperature=0.9, max_tokens=40)
        score = asyncio.run(judge.score("grade this", "response_quality"))
    assert score == pytest.approx(0.5)  # (0.2 + 0.5 + 0.8) / 3
    (body,) = stub.bodies
    assert body["n"] == 3 and body["temperature"] == 0.9 and body["max_tokens"] == 40 and body["model"] == "judge-m"
    assert body["messages"][1] == {"role": "user", "content": "grade this"}


def test_llm_judge_refuses_fewer_choices_than_samples_and_unparseable_answers():
    with StubChatServer(lambda body: ["SCORE: 0.5"]) as stub:
        judge = LLMJudge(LLMClient(stub.base_url, model="m"), samples=2)
        with pytest.raises(MalformedResponse, match="answered 1 choices for rubric 'efficiency', 2 were asked"):
            asyncio.run(judge.score("p", "efficiency"))
    with StubChatServer(lambda body: "I think it is good.") as stub:
        judge = LLMJudge(LLMClient(stub.base_url, model="m"))
        with pytest.raises(UnparseableJudgeAnswer, match="'efficiency' has no line `SCORE"):
            asyncio.run(judge.score("p", "efficiency"))
