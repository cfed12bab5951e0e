"""The reward loop: scores added as trajectories finish, failures counted and settled by the configured policy,
the endpoint's rate limit and concurrency cap held at the server, the cache, the worker pool, generation not held
up by a slow judge, and every ``reward`` key flipped through a real training run. The judge is a stub
OpenAI-compatible server (``tether.reward.stub``) that records every request's arrival."""

from __future__ import annotations

import asyncio
import time

import pytest

from tether.config import load_config
from tether.engine.scripted import ScriptedEngine
from tether.env.verifier import JudgeView, PendingRubrics
from tether.llm import LLMClient
from tether.metrics import MetricsRecorder, set_recorder
from tether.pipeline.rollouter import Rollouter
from tether.reward.judge_llm import LLMJudge
from tether.reward.loop import RewardLoop
from tether.reward.stub import StubChatServer, bucket_excess
from tether.types import Trajectory

RUBRICS = [("response_quality", 0.2, "Grade {final_answer}"), ("efficiency", 0.1, "Count {tool_calls}")]


def traj(answer: str = "Refund approved.", rule_reward: float = 0.7) -> Trajectory:
    view = JudgeView("refund please", f"user: refund please\nagent: {answer}", "1. check_refund_policy()", answer)
    t = Trajectory(task_id="t", prompt_ids=[], reward=rule_reward,
                   reward_components={"refund_amount_correct": 1.0, "policy_compliance": 1.0})
    t.pending_judge = PendingRubrics(list(RUBRICS), view)
    return t


def loop_for(stub: StubChatServer, **kw) -> RewardLoop:
    client_kw = {k: kw.pop(k) for k in ("timeout_s", "max_retries", "max_concurrency", "requests_per_minute",
                                        "tokens_per_minute", "backoff_s") if k in kw}
    client = LLMClient(stub.base_url, model="judge", **{"backoff_s": 0.01, **client_kw})
    return RewardLoop(LLMJudge(client), **kw)


class Metrics:
    """The metrics recorded while the block runs, reduced as the trainer's row would be (the real recorder)."""

    def __enter__(self) -> dict[str, float]:
        self.recorder = MetricsRecorder([])
        self.prev = set_recorder(self.recorder)
        self.out: dict[str, float] = {}
        return self.out

    def __exit__(self, *exc) -> None:
        set_recorder(self.prev)
        self.out.update(self.recorder.flush(1))


def score_all(loop: RewardLoop, trajs: list[Trajectory]) -> None:
    async def main() -> None:
        await asyncio.gather(*(loop.score(t) for t in trajs))
    asyncio.run(main())


def test_scores_are_added_with_their_weights():
    answers = {"Grade": "SCORE: 0.5", "Count": "SCORE: 1"}
    with StubChatServer(lambda b: answers[b["messages"][1]["content"][:5]]) as stub:
        t = traj()
        score_all(loop_for(stub), [t])
    # 0.7 (rules) + 0.2 × 0.5 + 0.1 × 1.0
    assert t.reward == pytest.approx(0.9)
    assert t.reward_components == {"refund_amount_correct": 1.0, "policy_compliance": 1.0,
                                   "response_quality": 0.5, "efficiency": 1.0}
    assert t.errors == [] and t.pending_judge.scored == {"response_quality": 0.5, "efficiency": 1.0}


@pytest.mark.parametrize("case, answer, client_kw, cause", [
    ("timeout", lambda b: "SCORE: 0.5", {"timeout_s": 0.2}, "timeout"),  # the stub answers after 0.5 s
    ("500", lambda b: (500, '{"error": {"message": "boom"}}'), {"max_retries": 1}, "http"),
    ("unparseable", lambda b: "It is quite good.", {}, "unparseable"),
])
@pytest.mark.parametrize("policy", ["drop_group", "rule_only"])
def test_judge_failures_are_counted_recorded_and_settled_by_the_policy(case, answer, client_kw, cause, policy):
    delay = 0.5 if case == "timeout" else 0.0
    with StubChatServer(answer, delay_s=delay) as stub, Metrics() as m:
        loop = loop_for(stub, on_failure=policy, **client_kw)
        group = [traj("a"), traj("b")]
        score_all(loop, group)
        dropped = loop.settle(group)
    assert len(stub.arrivals) == (8 if case == "500" else 4)  # 2 trajectories × 2 rubrics (× 2: one retry of a 500)
    assert m["reward/judge_failures"] == 4 and m[f"reward/judge_failures/{cause}"] == 4
    assert loop.stats.failures == 4
    for t in group:  # never a silent 0: the failure is on the trajectory and the rubrics are gone, not zeroed
        assert sorted(t.pending_judge.failed) == ["efficiency", "response_quality"]
        assert any(e.startswith(f"judge response_quality ({cause})") for e in t.errors)
        assert t.reward == pytest.approx(0.7) and "response_quality" not in t.reward_components
    assert dropped is (policy == "drop_group")
    key = "reward/judge_dropped_groups" if policy == "drop_group" else "reward/rule_only_groups"
    assert m[key] == 1


def test_one_failure_strips_the_rubrics_of_the_whole_group_so_it_stays_comparable():
    # the judge fails on trajectory "bad" only: its group-mate's rubric scores are removed too (rule_only)
    with StubChatServer(lambda b: "nope" if "bad" in b["messages"][1]["content"] else "SCORE: 1") as stub:
        loop = loop_for(stub, on_failure="rule_only")
        good, bad = traj("good"), traj("bad")
        score_all(loop, [good, bad])
        # before settling: good 0.7 + 0.2 + 0.1; bad's response_quality failed, its efficiency scored 1: 0.7 + 0.1
        assert good.reward == pytest.approx(1.0) and bad.reward == pytest.approx(0.8)
        assert loop.settle([good, bad]) is False
    assert good.reward == pytest.approx(0.7) and bad.reward == pytest.approx(0.7)
    assert set(good.reward_components) == set(bad.reward_components) == {"refund_amount_correct", "policy_compliance"}
    assert loop.stats.rule_only_groups == 1 and loop.stats.failures == 1


def test_request_rate_limit_holds_at_the_server():
    # 1200 requests/min = 20/s, burst one second's worth (20): 60 requests take >= (60 - 20) / 20 = 2 s
    with StubChatServer(lambda b: "SCORE: 0.5") as stub:
        loop = loop_for(stub, requests_per_minute=1200, workers=64)
        t0 = time.monotonic()
        score_all(loop, [traj(f"answer {i}") for i in range(30)])
        elapsed = time.monotonic() - t0
        arrivals = list(stub.arrivals)
    assert len(arrivals) == 60 and elapsed >= 1.9  # unlimited, the 60 requests take ~0.1 s
    # by any time t, at most burst + rate · (t − t0) requests have arrived (a late stamp cannot hide an excess)
    assert bucket_excess(arrivals, t0, 1200) <= 0
    assert bucket_excess(arrivals, t0, 600) > 0  # the check can fail: these arrivals break a limit half as high


def test_concurrency_cap_and_worker_pool_bound_requests_in_flight():
    with StubChatServer(lambda b: "SCORE: 0.5", delay_s=0.15) as stub:
        score_all(loop_for(stub, max_concurrency=3, workers=64), [traj(f"a{i}") for i in range(6)])
        assert stub.max_in_flight == 3  # 12 requests, the endpoint's cap
    with StubChatServer(lambda b: "SCORE: 0.5", delay_s=0.15) as stub:
        t0 = time.monotonic()
        score_all(loop_for(stub, workers=1), [traj(f"a{i}") for i in range(3)])
        assert stub.max_in_flight == 1 and time.monotonic() - t0 >= 6 * 0.15  # one job at a time: serial
    with StubChatServer(lambda b: "SCORE: 0.5", delay_s=0.15) as stub:
        score_all(loop_for(stub, workers=4), [traj(f"a{i}") for i in range(3)])
        assert stub.max_in_flight == 4


def test_cache_hits_for_the_same_rubric_and_content_and_cache_size_0_turns_it_off():
    with StubChatServer(lambda b: "SCORE: 0.5") as stub, Metrics() as m:
        loop = loop_for(stub)
        first, again, other = traj("same"), traj("same"), traj("different")
        score_all(loop, [first])
        score_all(loop, [again, other])
    # first: 2 requests; again: both rubrics from the cache; other: its response_quality prompt differs (a request)
    # but its efficiency prompt shows the same tool calls as first's (a hit): the key is what the judge reads
    assert len(stub.arrivals) == 3
    assert loop.stats.cache_hits == 3 and m["reward/judge_cache_hits"] == 3
    assert again.reward == first.reward == pytest.approx(0.85)
    with StubChatServer(lambda b: "SCORE: 0.5") as stub:
        loop = loop_for(stub, cache_size=0)
        score_all(loop, [traj("same")])
        score_all(loop, [traj("same")])
    assert len(stub.arrivals) == 4 and loop.stats.cache_hits == 0


def test_a_slow_judge_does_not_hold_up_generation(tiny_model):
    """Four episodes in series (one slot), 0.2 s of generation each, a 0.6 s judge: if judging held the slot the
    batch would take 4 × 0.8 = 3.2 s; overlapped it takes ≈ 4 × 0.2 + 0.6 = 1.4 s."""
    from transformers import AutoTokenizer

    from tether.agent.loop import LoopLimits, make_agent_loop
    from tether.engine.base import SamplingParams
    from tether.env.customer_service import CustomerServiceEnv

    tok = AutoTokenizer.from_pretrained(tiny_model)

    class SlowEngine(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            await asyncio.sleep(0.2)
            return await super().generate(prompt_ids, params)

    cfg = load_config([], ["environment.verifier.judge=llm", "reward.judge_client.base_url=http://127.0.0.1:9/v1",
                           "reward.judge_client.model=m"])
    with StubChatServer(lambda b: "SCORE: 1", delay_s=0.6) as stub:
        cfg.reward.judge_client.base_url = stub.base_url
        agent = make_agent_loop("tool_agent", engine=SlowEngine(tok, ["Hello."] * 8), tokenizer=tok,
                                sampling=SamplingParams(max_tokens=16), limits=LoopLimits(max_assistant_turns=1))
        rollouter = Rollouter(agent, lambda: CustomerServiceEnv(cfg), max_concurrent=1,
                              rewards=RewardLoop.from_config(cfg))
        tasks = CustomerServiceEnv(cfg).tasks("train")[:4]
        t0 = time.monotonic()
        groups = asyncio.run(rollouter.groups(tasks, 1, seed=0))
        elapsed = time.monotonic() - t0
    assert len(stub.arrivals) == 4  # response_quality of each episode (efficiency is gated: they did not resolve)
    assert all(g.trajectories[0].reward_components["response_quality"] == 1.0 for g in groups)
    assert elapsed < 2.4, elapsed  # well under the 3.2 s of a judge inside the slot
    assert stub.arrivals[0] - t0 < 0.6  # the first judge request went out while episodes 2-4 were generating


def test_each_reward_key_changes_a_training_run(small_run):
    """verifier.judge, on_judge_failure, judge_samples, the rubric prompt and cache_size, flipped in real runs."""
    def answer(body):
        if "FAIL" in body["messages"][1]["content"]:
            return (500, '{"error": {"message": "judge down"}}')
        return ["SCORE: 0.25", "SCORE: 0.75"][: body.get("n", 1)]

    with StubChatServer(answer) as stub:
        llm = ["environment.verifier.judge=llm", f"reward.judge_client.base_url={stub.base_url}",
               "reward.judge_client.model=judge", "reward.judge_client.max_retries=0", "trainer.total_steps=1",
               "trainer.save_every=1"]
        det, _, _ = small_run("det", "trainer.total_steps=1", "trainer.save_every=1")
        one, _, _ = small_run("llm", *llm)
        n = len(stub.arrivals)
        two, _, _ = small_run("n2", *llm, "reward.judge_samples=2", "reward.judge_temperature=1.0")
        prompt = ["environment.verifier.model_based=[{rubric: response_quality, weight: 0.2, prompt: 'FAIL {task}'}]"]
        drop, drop_samples, _ = small_run("drop", *llm, *prompt)
        keep, keep_samples, _ = small_run("keep", *llm, *prompt, "reward.on_judge_failure=rule_only")
    assert "reward/judge_requests" not in det[1] and "reward/judge_requests" in one[1]
    assert one[1]["reward/response_quality"] == 0.25 and two[1]["reward/response_quality"] == 0.5  # (0.25+0.75)/2
    assert det[1]["reward/response_quality"] != 0.25
    assert n > 0 and all(b.get("n", 1) == 1 for b in stub.bodies[:n]) and stub.bodies[n]["n"] == 2
    assert drop[1]["reward/judge_failures"] > 0 and drop[1]["reward/judge_dropped_groups"] == 2
    assert [len(r["dropped"]) for r in drop_samples] == [2] and drop_samples[0]["groups"] == []
    # the step's 2 groups, trained on the rule checks, + the 4 held-out episodes evaluated at the end (always rule-only)
    assert keep[1]["reward/rule_only_groups"] == 6 and len(keep_samples[0]["groups"]) == 2
    assert drop[1]["reward/rule_only_groups"] == 4 and keep[0]["reward/rule_only_groups"] == 4  # step 0: evaluation
    assert "reward/response_quality" not in keep[1]  # rule checks only, said so in reward/rule_only_groups
