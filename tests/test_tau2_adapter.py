"""The tau2-bench adapter (tether.env.tau2) against tau2's own evaluator.

Every trajectory is played twice: through the adapter (tether actions ``{"name", "params"}`` into ``Tau2Env``)
and directly with tau2's API (its domain environment's ``get_response`` building the messages tau2's orchestrator
records, then ``evaluate_simulation``). The adapter's reward must be tau2's, exactly, and its messages the same.

By default: all of mock, and a sample of retail and airline (writing and non-writing tasks). ``TETHER_TAU2_FULL=1``
plays every task of the three domains (173); ``TETHER_TAU2_VARIANTS=gold,noop`` plays only those variants. Every
variant of every task is played and each mismatch recorded; the summary line gives per variant how many matched.
Measured with all four variants (2026-12-01, 1 thread, load ~4.5): every one of 628 trajectories matched tau2 —
retail 114 tasks (gold 114, omit_first_write 105, changed_arg 105, noop 114) in 803 s, airline 50 (50, 30, 30, 50)
in 632 s, mock 9 (9, 6, 6, 9; 3 where tau2's evaluator raises, scored 0) in 19 s. tau2 itself passes 5 retail tasks
with the first write omitted or changed: in 12, 13, 64 and 105 the gold's first write fails in tau2 (e.g. "Payment
method should be the original payment method"), in 22 a later write restores what it changed.
"""

from __future__ import annotations

import copy
import functools
import os
import time

import pytest

from tether.env.tau2 import available

pytestmark = pytest.mark.skipif(not available(), reason="tau2 is not installed: pip install 'tether[tau2]'")

OPENING = "Hello, I need help."
CLOSING = "Is there anything else I can help you with?"
FULL = os.environ.get("TETHER_TAU2_FULL") == "1"
# which variants to play (all by default; e.g. "gold,noop" for a faster sweep of every task)
VARIANTS = tuple(os.environ.get("TETHER_TAU2_VARIANTS", "gold,omit_first_write,changed_arg,noop").split(","))
SAMPLE = {"mock": None, "retail": ["0", "57"], "airline": ["1", "2"]}  # each: a writing and a non-writing task


def _tasks(domain):
    from tether.env.tau2._load import tasks_by_id

    by_id = tasks_by_id(domain)
    ids = list(by_id) if FULL or SAMPLE[domain] is None else SAMPLE[domain]
    return [by_id[i] for i in ids]


@functools.cache
def _write_tools(domain):
    from tau2.environment.toolkit import ToolType

    from tether.env.tau2._load import make_environment

    tools = make_environment(domain, solo=False).tools
    return frozenset(n for n in tools.get_tools() if tools.tool_type(n) == ToolType.WRITE)


def _is_write(domain, name):
    return name in _write_tools(domain)


def _script(domain, task, variant):
    """Steps ("call", name, args) / ("say", text) of a variant, or None where it does not apply."""
    crit = task.evaluation_criteria
    actions = [(a.name, copy.deepcopy(a.arguments)) for a in (crit.actions or [])]
    say = " ".join(crit.communicate_info or []) or CLOSING
    writes = [i for i, (name, _) in enumerate(actions) if _is_write(domain, name)]
    if variant == "noop":
        actions = []
    elif variant == "omit_first_write":
        if not writes:
            return None
        del actions[writes[0]]
    elif variant == "changed_arg":
        if not writes or not actions[writes[0]][1]:
            return None
        args = actions[writes[0]][1]
        key = sorted(args)[-1]
        v = args[key]
        args[key] = (not v if isinstance(v, bool) else v + 1 if isinstance(v, (int, float))
                     else v[:-1] if isinstance(v, list) and v else str(v) + "0")
    return [("call", n, a) for n, a in actions] + [("say", say)]


def _reference(domain, task, steps, solo):
    """tau2 only: the messages its orchestrator records for these steps, and evaluate_simulation's reward."""
    from tau2.data_model.message import AssistantMessage, ToolCall, UserMessage
    from tau2.data_model.simulation import SimulationRun, TerminationReason
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
    from tau2.registry import registry

    from tether.env.tau2._load import tau2_solo

    env = registry.get_env_constructor(domain)(solo_mode=tau2_solo(domain, solo))  # retail/airline: no solo mode
    init = task.initial_state
    history = list(init.message_history or []) if init else []
    env.set_state(init.initialization_data if init else None, init.initialization_actions if init else None,
                  history)
    msgs = copy.deepcopy(history)
    if not solo:
        if not msgs or not isinstance(msgs[-1], AssistantMessage):
            msgs.append(AssistantMessage(role="assistant", content="Hi! How can I help you today?"))
        msgs.append(UserMessage(role="user", content=OPENING))
    k = 0
    for kind, *rest in steps:
        if kind == "call":
            k += 1
            call = ToolCall(id=f"call_{k}", name=rest[0], arguments=rest[1], requestor="assistant")
            msgs += [AssistantMessage(role="assistant", tool_calls=[call]), env.get_response(call)]
        elif not solo:
            msgs += [AssistantMessage(role="assistant", content=rest[0]),
                     UserMessage(role="user", content="###STOP###")]
    if solo:
        msgs.append(AssistantMessage(role="assistant", content="###STOP###"))
    reason = TerminationReason.AGENT_STOP if solo else TerminationReason.USER_STOP
    run = SimulationRun(id="ref", task_id=task.id, start_time="", end_time="", duration=0.0,
                        termination_reason=reason, messages=msgs)
    try:
        return evaluate_simulation(run, task, EvaluationType.ALL, solo_mode=tau2_solo(domain, solo),
                                   domain=domain).reward, msgs
    except ValueError as e:  # tau2 raises on an env assertion about a missing record: the adapter scores 0
        return ("raised", str(e)), msgs


def _adapter(domain, task, steps, solo, **kw):
    from tether.config.environment import AntiHackingConfig
    from tether.env.tau2.env import Tau2Env
    from tether.env.tau2.user import ScriptedUser

    kw.setdefault("anti_hacking", AntiHackingConfig())  # the default detectors: no penalty on any replay here
    env = Tau2Env(domain, solo=solo, user_factory=None if solo else (lambda t: ScriptedUser([OPENING])), **kw)
    env.reset(task.id)
    out = None
    for kind, *rest in steps:
        if kind == "call":
            out = env.step({"name": rest[0], "params": rest[1]})
        elif not solo:
            out = env.step({"name": "respond_to_user", "params": {"message": rest[0]}})
        assert out[2] == (kind == "say" and not solo), (kind, rest, out)
    if solo:
        out = env.step({"name": "done", "params": {}})
    _, reward, done, info = out
    assert done
    return reward, info, env.tau2_messages


def _comparable(messages):
    drop = {"timestamp", "turn_idx", "cost", "usage", "raw_data"}
    return [m.model_dump(exclude=drop) for m in messages]


def _gold_writes(domain, task):
    """Whether replaying the task's gold actions changes its databases (tau2's hashes)."""
    from tether.env.tau2 import scoring
    from tether.env.tau2.env import _fresh

    env, _ = _fresh(domain, task, False)
    before = scoring.db_digest(env)
    for a in task.evaluation_criteria.actions or []:
        try:
            env.make_tool_call(a.name, requestor=a.requestor, **a.arguments)
        except Exception:
            pass
    return scoring.db_digest(env) != before


def _check_variant(domain, task, variant, steps, writes, tally):
    """One trajectory through the adapter and through tau2 alone: the same reward, messages and flags."""
    want, ref_msgs = _reference(domain, task, steps, solo=False)
    got, info, msgs = _adapter(domain, task, steps, solo=False)
    where = f"{domain} task {task.id} {variant}"
    if isinstance(want, tuple):  # tau2's evaluator raised: 0, with tau2's message in the note
        assert got == 0.0 and want[1] in info["note"], (where, info)
        tally["raised"] = tally.get("raised", 0) + 1
        return
    assert got == want, f"{where}: adapter {got}, tau2 {want} ({info})"
    assert set(info["hacking_flags"]) <= {"no_op_pass"} and info["hacking_penalty"] == 0.0, (where, info)
    assert info["tau2_reward"] == want and info["success"] == (want == 1.0), where
    assert _comparable(msgs) == _comparable(ref_msgs), where
    assert set(info["reward_components"]) <= {"db", "env_assertion", "action", "communicate"}, where
    assert info["reward_basis"] == [b.value for b in task.evaluation_criteria.reward_basis], where
    # no_op_pass: flagged exactly when tau2 passed the episode and the databases did not change
    flagged = info["hacking_flags"].get("no_op_pass", 0) == 1
    if variant == "noop":
        assert flagged == (want == 1.0), where
        if "db" in info["reward_components"]:  # the hole: doing nothing passes the DB check exactly where
            assert info["reward_components"]["db"] == (0.0 if writes else 1.0), where  # gold writes nothing
        tally["noop_flagged"] += flagged
        if flagged:  # the hole applies only where the gold actions write nothing
            assert not writes, where
    if variant == "gold":
        assert flagged == (want == 1.0 and not writes), where
    tally[f"{variant}_pass"] = tally.get(f"{variant}_pass", 0) + (want == 1.0)


@pytest.mark.parametrize("domain", ["mock", "retail", "airline"])
def test_replays_score_exactly_what_tau2_scores(domain):
    """Every variant of every task played (a mismatch is recorded and the sweep goes on); per variant: how many
    were played and matched tau2 exactly, how many tau2 passed."""
    t0 = time.perf_counter()
    tally = {"gold_pass": 0, "noop_flagged": 0, "tasks": 0, "variants": 0}
    played, matched, mismatches = {}, {}, []
    for task in _tasks(domain):
        tally["tasks"] += 1
        writes = _gold_writes(domain, task)
        for variant in VARIANTS:
            steps = _script(domain, task, variant)
            if steps is None:
                continue
            tally["variants"] += 1
            played[variant] = played.get(variant, 0) + 1
            try:
                _check_variant(domain, task, variant, steps, writes, tally)
            except AssertionError as e:
                mismatches.append(str(e)[:400])
                continue
            matched[variant] = matched.get(variant, 0) + 1
    per_variant = {v: f"{matched.get(v, 0)}/{played[v]} matched" for v in played}
    print(f"\n{domain}: {tally} {per_variant} in {time.perf_counter() - t0:.1f} s")
    assert not mismatches, f"{len(mismatches)} mismatches: " + "\n".join(mismatches)
    assert tally["gold_pass"] >= 1 or "gold" not in VARIANTS
    if domain != "mock" and not FULL and "noop" in VARIANTS:
        assert tally["noop_flagged"] >= 1 and tally["noop_flagged"] < tally["tasks"], tally  # the sample has both


def test_solo_replays_score_what_tau2_scores():
    """Solo mode on mock: tool calls only, ended by the done tool (tau2's AGENT_STOP)."""
    from tether.env.tau2.env import solo_compatible

    seen = 0
    for task in _tasks("mock"):
        if not solo_compatible(task):
            continue
        for variant in ("gold", "noop"):
            steps = [s for s in _script("mock", task, variant) if s[0] == "call"]
            want, ref_msgs = _reference("mock", task, steps, solo=True)
            got, info, msgs = _adapter("mock", task, steps, solo=True)
            if isinstance(want, tuple):  # tau2's evaluator raised (an env assertion about a missing record)
                want = 0.0
            assert got == want and info["termination"] == "agent_stop", (task.id, variant, got, want)
            assert _comparable(msgs) == _comparable(ref_msgs)
            seen += 1
    assert seen == 14  # 7 of mock's 9 tasks have no user turn in their history


def test_episodes_are_isolated_and_interleave():
    """Two episodes of one task at once: a write in one is not seen by the other."""
    from tether.env.tau2.env import Tau2Env

    a, b = Tau2Env("mock"), Tau2Env("mock")
    a.reset("create_task_1")
    b.reset("create_task_1")
    a.step({"name": "create_task", "params": {"user_id": "user_1", "title": "A"}})
    obs, *_ = b.step({"name": "get_users", "params": {}})
    assert "task_2" not in obs["last_tool_result"]  # b's database has only task_1
    _, reward_b, _, info_b = b.step({"name": "done", "params": {}})
    _, reward_a, _, info_a = a.step({"name": "done", "params": {}})
    assert (reward_a, reward_b) == (0.0, 0.0)  # a created "A", not "Important Meeting"; b created nothing
    assert info_b["reward_components"]["db"] == 0.0
    # a later episode starts from tau2's own database, untouched by a's write (one parse, a new database each)
    from tau2.registry import registry

    from tether.env.tau2 import scoring

    c = Tau2Env("mock")
    c.reset("create_task_1")
    assert scoring.db_digest(a.tau2_env) != scoring.db_digest(c.tau2_env) == scoring.db_digest(
        registry.get_env_constructor("mock")())


def test_tool_schemas_are_tau2s_own():
    from tether.env.tau2._load import make_environment
    from tether.env.tau2.env import Tau2Env

    want = [t.openai_schema for t in make_environment("retail", solo=False).get_tools()]
    schemas = Tau2Env("retail").tool_schemas()
    assert schemas[:-1] == want and schemas[-1]["function"]["name"] == "done"
    assert len(want) == 15


def test_premature_endings_score_zero_with_the_reason():
    """The agent loop's limits and tau2's own (max_steps, max_errors) end an episode that tau2 scores 0."""
    from tether.env.tau2.env import Tau2Env

    env = Tau2Env("mock", max_steps=2)
    env.reset("create_task_1")
    env.step({"name": "create_task", "params": {"user_id": "user_1", "title": "Important Meeting"}})
    _, reward, done, info = env.step({"name": "get_users", "params": {}})
    assert done and reward == 0.0 and info["termination"] == "max_steps" and info["truncated"]
    longer = Tau2Env("mock", max_steps=3)  # the same steps under a higher cap: not ended, then passes
    longer.reset("create_task_1")
    longer.step({"name": "create_task", "params": {"user_id": "user_1", "title": "Important Meeting"}})
    assert not longer.step({"name": "get_users", "params": {}})[2]
    assert longer.step({"name": "done", "params": {}})[1] == 1.0

    errs = Tau2Env("mock", max_errors=2)
    errs.reset("create_task_1")
    assert not errs.step({"name": "update_task_status", "params": {"task_id": "nope", "status": "x"}})[2]
    _, reward, done, info = errs.step({"name": "update_task_status", "params": {"task_id": "no", "status": "x"}})
    assert done and reward == 0.0 and info["termination"] == "too_many_errors" and info["tool_errors"] == 2

    cut = Tau2Env("mock")
    cut.reset("create_task_1")
    cut.step({"name": "create_task", "params": {"user_id": "user_1", "title": "Important Meeting"}})
    reward, info = cut.finalize("max_assistant_turns")
    assert reward == 0.0 and info["tau2_termination"] == "max_steps" and info["truncated"]


def test_nl_assertions_skipped_without_a_judge_and_judged_with_one():
    """A task whose basis holds NL_ASSERTION: no judge -> skipped, never a success; a judge -> tau2's NL
    evaluator, its prompt answered by the judge."""
    import json

    from tau2.data_model.message import AssistantMessage, UserMessage
    from tau2.data_model.tasks import RewardType

    from tether.env.tau2 import scoring
    from tether.env.tau2._load import tasks_by_id

    task = tasks_by_id("mock")["create_task_1_nl_eval"].model_copy(deep=True)
    task.evaluation_criteria.reward_basis = [RewardType.NL_ASSERTION]
    msgs = [AssistantMessage(role="assistant", content="Hi!"), UserMessage(role="user", content="###STOP###")]
    skipped = scoring.score("mock", task, msgs, "user_stop", solo=False)
    assert skipped.skipped == ["nl"] and "nl" not in skipped.components and not skipped.passed

    seen = []

    def judge(met):
        def answer(messages):
            seen.append(messages)
            return json.dumps({"results": [{"expectedOutcome": a, "reasoning": "r", "metExpectation": met}
                                           for a in task.evaluation_criteria.nl_assertions]})
        return answer

    yes = scoring.score("mock", task, msgs, "user_stop", solo=False, judge=judge(True))
    no = scoring.score("mock", task, msgs, "user_stop", solo=False, judge=judge(False))
    assert (yes.reward, yes.components, yes.passed) == (1.0, {"nl": 1.0}, True)
    assert (no.reward, no.components, no.passed) == (0.0, {"nl": 0.0}, False)
    assert "The user is complimented" in seen[0][1]["content"]  # tau2's prompt lists the assertions


def test_user_simulator_speaks_through_the_chat_function():
    """LLMUser: tau2's user system prompt + role-flipped text history, answered by the chat function."""
    from tether.env.tau2.env import Tau2Env
    from tether.env.tau2.user import LLMUser

    calls = []

    def chat(messages):
        calls.append(messages)
        return "Hi, I want a task." if len(calls) == 1 else "Thanks. ###STOP###"

    env = Tau2Env("mock", solo=False, user_factory=lambda task: LLMUser(task, chat))
    obs = env.reset("create_task_1")
    assert obs["user_reply"] == "Hi, I want a task."
    assert calls[0][0]["role"] == "system" and "<scenario>" in calls[0][0]["content"]
    assert calls[0][1:] == [{"role": "user", "content": "Hi! How can I help you today?"}]
    env.step({"name": "create_task", "params": {"user_id": "user_1", "title": "Important Meeting"}})
    _, reward, done, info = env.step({"name": "respond_to_user", "params": {"message": "Done."}})
    assert done and info["termination"] == "user_stop" and reward == 1.0
    # the user saw text only: greeting, its own line, the agent's "Done." (tool calls stay with the agent)
    assert [m["content"] for m in calls[1][1:]] == ["Hi! How can I help you today?", "Hi, I want a task.", "Done."]
    assert [m["role"] for m in calls[1][1:]] == ["user", "assistant", "user"]


def _loop(tiny_model, texts, turns):
    from transformers import AutoTokenizer

    from tether.agent.loop import LoopLimits, make_agent_loop
    from tether.engine.base import SamplingParams
    from tether.engine.scripted import ScriptedEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return make_agent_loop("tool_agent", engine=ScriptedEngine(tokenizer, texts), tokenizer=tokenizer,
                           sampling=SamplingParams(max_tokens=100_000),
                           limits=LoopLimits(max_user_turns=turns, max_assistant_turns=turns, max_parallel_calls=1,
                                             tool_selection="all", context_window=1_000_000))


def test_gold_actions_written_by_the_policy_through_the_agent_loop(tiny_model):
    """The real agent loop: hermes tool calls parsed, run in tau2's environment, scored by tau2 — solo retail
    (ended by done) and mock with a user (plain text goes to the user, who stops)."""
    import asyncio
    import json

    from tether.env.tau2 import list_tasks
    from tether.env.tau2._load import tasks_by_id
    from tether.env.tau2.env import Tau2Env
    from tether.env.tau2.user import ScriptedUser

    def call(name, args):
        return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'

    task = tasks_by_id("retail")["0"]
    gold = [(a.name, a.arguments) for a in task.evaluation_criteria.actions]
    texts = [call(n, a) for n, a in gold] + [call("done", {})]
    want, _ = _reference("retail", task, [("call", n, a) for n, a in gold], solo=True)
    retail_task = next(t for t in list_tasks("retail", "all") if t.id == "0")
    traj = asyncio.run(_loop(tiny_model, texts, len(texts)).run(retail_task, Tau2Env("retail"), seed=0))
    assert (traj.reward, traj.success, traj.termination) == (want, True, "agent_stop") and want == 1.0
    assert traj.num_tool_calls == len(gold) + 1 and traj.reward_components == {"db": 1.0, "communicate": 1.0}

    env = Tau2Env("mock", solo=False, user_factory=lambda t: ScriptedUser(["Please create it."]))
    texts = [call("create_task", {"user_id": "user_1", "title": "Important Meeting"}), "Your task is created."]
    mock_task = next(t for t in list_tasks("mock", "all") if t.id == "create_task_1")
    traj = asyncio.run(_loop(tiny_model, texts, 4).run(mock_task, env, seed=0))
    assert (traj.reward, traj.termination, traj.num_user_turns) == (1.0, "user_stop", 1)
    assert traj.messages[-1] == {"role": "user", "content": "###STOP###"}


def _containers(obj, out):
    """ids of every mutable object (model, dict, list) reachable from ``obj``."""
    from pydantic import BaseModel

    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, BaseModel):
            out.add(id(o))
            stack.extend(o.__dict__.values())
        elif isinstance(o, dict):
            out.add(id(o))
            stack.extend(o.values())
        elif isinstance(o, (list, set)):
            out.add(id(o))
            stack.extend(o)
    return out


@pytest.mark.parametrize("domain", ["mock", "retail", "airline"])
def test_environments_from_the_parsed_database_are_tau2s_and_share_nothing(domain):
    """make_environment (and the evaluator's constructor) build from tau2's database parsed once: the same
    environment tau2's registry builds (hash, policy, tools), and two of them share no mutable object with each
    other or with the parsed data, so a write in one episode reaches no other."""
    from tau2.registry import registry

    from tether.env.tau2._load import _source, evaluator_domain, fresh_db, make_environment

    own = registry.get_env_constructor(domain)()
    built = make_environment(domain, solo=False)
    assert built.get_db_hash() == own.get_db_hash() and built.get_policy() == own.get_policy()
    assert [t.openai_schema for t in built.get_tools()] == [t.openai_schema for t in own.get_tools()]
    assert registry.get_env_constructor(evaluator_domain(domain))().get_db_hash() == own.get_db_hash()
    db_a, db_b = fresh_db(domain), fresh_db(domain)  # both alive while their ids are compared
    a, b = _containers(db_a, set()), _containers(db_b, set())
    source = _containers(_source(domain)[2], set())
    assert len(a) == len(b) > 5 and not (a & b) and not (a & source)


def test_gold_replays_are_not_flagged_and_run_to_their_end():
    """Every gold trajectory of the three domains (173) through the adapter under the default config of
    tau2:<domain>: no call pattern flags one (before the calibration 8 were: retail 21, 28, 30, 31, 32, 38, 43 and
    airline 12), none is cut. The two that tether's customer-service limits (max_turns 20, tool_error_threshold 3)
    cut — retail 21 (3 gold calls fail in tau2) and airline 44 (20 gold calls) — now run to their end and score
    what tau2 scores; a user's explicit 20 / 3 still cuts them (scored 0)."""
    from tether.config import RunConfig
    from tether.env.tau2._load import tasks_by_id
    from tether.env.tau2.gold import flag_table, replay, replay_gold

    t0 = time.perf_counter()
    replays = [r for domain in ("mock", "retail", "airline") for r in replay_gold(domain, score=False)]
    table = flag_table(replays)
    print(f"\ngold replays: {table} in {time.perf_counter() - t0:.1f} s")
    for domain, n in (("mock", 9), ("retail", 114), ("airline", 50)):
        assert table[domain] == {"episodes": n, "flagged": 0, "repeated_tool_calls": 0, "context_stuffing": 0,
                                 "ended_early": 0}, (domain, [(r.task_id, r.flags) for r in replays if r.flags])
    cut = [(r.domain, r.task_id) for r in replays if r.script_steps > 20 or r.tool_errors >= 3]
    assert cut == [("retail", "21"), ("airline", "44")]
    for domain, task_id in cut:
        task = tasks_by_id(domain)[task_id]
        steps = [("call", a.name, a.arguments) for a in task.evaluation_criteria.actions]
        steps.append(("say", " ".join(task.evaluation_criteria.communicate_info or []) or CLOSING))
        want, _ = _reference(domain, task, steps, solo=False)
        default = RunConfig.model_validate({"environment": {"name": f"tau2:{domain}"}}).environment
        full = replay(domain, task_id, default)
        assert want == 1.0
        assert (full.termination, full.tau2_reward, full.steps) == ("user_stop", 1.0, full.script_steps)
        given = RunConfig.model_validate({"environment": {"name": f"tau2:{domain}", "state": {"max_turns": 20},
                                                          "termination": {"tool_error_threshold": 3}}}).environment
        cut_short = replay(domain, task_id, given)
        assert cut_short.tau2_reward == 0.0 and cut_short.steps < cut_short.script_steps
        assert cut_short.termination == ("too_many_errors" if task_id == "21" else "max_steps")
