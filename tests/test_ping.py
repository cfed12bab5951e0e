"""``tether ping`` against the loopback fault server: the reply and latency, or the diagnosis, with exit 0 / 1 / 2
for ok / endpoint fault / bad config; the key never shows in the output."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from test_llm_client import KEY, MODEL, FaultServer, clean_env, closed_port  # noqa: F401 — fixture
from tether.cli import app

runner = CliRunner()


def ping(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["ping", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    text = result.output  # stdout and stderr, as a terminal shows them
    assert KEY not in text
    return result.exit_code, " ".join(text.split())  # the console's wrapping undone


def test_ping_prints_the_reply_and_the_latency():
    with FaultServer() as s:
        code, out = ping("--base-url", s.base_url, "--model", MODEL, "--api-key-env", "TETHER_TEST_KEY")
    assert code == 0 and re.search(rf"ok: {MODEL} at {s.base_url} replied 'pong' in \d+ ms", out), out
    (req,) = s.requests
    assert req["body"] == {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 8}


def test_ping_reads_the_endpoint_from_a_config_file(tmp_path):
    with FaultServer() as s:
        cfg = tmp_path / "client.yaml"
        cfg.write_text(f'llm_client:\n  base_url: {s.base_url}\n  api_key: "${{TETHER_TEST_KEY}}"\n  model: {MODEL}\n')
        code, out = ping("--config", str(cfg))
        assert code == 0 and "replied 'pong'" in out
        code, out = ping("--config", str(cfg), "--set", "llm_client.model=other")
    assert code == 1 and "wrong model id" in out and f"the server lists these model ids: {MODEL}" in out
    assert not any(KEY.encode() in p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p != cfg)


def test_ping_with_a_wrong_key_gives_the_401_diagnosis(monkeypatch):
    monkeypatch.setenv("WRONG_KEY", "sk-wrong-KEY-9999")
    with FaultServer() as s:
        code, out = ping("--base-url", s.base_url, "--model", MODEL, "--api-key-env", "WRONG_KEY")
    assert code == 1 and "AuthError: HTTP 401" in out and "environment variable WRONG_KEY" in out
    assert "sk-wrong-KEY-9999" not in out and len(s.requests) == 1


def test_ping_on_a_closed_port_names_host_and_port():
    port = closed_port()
    code, out = ping("--base-url", f"http://127.0.0.1:{port}/v1", "--model", MODEL, "--api-key-env", "TETHER_TEST_KEY")
    assert code == 1 and f"connection to 127.0.0.1:{port} refused" in out and "the request never left" in out
    assert "(1 attempt in" in out  # ping sends one request: no retries


@pytest.mark.parametrize("key_env", ["TETHER_TEST_KEY", "WRONG_KEY"])
def test_ping_on_a_base_url_ending_in_v1_v1_says_so(monkeypatch, key_env):
    monkeypatch.setenv("WRONG_KEY", "sk-wrong-KEY-9999")
    with FaultServer() as s:
        code, out = ping("--base-url", s.base_url + "/v1", "--model", MODEL, "--api-key-env", key_env)
    assert code == 1 and "repeats /v1/v1: /v1 was appended to a base_url that already ends in it" in out, out


def test_ping_bad_config_exits_2(monkeypatch):
    monkeypatch.delenv("TETHER_TEST_KEY")
    with FaultServer() as s:
        code, out = ping("--base-url", s.base_url, "--model", MODEL, "--api-key-env", "TETHER_TEST_KEY")
        assert code == 2 and "TETHER_TEST_KEY is not set in this process" in out and not s.requests
        monkeypatch.setenv("TETHER_TEST_KEY", KEY + "\n")
        code, out = ping("--base-url", s.base_url, "--model", MODEL, "--api-key-env", "TETHER_TEST_KEY")
        assert code == 2 and "contains a newline" in out and not s.requests
    assert ping("--base-url", "ftp://x", "--model", MODEL)[0] == 2
    assert ping("--model", MODEL) == (2, "error: no endpoint: llm_client.base_url is the placeholder https://api."
                                         "example.com/v1; give --base-url URL or a --config file that sets it")
    assert ping("--base-url", "http://127.0.0.1:1/v1", "--api-key-env", "sk-literal")[0] == 2


def test_ping_against_tether_serve_on_the_tiny_model(tiny_model, monkeypatch):
    """The real server (``tether serve``'s app over a LocalEngine): the reply, then the 401 and /v1/v1 diagnoses."""
    from tether.engine.local import LocalEngine
    from tether.learner.model import load_model_and_tokenizer
    from tether.serve import ServerThread, make_app

    model, tokenizer = load_model_and_tokenizer(tiny_model)
    monkeypatch.setenv("WRONG_KEY", "sk-wrong-KEY-9999")
    with LocalEngine(model) as engine, ServerThread(make_app(engine, tokenizer, model_name="tiny", api_key=KEY)) as s:
        url = s.base_url + "/v1"
        code, out = ping("--base-url", url, "--model", "tiny", "--api-key-env", "TETHER_TEST_KEY")
        assert code == 0 and re.search(rf"ok: tiny at {url} replied '.*' in \d+ ms", out), out
        code, out = ping("--base-url", url, "--model", "tiny", "--api-key-env", "WRONG_KEY")
        assert code == 1 and "AuthError: HTTP 401" in out and "environment variable WRONG_KEY" in out, out
        code, out = ping("--base-url", url + "/v1", "--model", "tiny", "--api-key-env", "TETHER_TEST_KEY")
        assert code == 1 and "repeats /v1/v1" in out, out
        code, out = ping("--base-url", url, "--model", "no-such-model", "--api-key-env", "TETHER_TEST_KEY")
        assert code == 1 and "the server lists these model ids: tiny" in out, out
    assert "sk-wrong-KEY-9999" not in out
