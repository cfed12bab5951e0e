"""`tether verify consistency`: the training path against `tether serve` over the OpenAI protocol.

End to end through the real CLI and entry points on the shared tiny model: a passing case (the serve renders the
training path's prompt token for token, rate 1.0), a serving template whose generation prompt lost its newline
(rate 0, "chat template" named at task 1 turn 1), a tools line rendered differently plus a smaller deployment
max_tokens ("tool schema rendering", then "sampling settings"). The match-rate arithmetic and the tokenizer
diagnosis are checked on hand-made turns.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from tether.cli import app
from tether.learner.tiny import CHAT_TEMPLATE
from tether.verify.consistency import ConsistencyReport, TaskResult, check_consistency, diagnose
from tether.verify.consistency_paths import MALFORMED, Episode, Settings, Turn, action_of

CONFIG = """
environment: {num_train_tasks: 8, num_eval_tasks: 4}
engine: {max_tokens: 12}
agent_loop: {max_assistant_turns: 2, max_user_turns: 2}
"""
GEN_PROMPT = "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
TOOL_LINE = "f.name + '('"
runner = CliRunner()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("consistency")
    (root / "cfg.yaml").write_text(CONFIG)
    assert GEN_PROMPT in CHAT_TEMPLATE and TOOL_LINE in CHAT_TEMPLATE
    # The classic hand-edited serving template: the generation prompt without its newline.
    (root / "no_newline.jinja").write_text(CHAT_TEMPLATE.replace(GEN_PROMPT, GEN_PROMPT.replace("\\n", "")))
    # Tools listed as `name (params)` instead of `name(params)`.
    (root / "tools.jinja").write_text(CHAT_TEMPLATE.replace(TOOL_LINE, "f.name + ' ('"))
    (root / "bad.jinja").write_text("{% if messages %}unclosed")
    return root, tiny_model


def verify(*args: str):
    return runner.invoke(app, ["verify", "consistency", *args], catch_exceptions=False)


def test_same_checkpoint_served_as_trained_matches_every_action(setup):
    root, model = setup
    result = verify(model, "--config", str(root / "cfg.yaml"), "--tasks", "2")
    assert result.exit_code == 0, result.output
    assert "action match rate 2/2 = 1.000 (must be > 0.9): PASS" in result.output
    # The server rendered the OpenAI messages + tool schemas to exactly the training path's prompt ids.
    assert "prompts token-identical on 2 of 2 turns" in result.output
    assert "cause:" not in result.output and "first prompt difference" not in result.output


def test_serving_template_that_differs_is_named_chat_template(setup):
    root, model = setup
    result = verify(model, "--config", str(root / "cfg.yaml"), "--tasks", "2",
                    "--chat-template", str(root / "no_newline.jinja"))
    assert result.exit_code == 1, result.output
    # The 1-layer model ends its turn at once after "assistant\n" and talks after "assistant": every turn differs.
    assert "action match rate 0/4 = 0.000 (must be > 0.9): FAIL" in result.output
    assert "first divergence: task test_000, turn 1" in result.output
    assert "training:   (no action)" in result.output
    assert "cause: chat template" in result.output
    # The evidence: the training prompt has one more token, the newline the served template dropped.
    assert "outside the tools part: training [205] '\\n' vs deployment [] ''" in result.output


@pytest.fixture(scope="module")
def chatty_model(setup):
    """The tiny model's architecture and tokenizer with sharper random weights: it writes text that depends on
    its prompt (the shared model ends every turn at once)."""
    root, model = setup
    out = root / "chatty"
    cfg = AutoConfig.from_pretrained(model)
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def test_tools_rendered_differently_and_a_smaller_max_tokens_are_both_found(setup, chatty_model):
    from tether.config import load_config

    root, _ = setup
    cfg = load_config([root / "cfg.yaml"], [])
    report = check_consistency(chatty_model, cfg, num_tasks=2, chat_template=(root / "tools.jinja").read_text(),
                               deploy_sampling={"max_tokens": 4}, log=lambda m: None)
    assert report.rate <= 0.9 and not report.passed
    d = report.diagnosis
    assert d is not None and (d.task_id, d.turn) == ("test_000", 0)
    assert d.cause == "tool schema rendering"
    assert "inside the tools part" in d.detail[0] and "'(order_id, reason_code' vs deployment" in d.detail[0]
    assert "training '\\ncheck_refund_policy(order_id" in d.detail[1]
    assert "deployment '\\ncheck_refund_policy (order_id" in d.detail[1]
    assert "also sampling settings: max_tokens training 12 vs deployment 4" in d.detail
    # The turn-1 outputs: at most 4 tokens on the deployment side, up to 12 on the training side.
    first = report.results[0]
    assert len(first.deploy.turns[0].output_ids) <= 4 < len(first.train.turns[0].output_ids)
    assert report.prompt_pairs >= 2 and report.same_prompts == 0


# ---------------------------------------------------------------------------------------------- by hand


GREEDY = Settings(0.0, 1.0, 12, (9,))


def turn(action, prompt=(1, 2, 3), out=(7,), settings=GREEDY) -> Turn:
    return Turn(tuple(action), list(prompt), list(out), settings)


A = [("query_inventory", '{"sku_id": "S-1"}')]
B = [("respond_to_user", '{"message": "hi"}')]


def test_match_rate_is_the_common_prefix_over_the_longer_sequence():
    # Task 1: A B A vs A A A B -> the prefix [A] matches (the later A agreeing is chance): 1 of max(3, 4) = 4.
    one = TaskResult("t1", Episode("t1", [turn(A), turn(B), turn(A)]),
                     Episode("t1", [turn(A), turn(A), turn(A), turn(B)]))
    # Task 2: identical A B -> 2 of 2.  Task 3: both took no turn -> 0 of 0.
    two = TaskResult("t2", Episode("t2", [turn(A), turn(B)]), Episode("t2", [turn(A), turn(B)]))
    three = TaskResult("t3", Episode("t3"), Episode("t3"))
    report = ConsistencyReport([one, two, three], None, 0.0)
    assert (one.matched, one.compared, two.matched, two.compared, three.compared) == (1, 4, 2, 2, 0)
    assert (report.matched, report.compared) == (3, 6) and report.rate == 0.5 and not report.passed
    # 10 of 11 passes (0.909 > 0.9); 9 of 10 does not (0.9 is not above 0.9).
    assert ConsistencyReport([TaskResult("x", Episode("x", [turn(A)] * 11),
                                         Episode("x", [turn(A)] * 10 + [turn(B)]))], None, 0.0).passed
    assert not ConsistencyReport([TaskResult("x", Episode("x", [turn(A)] * 10),
                                             Episode("x", [turn(A)] * 9 + [turn(B)]))], None, 0.0).passed


def test_actions_read_as_the_agent_loop_reads_them():
    names = {"respond_to_user", "query_inventory"}
    assert action_of([("query_inventory", {"sku_id": "S-1", "a": 1})], [], "", names) == (
        ("query_inventory", '{"a": 1, "sku_id": "S-1"}'),)  # arguments in canonical JSON
    assert action_of([], [], "  Your refund is approved. \n", names) == (
        ("respond_to_user", '{"message": "Your refund is approved."}'),)
    assert action_of([], [], "hello", {"query_inventory"}) == ()  # no user tool: a text turn is no action
    assert action_of([], ["unterminated <tool_call> block"], "", names) == ((MALFORMED, "unterminated <tool_call> "
                                                                                       "block"),)


def test_same_text_with_other_token_ids_is_the_tokenizer(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    whole = tok.encode("refund", add_special_tokens=False)
    split = tok.encode("ref", add_special_tokens=False) + tok.encode("und", add_special_tokens=False)
    assert whole != split and tok.decode(whole) == tok.decode(split) == "refund"
    head = tok.encode("hello ", add_special_tokens=False)
    result = TaskResult("t", Episode("t", [turn(A), turn(A, prompt=head + whole)]),
                        Episode("t", [turn(A), turn(B, prompt=head + split)]))
    d = diagnose(result, tok)
    assert (d.turn, d.cause) == (1, "tokenizer")
    assert f"the prompts differ from token {len(head)}" in d.detail[0] and "decode to the same text" in d.detail[0]


def test_same_prompt_other_temperature_is_the_sampling_settings(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    result = TaskResult("t", Episode("t", [turn(A)]), Episode("t", [turn(B, settings=Settings(0.7, 1.0, 12, (9,)))]))
    d = diagnose(result, tok)
    assert (d.cause, d.detail) == ("sampling settings", ["temperature training 0.0 vs deployment 0.7"])
    same = TaskResult("t", Episode("t", [turn(A, out=[5, 6])]), Episode("t", [turn(B, out=[5, 8])]))
    assert diagnose(same, tok).cause == "generation"
    assert diagnose(TaskResult("t", Episode("t", [turn(A)]), Episode("t", [turn(B)])), tok).cause == \
        "tool-call parsing"


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, message", [
    (["--split", "dev"], "--split 'dev': choose one of heldout, train"),
    (["--top-p", "0"], "--top-p 0.0: must be above 0"),
    (["--chat-template", "{root}/missing.jinja"], "missing.jinja: cannot read it"),
    (["--chat-template", "{root}/bad.jinja"], "not a valid Jinja template"),
])
def test_bad_input_exits_2(setup, args, message):
    root, model = setup
    result = verify(model, "--config", str(root / "cfg.yaml"), *[a.format(root=root) for a in args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_not_a_checkpoint_exits_2(setup):
    root, _ = setup
    result = verify(str(root), "--config", str(root / "cfg.yaml"))
    assert result.exit_code == 2 and "is not a checkpoint folder" in result.output


def test_serve_chat_template_option_reaches_the_server(setup, monkeypatch):
    root, model = setup
    seen = {}
    monkeypatch.setattr("tether.serve.server.serve", lambda *a, **kw: seen.update(kw))
    result = runner.invoke(app, ["serve", model, "--port", "0", "--chat-template", str(root / "tools.jinja")])
    assert result.exit_code == 0, result.output
    assert seen["chat_template"] == Path(root / "tools.jinja").read_text()
    bad = runner.invoke(app, ["serve", model, "--chat-template", str(root / "bad.jinja")])
    assert bad.exit_code == 2 and "not a valid Jinja template" in bad.output


def test_text_that_does_not_retokenize_to_its_own_ids_is_the_tokenizer(setup, chatty_model):
    """Served with its own template, the random model's turn-1 text goes back to the server as text; its ids
    differ from the ones the model generated (verl's "never re-tokenize"), so turn 2's prompts differ."""
    from tether.config import load_config

    root, _ = setup
    report = check_consistency(chatty_model, load_config([root / "cfg.yaml"], []), num_tasks=2, log=lambda m: None)
    d = report.diagnosis
    assert d is not None and d.turn == 1 and d.cause == "tokenizer", d
    assert "but decode to the same text" in d.detail[0]
    first = next(r for r in report.results if r.task_id == d.task_id)
    # Turn 1 was the same prompt (ids and all), the same action, and the same generated ids on both paths.
    assert first.train.turns[0].prompt_ids == first.deploy.turns[0].prompt_ids
    assert first.train.turns[0].output_ids == first.deploy.turns[0].output_ids
