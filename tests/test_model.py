"""The tiny preset: deterministic build, HF round trip, tokenizer ids, chat template with tools."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.learner import build_tiny, ensure_tiny, load_model_and_tokenizer
from tether.learner.tiny import CONTROL_TOKENS, TOOL_TOKENS, builtin_corpus, train_tokenizer

CORPUS = ["The refund for order ORD-5521 was approved.",
          '{"name": "lookup_customer", "arguments": {"email": "a@b.c"}}']
STRINGS = [
    "Hello world!", "  two  spaces\tand\ttabs\n\nnewlines\r\n",
    "Où est ma commande ? Größe: 42 — 価格 ¥1200 😀",
    '{"name": "query_inventory", "arguments": {"sku_id": "SKU-10234", "count": 3.75}}',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>",
    "<tool_response>\nok\n</tool_response>", "1234567890 -0.5e10 don't I'll we're", "",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny(tmp_path_factory.mktemp("tiny"), CORPUS, seed=0)


def test_build_is_deterministic(tiny, tmp_path):
    again = build_tiny(tmp_path / "again", CORPUS, seed=0)
    assert Path(tiny, "tokenizer.json").read_text() == Path(again, "tokenizer.json").read_text()
    a, b = load_file(Path(tiny, "model.safetensors")), load_file(Path(again, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = load_file(Path(build_tiny(tmp_path / "seed1", CORPUS, seed=1), "model.safetensors"))
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_config_is_the_tiny_qwen2(tiny):
    model, tok = load_model_and_tokenizer(tiny)
    cfg = model.config
    assert cfg.model_type == "qwen2" and type(model).__name__ == "Qwen2ForCausalLM"
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert shape == (4, 256, 4, 2)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings >= 4096
    assert tok.model_max_length == cfg.max_position_embeddings
    assert cfg.vocab_size == len(tok) == 2048  # every id the model can sample decodes
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_save_load_round_trip_gives_identical_logits(tiny, tmp_path):
    model, tok = load_model_and_tokenizer(tiny)
    plain = AutoModelForCausalLM.from_pretrained(tiny).eval()  # the plain HF path loads it too
    model.save_pretrained(tmp_path / "copy")
    tok.save_pretrained(tmp_path / "copy")
    copy, tok2 = load_model_and_tokenizer(tmp_path / "copy")
    ids = torch.tensor([tok.encode(STRINGS[3]) + tok.encode(STRINGS[4])])
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(ref, plain(ids).logits)
        assert torch.equal(ref, copy(ids).logits)
    assert all(tok.encode(s) == tok2.encode(s) for s in STRINGS)


def test_reloaded_tokenizer_gives_the_trained_ids(tiny):
    """AutoTokenizer rebuilds Qwen2's pre-tokenizer from code: it must agree with what we trained."""
    trained = train_tokenizer([*builtin_corpus(), *CORPUS])
    loaded = AutoTokenizer.from_pretrained(tiny)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    for s in STRINGS:
        assert loaded.encode(s) == trained.encode(s) == trained.backend_tokenizer.encode(s).ids, s
        assert loaded.decode(loaded.encode(s)) == s
    # the built-in corpus makes tool traffic compact
    assert len(loaded.encode(STRINGS[3])) <= len(STRINGS[3]) // 2
    assert len(loaded.encode("query_inventory check_refund_policy escalate_to_human")) <= 10


def test_special_tokens_are_single_ids(tiny):
    _, tok = load_model_and_tokenizer(tiny)
    ids = [tok.encode(t) for t in (*CONTROL_TOKENS, *TOOL_TOKENS)]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 7
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    gen = AutoModelForCausalLM.from_pretrained(tiny).generation_config
    assert gen.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # control tokens are special (dropped by skip_special_tokens), tool tags stay for the parser
    ids = tok.encode("<|im_start|>assistant\n<tool_call>\nx\n</tool_call><|im_end|>")
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "assistant\n<tool_call>\nx\n</tool_call>"


TOOL = {"type": "function", "function": {
    "name": "get_order", "description": "Look up an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is A1?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_order", "arguments": {"order_id": "A1"}}},
        {"type": "function", "function": {"name": "get_order", "arguments": '{"order_id": "B2"}'}}]},  # JSON string
    {"role": "tool", "content": '{"status": "shipped"}'},
    {"role": "tool", "content": '{"status": "late"}'},  # consecutive tool results: one user turn
    {"role": "assistant", "content": "A1 shipped."},
]
EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n"
    "get_order(order_id): Look up an order.\n</tools>\n"
    'To call a tool, reply with:\n<tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhere is A1?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "A1"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "B2"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n"
    '<tool_response>\n{"status": "shipped"}\n</tool_response>\n'
    '<tool_response>\n{"status": "late"}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\nA1 shipped.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chat_template_renders_tools_calls_and_results(tiny):
    _, tok = load_model_and_tokenizer(tiny)
    text = tok.apply_chat_template(MESSAGES, tools=[TOOL], add_generation_prompt=True, tokenize=False)
    assert text == EXPECTED
    ids = tok.apply_chat_template(MESSAGES, tools=[TOOL], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == tok.encode(EXPECTED)
    # no system message and no tools: no system turn at all (contexts stay small)
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # content before a tool call, OpenAI-less call format (name/arguments at top level)
    msgs = [{"role": "assistant", "content": "Checking.", "tool_calls": [{"name": "f", "arguments": {}}]}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n')


def test_ensure_tiny_builds_once(tmp_path):
    first = ensure_tiny(tmp_path, CORPUS, seed=3, num_hidden_layers=1)
    stamp = Path(first, "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny(tmp_path, CORPUS, seed=3, num_hidden_layers=1) == first
    assert Path(first, "model.safetensors").stat().st_mtime_ns == stamp
    assert ensure_tiny(tmp_path, CORPUS, seed=4, num_hidden_layers=1) != first
    assert AutoModelForCausalLM.from_pretrained(first).config.num_hidden_layers == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building")]


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_and_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_tokenizer(tmp_path, dtype="float8")
