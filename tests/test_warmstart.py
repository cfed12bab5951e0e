"""Warm starts: JSONL conversations laid out as the agent loop lays out a rollout, the demonstration
file's errors, the cache's one-build-under-a-lock, and the tiny-sft preset (a miniature recipe)."""

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from transformers import AutoModelForCausalLM

from tether import runtime
from tether.agent.chat import ChatAssembler
from tether.agent.loop import LoopLimits
from tether.config import load_config
from tether.env.customer_service import CustomerServiceEnv, example_texts
from tether.env.customer_service.tasks import generate
from tether.learner.model import build_tiny, load_model_and_tokenizer
from tether.warmstart import tiny_sft
from tether.warmstart.demos import DemoError, expert_demos, jsonl_demos, read_conversations
from tether.warmstart.entities import EntitySwap, world_entities


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), corpus=example_texts(100), num_hidden_layers=1,
                      hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return load_model_and_tokenizer(path)[1]


def openai_line(traj, env, task):
    """The loop's conversation as a user would write it: arguments as JSON strings, the task's tools."""
    messages = []
    for m in traj.messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        messages.append(m)
    tools = [s for s in env.tool_schemas() if s["function"]["name"] in task.tools]
    return json.dumps({"messages": messages, "tools": tools})


def test_expert_conversations_as_jsonl_load_back_to_the_ids_of_their_replay(tokenizer, tmp_path):
    cfg = load_config([], ["environment.num_train_tasks=10", "environment.num_eval_tasks=4"])
    env = CustomerServiceEnv(cfg)
    kinds = {}
    for t in env.tasks("train"):
        kinds.setdefault(t.kind, t)
    tasks = list(kinds.values())
    # mistakes too: a refusal, a low-priority escalation and a vague stock answer are all valid conversations
    demos = expert_demos("customer_service_agent", lambda: CustomerServiceEnv(cfg), tasks, tokenizer,
                         limits=LoopLimits(), mistake_rate=0.5, seed=1)
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(openai_line(d, env, t) + "\n\n" for d, t in zip(demos, tasks)))
    loaded = jsonl_demos(path, tokenizer, system_prompt=env.system_prompt(), tools=env.tool_schemas())
    assert len(loaded) == len(demos) == 5
    for a, b in zip(demos, loaded):
        assert b.prompt_ids == a.prompt_ids
        assert b.response_ids == a.response_ids and b.response_mask == a.response_mask
        assert b.num_assistant_turns == a.num_assistant_turns and b.task_id == f"{path}:{2 * loaded.index(b) + 1}"
    # without a system message or tools, the environment's fill in: the same prompt
    bare = json.loads(openai_line(demos[0], env, tasks[0]))
    bare["messages"] = bare["messages"][1:]
    del bare["tools"]
    path.write_text(json.dumps(bare))
    again = jsonl_demos(path, tokenizer, system_prompt=env.system_prompt(), tools=env.tool_schemas())[0]
    system = {"role": "system", "content": env.system_prompt()}
    assert again.prompt_ids == ChatAssembler(tokenizer, env.tool_schemas()).prompt([system, bare["messages"][0]])
    assert again.response_ids == demos[0].response_ids and again.response_mask == demos[0].response_mask


@pytest.mark.parametrize("line, message", [
    ('{"messages": [', "demos.jsonl:2: not valid JSON"),
    ('[1, 2]', 'demos.jsonl:2: expected a JSON object with a "messages" list'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "demos.jsonl:2: no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}',
     "demos.jsonl:2: the conversation must start with a user"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "demos.jsonl:2: messages[0]: expected an object with role"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": '
     '[{"function": {"name": "f", "arguments": "{oops"}}]}]}',
     "demos.jsonl:2: messages[1].tool_calls[0]: arguments is not valid JSON"),
    ('{"messages": [], "extra": 1}', "demos.jsonl:2: unknown keys ['extra']"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "demos.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(DemoError) as e:
        read_conversations(path)
    assert str(e.value).startswith(str(tmp_path)) and message in str(e.value) and "\n" not in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DemoError, match="absent.jsonl: no such file"):
        read_conversations(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DemoError, match="empty.jsonl: no conversations"):
        read_conversations(tmp_path / "empty.jsonl")


def test_cached_build_runs_once_while_others_wait(tmp_path):
    calls, logs = [], []

    def build(folder):
        calls.append(folder)
        time.sleep(0.3)  # long enough for every other thread to reach the lock
        (folder / "config.json").write_text("{}")

    target = tmp_path / "cache" / "preset-abc"
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        runtime.cached_build(target, build, what="test", log=logs.append))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [str(target)] * 4 and len(calls) == 1
    assert calls[0] != target and not calls[0].exists()  # built elsewhere, renamed into place
    assert sum(m.startswith("built test preset in ") and m.endswith(f"cached at {target}") for m in logs) == 1
    assert sum(m.startswith("waiting for another process") for m in logs) >= 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["preset-abc"]  # the lock file goes with its holder


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    target = tmp_path / "preset"

    def broken(folder):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        runtime.cached_build(target, broken, what="test", log=lambda m: None)
    assert list(tmp_path.iterdir()) == []  # no preset, no temporary folder, no lock file


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_build_stopped_by_a_signal_leaves_nothing_behind(tmp_path, sig, code):
    """A preset build is the first, long part of a first ``tether train``: a scheduler's SIGTERM (or Ctrl-C) then
    must not leave a temporary folder or a lock file in the cache."""
    script = (f"import pathlib, time\nfrom tether import runtime\n"
              f"def build(folder):\n    (folder / 'started').write_text('1')\n    time.sleep(60)\n"
              f"runtime.cached_build(pathlib.Path({str(tmp_path / 'preset')!r}), build, what='test')\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".preset-*/started")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".preset-*/started")), "the build did not start"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def swaps(monkeypatch) -> list[dict]:
    """The pools of every EntitySwap a build makes (what the SFT swaps draw among)."""
    made: list[dict] = []
    monkeypatch.setattr(tiny_sft, "EntitySwap", lambda pools: made.append(pools) or EntitySwap(pools))
    return made


SMALL = tiny_sft.Recipe(model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1),
                        corpus_texts=60, copy_steps=2, copy_batch_size=4, dialogue_epochs=1, full_epochs=1,
                        max_train_tasks=6)


def test_tiny_sft_preset_is_built_once_into_the_cache(tmp_path, monkeypatch, capsys, swaps):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny_sft, "RECIPE", SMALL)
    cfg = load_config([], ["model.preset=tiny-sft", "environment.num_train_tasks=10", "environment.num_eval_tasks=4"])
    path = runtime.model_path(cfg)
    err = capsys.readouterr().err
    assert "building the tiny-sft preset (one time" in err
    assert "[tiny-sft] 18 demonstrations (6 train tasks × 3, mistakes stratified)" in err
    # entity_pool: database (the default): the swaps draw among every entity of the database
    assert {c: len(v) for c, v in swaps[0].items()} == {c: len(v) for c, v in world_entities(cfg).items()}
    assert f"s, cached at {path}" in err and "built tiny-sft preset in " in err
    info = json.loads((tmp_path / "cache" / path.rsplit("/", 1)[1] / "tether_warmstart.json").read_text())
    assert info["demonstrations"] == 18 and info["recipe"]["copy_steps"] == 2
    assert runtime.model_path(cfg) == path and "build" not in capsys.readouterr().err  # cached: no second build
    assert AutoModelForCausalLM.from_pretrained(path).config.hidden_size == 64
    assert tiny_sft.cache_key(cfg, SMALL) == tiny_sft.cache_key(cfg) != tiny_sft.cache_key(cfg, tiny_sft.Recipe())


@pytest.mark.parametrize(("override", "rebuilds"), [
    ("trainer.seed=1", False),  # RL's seed: the preset has its own (Recipe.seed)
    ("environment.num_eval_tasks=8", False),  # a prefix of the world's 64 held-out tasks
    ("environment.num_eval_tasks=64", False),
    ("environment.verifier.anti_hacking.enabled=false", False),  # the expert's demonstrations are the same
    ("engine.temperature=1.0", False),
    ("environment.state.max_turns=10", False),  # the loop's reach (5 turns × 2 calls): 20 ends no episode either
    ("environment.state.max_turns=9", True),  # sampling: RL's, not the build's
    ("environment.num_eval_tasks=65", True),  # a 65th held-out task's order joins the world (and its entity token)
    ("environment.num_train_tasks=11", True),
    ("environment.seed=1", True),
    ("agent_loop.max_assistant_turns=4", True),
    ("tool_parser.name=pythonic", True),
])
def test_the_preset_is_keyed_on_what_its_weights_depend_on(override, rebuilds):
    base = ["model.preset=tiny-sft", "environment.num_train_tasks=10", "environment.num_eval_tasks=4"]
    key = tiny_sft.cache_key(load_config([], base))
    assert (tiny_sft.cache_key(load_config([], [*base, override])) != key) == rebuilds


def test_fewer_held_out_tasks_leave_the_world_and_the_train_split_as_they_are():
    small, full = generate(0, 20, 8), generate(0, 20, 64)
    assert small.image == full.image and small.train == full.train and small.eval == full.eval[:8]
    assert generate(0, 20, 65).eval[:64] == full.eval and generate(0, 20, 65).image != full.image


def test_stratified_mistakes_replay_each_task_right_and_wrong_in_exact_shares(tokenizer):
    """Recipe.mistakes / replays / mistake_rate: stratified, exactly round(replays × rate) of each task's replays carry
    the expert's mistake where one applies (a LATE refund filed DAMAGED); sampled, each replay draws its own."""
    cfg = load_config([], ["environment.num_train_tasks=40", "environment.num_eval_tasks=4"])
    tasks = CustomerServiceEnv(cfg).tasks("train")
    late, plain = (next(t for t in tasks if t.kind == "refund_stated" and t.data["reason_code"] == code)
                   for code in ("LATE", "DAMAGED"))

    def codes(**fields):
        demos = tiny_sft.imperfect_demos(cfg, [late, plain], tokenizer, tiny_sft.Recipe(**fields), seed=0)
        filed = [c["function"]["arguments"]["reason_code"] for d in demos if d.task_id == late.id for m in d.messages
                 for c in m.get("tool_calls", []) if c["function"]["name"] == "check_refund_policy"]
        return len(demos), sorted(filed)

    assert codes(mistakes="stratified", replays=5) == (10, ["DAMAGED"] * 3 + ["LATE"] * 2)  # round(5 × 0.6) = 3
    assert codes(mistakes="stratified", replays=5, mistake_rate=0.2) == (10, ["DAMAGED"] + ["LATE"] * 4)
    assert codes(mistakes="stratified", replays=2, mistake_rate=0.0) == (4, ["LATE"] * 2)
    sampled = codes(mistakes="sampled", replays=40)  # 40 draws at 0.6, one per replay: some of each
    assert sampled[0] == 80 and 10 < sampled[1].count("DAMAGED") < 40
    assert codes() == (6, ["DAMAGED"] * 2 + ["LATE"])  # the default: stratified, 3 replays, round(3 × 0.6) = 2 wrong
    with pytest.raises(ValueError, match="Recipe.replays"):
        tiny_sft.imperfect_demos(cfg, [late], tokenizer, tiny_sft.Recipe(replays=0), seed=0)
    key = tiny_sft.cache_key
    for field in ({"mistakes": "sampled"}, {"replays": 2}, {"entity_pool": "train"}):
        assert key(cfg, tiny_sft.Recipe(**field)) != key(cfg)


def test_entity_pool_train_swaps_among_the_train_demonstrations_entities_only(tmp_path, swaps):
    cfg = load_config([], ["environment.num_train_tasks=10", "environment.num_eval_tasks=4"])
    recipe = replace(SMALL, entity_pool="train", copy_steps=0, dialogue_epochs=0, full_epochs=0)
    tiny_sft.build_tiny_sft(cfg, tmp_path / "m", recipe=recipe, log=lambda m: None)
    # the 6 tasks' entities only, fewer than the database's
    assert all(0 < len(swaps[0][c]) < len(v) for c, v in world_entities(cfg).items() if c != "stock")


def test_the_preset_build_says_how_long_it_has_left_after_each_epoch():
    """EpochClock: the time left of every phase from the measured epochs; a phase not reached yet is scaled by its
    tokens per epoch from the last measured one."""
    now = [0.0]
    lines: list[str] = []
    clock = tiny_sft.EpochClock(lines.append, [("dialogue", 3, 100), ("full", 2, 400)], clock=lambda: now[0])
    log = clock.phase("dialogue")
    log("copy-free note")  # not an epoch line: passed through as is
    for _ in range(3):
        now[0] += 60.0  # a dialogue epoch: 60 s (0.6 s per token); a full one is estimated at 400 × 0.6 = 240 s
        log("sft epoch n/3: nll/token 1.0")
    log = clock.phase("full")
    now[0] += 300.0  # the first full epoch measures 300 s: the estimate follows it
    log("sft epoch 1/2: nll/token 0.5")
    assert lines == ["copy-free note",
                     "sft epoch n/3: nll/token 1.0 — about 10 min of the build left",  # 2 × 60 + 2 × 240 s
                     "sft epoch n/3: nll/token 1.0 — about 9 min of the build left",  # 60 + 480 s
                     "sft epoch n/3: nll/token 1.0 — about 8 min of the build left",  # 480 s
                     "sft epoch 1/2: nll/token 0.5 — about 5 min of the build left"]  # 300 s


def test_a_second_run_with_fewer_held_out_tasks_reuses_the_cached_preset(tmp_path, monkeypatch):
    """From an empty cache: `tether train examples/customer_service/config.yaml` builds the tiny-sft preset once; the
    same command with `--set environment.num_eval_tasks=8` (or another trainer.seed) trains from it without a build."""
    from typer.testing import CliRunner

    from tether.cli import app

    cache = tmp_path / "cache"
    monkeypatch.setenv("TETHER_CACHE", str(cache))
    monkeypatch.setattr(tiny_sft, "RECIPE", SMALL)
    quick = ["--set", "trainer.total_steps=1", "--set", "trainer.eval_tasks=4", "--set", "engine.max_tokens=16"]

    def train(run: str, *extra: str) -> str:
        result = CliRunner().invoke(app, ["train", "examples/customer_service/config.yaml", "--run-dir",
                                          str(tmp_path / run), *quick, *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    assert "building the tiny-sft preset" in train("first")
    presets = sorted(p.name for p in cache.iterdir())
    for run, extra in [("fewer_eval", ["--set", "environment.num_eval_tasks=8"]),
                       ("seed", ["--set", "trainer.seed=1"])]:
        assert "building the tiny-sft preset" not in train(run, *extra)
        assert sorted(p.name for p in cache.iterdir()) == presets
