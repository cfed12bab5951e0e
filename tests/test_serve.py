"""`tether serve` on loopback, driven by the official `openai` package, httpx and curl.

The server wraps a real LocalEngine over the tests' tiny model (uvicorn in a thread on a free port); the tool-call
tests serve a ScriptedEngine, whose output is known, through the same app. One test starts the real command
(`python -m tether.cli serve`) in a subprocess and talks to it with curl, as the source document's ping check does.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
from safetensors.torch import save
from typer.testing import CliRunner

from tether.agent.chat import render_ids
from tether.engine.local import LocalEngine
from tether.engine.scripted import ScriptedEngine
from tether.learner.model import load_model_and_tokenizer
from tether.serve import ServerThread, make_app
from tether.serve.weights import state_bytes

KEY = "sk-tether-TEST-5f1e2d"  # recognisable, so that a leak would be visible
TOOLS = [{"type": "function", "function": {
    "name": "get_order_status", "description": "Look up an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]
ASK = [{"role": "system", "content": "You are a support agent."},
       {"role": "user", "content": "Where is my order O-1234?"}]


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model_and_tokenizer(tiny_model)


@contextmanager
def serving(engine, tokenizer, **kw):
    app = make_app(engine, tokenizer, model_name=kw.pop("model_name", "tiny"), **kw)
    with ServerThread(app) as server:
        yield server


def client(server, key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, **kw)


@pytest.fixture(scope="module")
def server(loaded):
    """A server over a LocalEngine whose weights no test changes."""
    model, tokenizer = loaded
    with LocalEngine(copy.deepcopy(model)) as engine, serving(engine, tokenizer) as s:
        yield s


def forward_logprobs(model, prompt: list[int], ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced log_softmax(logits / T) of ``ids`` after ``prompt``: what the trainer recomputes."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


# ------------------------------------------------------------------------------------------------------ chat


def test_models_health_and_chat_usage(server, loaded):
    _, tokenizer = loaded
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok", "weight_version": 0, "serve/aborted": 0}

    r = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, seed=1,
                                  extra_body={"return_token_ids": True})
    prompt = render_ids(tokenizer, ASK, None, add_generation_prompt=True)  # the agent loop's rendering
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert r.model_extra["prompt_token_ids"] == prompt
    ids = choice.model_extra["token_ids"]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids) <= 8
    assert r.usage.total_tokens == len(prompt) + len(ids)
    shown = ids[:-1] if choice.finish_reason == "stop" else ids
    assert choice.message.content == tokenizer.decode(shown, skip_special_tokens=False)
    assert choice.model_extra["weight_versions"] == [0] * len(ids)


def test_chat_logprobs_and_top_logprobs(server, loaded):
    model, _ = loaded
    r = client(server).chat.completions.create(model="tiny", messages=ASK, max_tokens=10, temperature=0,
                                               logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 10
    for e in entries:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or "\ufffd" in e.token


def test_stream_equals_non_stream(server):
    c = client(server)
    kw = dict(model="tiny", messages=ASK, max_tokens=12, temperature=1.0, seed=5, logprobs=True)
    full = c.chat.completions.create(**kw).choices[0]
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    streamed = [e.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert text == full.message.content
    assert streamed == pytest.approx([e.logprob for e in full.logprobs.content], abs=1e-6)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_stream_ends_with_done_line(server):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_n_choices_are_seeded(server):
    c = client(server)
    kw = dict(model="tiny", messages=ASK, max_tokens=8, temperature=1.0, n=3, seed=7)
    first, again = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    texts = [ch.message.content for ch in first.choices]
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in again.choices]  # choice i samples with seed + i
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == sum(len(ch.model_extra["weight_versions"]) for ch in first.choices)


def test_stop_string_and_stop_token_ids(server):
    c = client(server)
    kw = dict(model="tiny", prompt="Where is my order", max_tokens=16, temperature=1.0, seed=11)
    base = c.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    ids = base.model_extra["token_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stopped = c.completions.create(**kw, extra_body={"return_token_ids": True, "stop_token_ids": [ids[k]]}).choices[0]
    assert stopped.model_extra["token_ids"] == ids[: k + 1]  # the stop id is kept in the token fields ...
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == ids[k]
    assert base.text.startswith(stopped.text)  # ... and left out of the text
    cut = base.text[len(base.text) // 2:][:3]
    at = base.text.find(cut)
    by_string = c.completions.create(**kw, stop=[cut]).choices[0]
    assert by_string.text == base.text[:at] and by_string.finish_reason == "stop"


def test_completions_batch_numbering_and_stream(server):
    c = client(server)
    r = c.completions.create(model="tiny", prompt=["Where is", "Is SKU-1 in"], n=2, max_tokens=3, seed=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]  # choice p * n + i
    assert r.usage.completion_tokens == 12
    streamed = list(c.completions.create(model="tiny", prompt=["Where is", "Is SKU-1 in"], n=2, max_tokens=3,
                                         seed=2, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for ch in streamed:
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {ch.index: ch.text for ch in r.choices}
    assert streamed[-1].usage.completion_tokens == 12


# ------------------------------------------------------------------------------------------------ tools


def scripted(tokenizer, *texts):
    return ScriptedEngine(tokenizer, list(texts), logprob=-0.5, version=4)


CALL = 'Let me check.\n<tool_call>\n{"name": "get_order_status", "arguments": {"order_id": "O-1234"}}\n</tool_call>'


def test_tool_calls_parsed_as_in_training(loaded):
    _, tokenizer = loaded
    engine = scripted(tokenizer, CALL, "It has shipped.")
    with serving(engine, tokenizer) as s:
        c = client(s)
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
        choice = r.choices[0]
        assert engine.prompts[0] == render_ids(tokenizer, ASK, TOOLS, add_generation_prompt=True)
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_order_status"
        assert json.loads(call.function.arguments) == {"order_id": "O-1234"}
        assert choice.model_extra["weight_versions"] == [4] * r.usage.completion_tokens

        # The next turn, with the call's arguments as a JSON string on the wire, renders the tokens the agent
        # loop renders from its own messages (arguments as objects).
        history = [*ASK, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "shipped"}]
        r2 = c.chat.completions.create(model="tiny", messages=history, tools=TOOLS)
        loop_view = [*ASK, {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_order_status", "arguments": {"order_id": "O-1234"}}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "shipped"}]
        assert engine.prompts[1] == render_ids(tokenizer, loop_view, TOOLS, add_generation_prompt=True)
        assert r2.choices[0].message.content == "It has shipped." and r2.choices[0].finish_reason == "stop"


def streamed_calls(chunks) -> dict[int, tuple[str, str, str]]:
    """index → (id, name, arguments) of streamed tool calls, put together as the OpenAI SDK's clients do: id and name
    from the call's first delta, the arguments appended from each."""
    calls: dict[int, tuple[str, str, str]] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, "a call's first delta names it"
                calls[tc.index] = (tc.id, tc.function.name, tc.function.arguments or "")
            else:
                assert tc.id is None and tc.function.name is None
                ident, name, args = calls[tc.index]
                calls[tc.index] = (ident, name, args + tc.function.arguments)
    return calls


def test_tool_calls_streamed_and_tool_choice(loaded):
    _, tokenizer = loaded
    broken = '<tool_call>\n{"name": "get_order_status", "arguments": {"order_id": }\n</tool_call>'
    engine = scripted(tokenizer, CALL, CALL, broken)
    with serving(engine, tokenizer) as s:
        c = client(s)
        chunks = list(c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True))
        assert [(k, name, json.loads(args)) for k, (_, name, args) in streamed_calls(chunks).items()] == [
            (0, "get_order_status", {"order_id": "O-1234"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        none = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none").choices[0]
        assert engine.prompts[1] == render_ids(tokenizer, ASK, None, add_generation_prompt=True)  # no tools shown
        assert none.message.content == CALL and none.message.tool_calls is None and none.finish_reason == "stop"

        malformed = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS).choices[0]
        assert malformed.message.tool_calls is None and malformed.message.content == broken

        with pytest.raises(openai.BadRequestError) as err:  # a scripted engine cannot follow a grammar
            c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required")
        assert "cannot follow a grammar" in err.value.body["message"]
        assert len(engine.prompts) == 3  # refused before it replayed a text


# --------------------------------------------------------------------------------- token-in / token-out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_ids_in_logprobs_match_a_forward_pass(server, loaded, temperature):
    """8 concurrent prompts (batched by the engine); each choice's logprobs equal the teacher-forced ones."""
    model, tokenizer = loaded
    prompts = [render_ids(tokenizer, [{"role": "user", "content": f"order O-{i}{i} is late"}], TOOLS,
                          add_generation_prompt=True) for i in range(8)]

    async def ask(c: openai.AsyncOpenAI, prompt: list[int], seed: int):
        r = await c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=temperature,
                                       seed=seed, logprobs=0, extra_body={"return_token_ids": True})
        return r.choices[0]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(ask(c, p, i) for i, p in enumerate(prompts)))

    worst = 0.0
    for prompt, choice in zip(prompts, asyncio.run(main())):
        ids = choice.model_extra["token_ids"]
        assert choice.model_extra["prompt_token_ids"] == prompt and len(ids) == len(choice.logprobs.token_logprobs)
        assert choice.model_extra["weight_versions"] == [0] * len(ids)
        expected = forward_logprobs(model, prompt, ids, temperature)
        worst = max(worst, (torch.tensor(choice.logprobs.token_logprobs) - expected).abs().max().item())
    assert worst < 1e-4, worst
    print(f"\nserved behaviour logprobs vs teacher-forced forward, T={temperature}: max abs diff {worst:.2e}")


# ---------------------------------------------------------------------------------------- weight updates


def perturbed(model, seed: int):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return other


def test_weight_updates_change_generation_and_version(loaded, tmp_path):
    model, tokenizer = loaded
    prompt = render_ids(tokenizer, ASK, TOOLS, add_generation_prompt=True)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
            "return_token_ids": True}
    with LocalEngine(copy.deepcopy(model)) as engine, \
            serving(engine, tokenizer, weight_updates=True, weights_root=tmp_path) as s:
        url = s.base_url

        def greedy() -> dict:
            return httpx.post(url + "/v1/completions", json=body).json()["choices"][0]

        before = greedy()
        new = perturbed(model, 1)
        r = httpx.post(url + "/update_weights_from_tensor", params={"weight_version": 3},
                       content=state_bytes(new.state_dict()),
                       headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200 and r.json()["success"] is True and r.json()["weight_version"] == 3
        assert httpx.get(url + "/get_weight_version").json() == {"weight_version": 3}
        after = greedy()
        assert after["token_ids"] != before["token_ids"] and after["weight_versions"] == [3] * len(after["token_ids"])
        diff = (torch.tensor(after["logprobs"]["token_logprobs"]) - forward_logprobs(new, prompt, after["token_ids"]))
        assert diff.abs().max().item() < 1e-4

        folder = tmp_path / "step_5"
        perturbed(model, 2).save_pretrained(folder)
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(folder), "weight_version": 5})
        assert r.status_code == 200 and r.json()["weight_version"] == 5, r.text
        from_disk = greedy()
        assert from_disk["weight_versions"] == [5] * len(from_disk["token_ids"])
        reloaded, _ = load_model_and_tokenizer(folder)
        diff = torch.tensor(from_disk["logprobs"]["token_logprobs"]) - forward_logprobs(reloaded, prompt,
                                                                                        from_disk["token_ids"])
        assert diff.abs().max().item() < 1e-4
        assert httpx.get(url + "/v1/models").json()["data"][0]["weight_version"] == 5

        # Refused updates leave the served version alone, each with an error naming what is wrong.
        bad = [httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")}),
               httpx.post(url + "/update_weights_from_tensor", content=b"not safetensors"),
               httpx.post(url + "/update_weights_from_tensor", content=save({"no.such.weight": torch.zeros(2)})),
               httpx.post(url + "/update_weights_from_tensor",
                          content=save({"model.norm.weight": torch.zeros(7)}))]
        assert [b.status_code for b in bad] == [400] * 4
        assert "not a folder" in bad[0].json()["error"]["message"]
        assert "no.such.weight" in bad[2].json()["error"]["message"]
        assert "model.norm.weight" in bad[3].json()["error"]["message"]
        assert httpx.get(url + "/get_weight_version").json() == {"weight_version": 5}


# ------------------------------------------------------------------------------------------ errors, auth


def test_errors_answer_in_openai_shape(server):
    c, url = client(server), server.base_url

    def error(exc_type, **kw) -> dict:
        with pytest.raises(exc_type) as err:
            c.chat.completions.create(**{"model": "tiny", "messages": ASK, "max_tokens": 4, **kw})
        assert set(err.value.body) == {"message", "type", "param", "code"}
        return err.value.body

    assert error(openai.NotFoundError, model="nope")["code"] == "model_not_found"
    assert error(openai.BadRequestError, temperature=5)["param"] == "temperature"
    assert error(openai.BadRequestError, extra_body={"best_of_luck": 1})["param"] == "best_of_luck"
    assert error(openai.BadRequestError, top_logprobs=2)["param"] == "top_logprobs"
    assert error(openai.BadRequestError, presence_penalty=2.5)["param"] == "presence_penalty"
    assert error(openai.BadRequestError, max_tokens=10**6)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt=[1, 2, 10**7], max_tokens=2)
    assert "outside the vocabulary" in err.value.body["message"]

    for response, status in [(httpx.get(url + "/v1/nothing"), 404), (httpx.get(url + "/v1/chat/completions"), 405),
                             (httpx.post(url + "/v1/chat/completions", content=b"{not json"), 400),
                             (httpx.post(url + "/v1/completions", json={"model": "tiny"}), 400)]:
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_bearer_key_accepted_and_refused(loaded, capfd):
    model, tokenizer = loaded
    with LocalEngine(copy.deepcopy(model)) as engine, serving(engine, tokenizer, api_key=KEY) as s:
        ok = client(s, KEY).chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
        assert ok.choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError) as err:
            client(s, "sk-wrong").chat.completions.create(model="tiny", messages=ASK, max_tokens=4)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        refused = [httpx.get(s.base_url + "/v1/models"),
                   httpx.post(s.base_url + "/update_weights_from_disk", json={"model_path": "/tmp"}),
                   httpx.get(s.base_url + "/get_weight_version", headers={"Authorization": f"Basic {KEY}"})]
        assert [r.status_code for r in refused] == [401, 401, 401]
        assert all(KEY not in r.text for r in refused)
        assert httpx.get(s.base_url + "/health").status_code == 200  # liveness needs no key
    out, err_text = capfd.readouterr()
    assert KEY not in out + err_text


# --------------------------------------------------------------------------------------- the real command


def test_cli_serve_refuses_a_missing_key_variable(tiny_model, monkeypatch):
    from tether.cli import app

    monkeypatch.delenv("TETHER_SERVE_NO_SUCH_KEY", raising=False)
    result = CliRunner().invoke(app, ["serve", tiny_model, "--api-key-env", "TETHER_SERVE_NO_SUCH_KEY"])
    assert result.exit_code == 2 and "TETHER_SERVE_NO_SUCH_KEY" in result.output
    result = CliRunner().invoke(app, ["serve", "/nonexistent/checkpoint"])
    assert result.exit_code == 2 and "not a checkpoint folder" in result.output


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_cli_serve_answers_curl(tiny_model, tmp_path):
    """`tether serve CHECKPOINT --port 0 --api-key-env VAR`, then the source document's ping with curl."""
    env = {**os.environ, "TETHER_SERVE_TEST_KEY": KEY, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "tether.cli", "serve", tiny_model, "--port", "0",
                             "--api-key-env", "TETHER_SERVE_TEST_KEY", "--served-model-name", "tiny"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, port = time.monotonic() + 120, None
        while port is None:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            found = re.search(r"serving model .* on http://127\.0\.0\.1:(\d+)/v1", (tmp_path / "serve.log").read_text())
            port = int(found.group(1)) if found else time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        while "Application startup complete" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        ping = '{"model": "tiny", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 8}'

        def curl(*headers: str) -> tuple[int, dict]:
            out = subprocess.run(["curl", "-sS", "--noproxy", "*", "-w", "\n%{http_code}", url, *headers,
                                  "-H", "Content-Type: application/json", "-d", ping],
                                 capture_output=True, text=True, timeout=60, check=True).stdout
            body, _, code = out.rpartition("\n")
            return int(code), json.loads(body)

        code, body = curl("-H", f"Authorization: Bearer {KEY}")
        assert code == 200 and isinstance(body["choices"][0]["message"]["content"], str)
        code, body = curl("-H", "Authorization: Bearer sk-wrong")
        assert code == 401 and body["error"]["code"] == "invalid_api_key"
    finally:
        proc.terminate()
        rc = proc.wait(timeout=30)
    text = (tmp_path / "serve.log").read_text()
    assert rc in (0, -signal.SIGTERM) and "Application shutdown complete" in text, text  # uvicorn re-raises it
    assert KEY not in text and "$TETHER_SERVE_TEST_KEY" in text
