"""`tether serve` as a server people run: errors as OpenAI and vLLM answer them, the key checked before the body is
read, bodies bounded, abandoned requests aborted in the engine, weight updates off unless allowed and confined to a
folder (issue 29, items 1, 2, 4, 7).

The server wraps a real LocalEngine over the tests' tiny model (uvicorn in a thread on a free port), driven by the
official `openai` package where it can send the request and by httpx where it cannot (malformed bodies).
"""

from __future__ import annotations

import copy
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from tether.agent import chat as agent_chat
from tether.engine.local import LocalEngine
from tether.learner.model import load_model_and_tokenizer
from tether.serve import ServerThread, make_app
from tether.serve.gate import default_request_bytes
from tether.serve.server import exposure_warning, is_loopback

KEY = "sk-tether-TEST-7a1c0e"
ASK = [{"role": "user", "content": "Where is my order O-1234?"}]


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model_and_tokenizer(tiny_model)


@contextmanager
def serving(loaded, **kw):
    model, tokenizer = loaded
    with LocalEngine(copy.deepcopy(model)) as engine, \
            ServerThread(make_app(engine, tokenizer, model_name="tiny", **kw)) as server:
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def server(loaded):
    with serving(loaded, max_request_bytes=4 << 20) as s:
        yield s


def client(server, key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, **kw)


def in_engine(engine: LocalEngine) -> int:
    """Requests the engine holds: running in slots, queued, waiting to be queued."""
    return len(engine._slots.running) + len(engine._queue) + len(engine._waiting)


# ------------------------------------------------------------------------------------------------------ errors


def test_validation_errors_are_bad_requests_naming_the_field(server):
    c = client(server)

    def refused(**kw) -> dict:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(**{"model": "tiny", "messages": ASK, "max_tokens": 4, **kw})
        assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error"
        return err.value.body

    assert refused(temperature=5)["param"] == "temperature"
    assert refused(n=0)["param"] == "n"
    unknown = refused(extra_body={"best_of_luck": 1})
    assert unknown["param"] == "best_of_luck" and "unknown parameter" in unknown["message"]
    content = refused(messages=[{"role": "user", "content": 10}])
    assert content["param"] == "messages.0.content", content
    seed = refused(seed=2**63)
    assert seed["param"] == "seed" and "9223372036854775807" in seed["message"], seed
    assert refused(seed=2**63 - 1, n=2)["param"] == "seed"  # choice 1 would sample with 2**63
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt=[[1, 2], "text", 3], max_tokens=2)
    assert err.value.body["param"].startswith("prompt")


def test_malformed_bodies_and_routes_say_what_is_wrong(server):
    url = server.base_url + "/v1/chat/completions"
    r = httpx.post(url, content=b'{"model": "tiny",\n "messages": [}', headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the body is not valid JSON: Expecting value at line 2 column 15"
    assert r.json()["error"]["param"] is None and r.json()["error"]["code"] == "invalid_json"

    r = httpx.post(url, content=b"model=tiny", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "a JSON object" in r.json()["error"]["message"]

    with pytest.raises(openai.NotFoundError) as err:  # a base URL without /v1
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).chat.completions.create(
            model="tiny", messages=ASK, max_tokens=2)
    assert "the OpenAI routes are under /v1" in err.value.body["message"]
    r = httpx.get(server.base_url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /v1/nothing"


def test_the_key_is_checked_before_the_body_is_read(loaded):
    with serving(loaded, api_key=KEY) as s:
        url = s.base_url + "/v1/chat/completions"
        for body in (b"{not json", b'{"model": "tiny"}', b"x" * (40 << 20)):  # malformed, invalid, over the bound
            r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.post(url, content=b"{not json", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        with pytest.raises(openai.AuthenticationError):
            client(s, "sk-wrong").chat.completions.create(model="tiny", messages=ASK, max_tokens=2)


# ---------------------------------------------------------------------------------- size bounds, event loop


def test_the_default_bound_follows_the_models_context(loaded):
    assert default_request_bytes(None) == 32 << 20  # unknown context
    assert default_request_bytes(4096) == 4 << 20 and default_request_bytes(131072) == 16 << 20
    model, tokenizer = loaded
    with LocalEngine(copy.deepcopy(model)) as engine:
        app = make_app(engine, tokenizer, model_name="tiny")
        assert app.state.max_request_bytes == default_request_bytes(model.config.max_position_embeddings)


def test_a_body_over_the_bound_is_413_and_health_answers_meanwhile(server, loaded):
    _, tokenizer = loaded
    c = client(server, timeout=60)
    huge = "order " * (3 << 20)  # 18 MiB of text
    with pytest.raises(openai.APIStatusError) as err:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": huge}], max_tokens=2)
    assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"
    assert "--max-request-bytes" in err.value.body["message"]

    # Under the bound but far over the context: refused before rendering, in a worker, while /health answers.
    big = "order " * (600 << 10)  # 3.5 MiB
    cached = len(agent_chat._render_caches[tokenizer].entries) if tokenizer in agent_chat._render_caches else 0
    answers: list = []

    def send() -> None:
        for _ in range(3):
            try:
                c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": big}], max_tokens=2)
            except openai.BadRequestError as e:
                answers.append(e.body)

    senders = [threading.Thread(target=send) for _ in range(2)]
    for t in senders:
        t.start()
    waits = []
    while any(t.is_alive() for t in senders):
        t0 = time.perf_counter()
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        waits.append(time.perf_counter() - t0)
        time.sleep(0.02)
    assert len(answers) == 6 and all(a["code"] == "context_length_exceeded" for a in answers), answers
    assert waits and max(waits) < 0.5, waits

    # A prompt that renders over the context is refused and not kept in the render cache.
    long = " ".join(f"O-{i}" for i in range(3000))
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}], max_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded"
    assert len(agent_chat._render_caches.get(tokenizer, agent_chat._RenderCache()).entries) == cached


def test_the_render_cache_is_bounded_in_bytes(loaded, monkeypatch):
    _, tokenizer = loaded
    monkeypatch.setattr(agent_chat, "_RENDER_CACHE_BYTES", 64 << 10)
    monkeypatch.setattr(agent_chat, "_render_caches", type(agent_chat._render_caches)())
    for i in range(300):
        agent_chat.render_ids(tokenizer, [{"role": "user", "content": f"order {i} " * 20}], None,
                              add_generation_prompt=True)
    cache = agent_chat._render_caches[tokenizer]
    assert 0 < cache.nbytes <= 64 << 10 and len(cache.entries) < 300
    assert cache.nbytes == sum(cache.size(k, v) for k, v in cache.entries.items())
    agent_chat.render_ids(tokenizer, [{"role": "user", "content": "x " * 20000}], None, add_generation_prompt=True)
    assert all(len(k) < 20000 for k in cache.entries)  # over a sixteenth of the budget: never kept


# ------------------------------------------------------------------------------------------- sampling parameters


def test_sampling_parameters_act_and_unknown_ones_are_refused(server, loaded):
    _, tokenizer = loaded
    c = client(server)
    prompt = tokenizer.encode("Where is my order", add_special_tokens=False)

    def ids(**kw) -> list[int]:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=kw.pop("max_tokens", 12),
                                 extra_body={"return_token_ids": True, "ignore_eos": True, **kw.pop("extra", {})}, **kw)
        return r.choices[0].model_extra["token_ids"]

    greedy = ids(temperature=0)
    assert ids(temperature=1, seed=3, extra={"top_k": 1}) == greedy  # top_k = 1 is greedy whatever the temperature
    assert ids(temperature=1, seed=3, extra={"top_k": -1}) == ids(temperature=1, seed=3)  # vLLM's "off"
    assert ids(temperature=0, logit_bias={str(greedy[0] + 1): 100})[0] == greedy[0] + 1
    assert ids(temperature=0, extra={"repetition_penalty": 3.0}, max_tokens=24) != ids(temperature=0, max_tokens=24)
    assert ids(temperature=0, frequency_penalty=2.0, max_tokens=24) != ids(temperature=0, max_tokens=24)

    # A stop string: cut before it, or kept with include_stop_str_in_output; none before min_tokens.
    text = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = text[2:5]
    assert stop and text.find(stop) == 2
    cut = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True}).choices[0]
    kept = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert cut.text == text[:2] and kept.text == text[:5] and cut.finish_reason == kept.finish_reason == "stop"
    late = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                extra_body={"ignore_eos": True, "min_tokens": 6, "return_token_ids": True}).choices[0]
    assert late.finish_reason == "stop" and len(late.text) > len(cut.text) and text.startswith(late.text + stop)
    assert len(late.model_extra["token_ids"]) >= 6

    for extra, param in [({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
                         ({"top_k": -2}, "top_k"),
                         ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"10000000": 1}}, "logit_bias"),
                         ({"min_tokens": 50}, "min_tokens"), ({"min_p": 1.5}, "min_p")]:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, extra_body=extra)
        assert err.value.body["param"] == param, (extra, err.value.body)


def test_chat_template_kwargs_reach_the_template(loaded):
    model, tokenizer = loaded
    thinking = copy.deepcopy(tokenizer)  # a template with a variable, as Qwen3's enable_thinking
    thinking.chat_template = tokenizer.chat_template + "{% if enable_thinking %}<think>\n{% endif %}"
    with LocalEngine(copy.deepcopy(model)) as engine, ServerThread(make_app(engine, thinking, model_name="tiny")) as s:
        c = client(s)

        def prompt(**template_kwargs) -> list[int]:
            extra = {"return_token_ids": True, **({"chat_template_kwargs": template_kwargs} if template_kwargs else {})}
            r = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0, extra_body=extra)
            return r.model_extra["prompt_token_ids"]

        plain, off, on = prompt(), prompt(enable_thinking=False), prompt(enable_thinking=True)
    assert plain == off and on[:len(plain)] == plain
    assert thinking.decode(on[len(plain):]) == "<think>\n"


# ------------------------------------------------------------------------------------------------ cancellation


def wait_until(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_disconnected_request_is_aborted_and_frees_its_slots(server):
    engine, url = server.engine, server.base_url
    aborted = httpx.get(url + "/health").json()["serve/aborted"]
    heavy = {"model": "tiny", "messages": ASK, "n": 32, "max_tokens": 3000, "extra_body": {"ignore_eos": True}}
    with pytest.raises(openai.APITimeoutError):
        client(server, timeout=0.5).chat.completions.create(**heavy)
    assert wait_until(lambda: in_engine(engine) == 0, 2.0), in_engine(engine)
    assert httpx.get(url + "/health").json()["serve/aborted"] == aborted + 1

    # Streamed: the client reads the first chunk and closes the connection.
    stream = client(server).chat.completions.create(**heavy, stream=True)
    next(iter(stream))
    assert wait_until(lambda: in_engine(engine) > 0, 2.0)
    stream.close()
    assert wait_until(lambda: in_engine(engine) == 0, 2.0), in_engine(engine)
    assert wait_until(lambda: httpx.get(url + "/health").json()["serve/aborted"] == aborted + 2, 2.0)

    ok = client(server).chat.completions.create(model="tiny", messages=ASK, max_tokens=4)  # still serving
    assert ok.choices[0].finish_reason in ("stop", "length")


# -------------------------------------------------------------------------------------------- weight updates


def test_weight_updates_are_off_without_a_key_or_the_flag(server, loaded, tmp_path):
    for path, body in [("/update_weights_from_tensor", b"x"), ("/update_lora_adapter_from_tensor?scaling=1", b"x"),
                       ("/update_weights_from_disk", b'{"model_path": "/tmp"}'),
                       ("/v1/load_lora_adapter", b'{"lora_name": "a", "lora_path": "/tmp"}'),
                       ("/v1/unload_lora_adapter", b'{"lora_name": "a"}')]:
        r = httpx.post(server.base_url + path, content=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "weight_updates_disabled", (path, r.text)
        assert "--enable-weight-updates" in r.json()["error"]["message"]
    with serving(loaded, api_key=KEY) as s:  # a key allows them: the body is read and refused on its merits
        r = httpx.post(s.base_url + "/update_weights_from_tensor", content=b"x",
                       headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and "not safetensors" in r.json()["error"]["message"]
        assert httpx.post(s.base_url + "/update_weights_from_tensor", content=b"x").status_code == 401


def test_paths_must_lie_under_the_weights_root(loaded, tmp_path):
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    (root / "step_1").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with serving(loaded, weight_updates=True, weights_root=root) as s:
        def update(path) -> httpx.Response:
            return httpx.post(s.base_url + "/update_weights_from_disk", json={"model_path": str(path)})

        refused = {p: update(p) for p in (outside, tmp_path / "missing", root / ".." / "elsewhere", root / "link")}
        for p, r in refused.items():
            assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed", r.text
            assert r.json()["error"]["message"] == (f"model_path {str(p)!r} is not under this server's weights "
                                                    f"root {str(root.resolve())!r} (tether serve --weights-root)")
        inside = update(root / "step_1")
        assert inside.status_code == 400 and "no *.safetensors" in inside.json()["error"]["message"]
        lora = httpx.post(s.base_url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(outside)})
        assert lora.status_code == 403 and lora.json()["error"]["param"] == "lora_path"
    with serving(loaded, weight_updates=True) as s:  # no root: no path is read
        r = httpx.post(s.base_url + "/update_weights_from_disk", json={"model_path": str(root / "step_1")})
        assert r.status_code == 403 and "--weights-root" in r.json()["error"]["message"]


def test_a_reachable_host_without_a_key_is_warned_about():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "myhost.example"))
    warning = exposure_warning("0.0.0.0", None, True)
    assert warning is not None and "--api-key-env" in warning and "replace the weights" in warning
    assert exposure_warning("0.0.0.0", KEY, True) is None and exposure_warning("127.0.0.1", None, True) is None


@pytest.mark.parametrize("args, expected", [
    ([], {"weight_updates": False, "weights_root": None, "max_request_bytes": None, "stream_interval": None,
          "latency_rows": 4}),
    (["--enable-weight-updates", "--weights-root", "/srv/runs", "--max-request-bytes", "1000",
      "--stream-interval", "8", "--latency-rows", "0"],
     {"weight_updates": True, "weights_root": "/srv/runs", "max_request_bytes": 1000, "stream_interval": 8,
      "latency_rows": 0})])
def test_the_serve_flags_reach_the_server(tiny_model, monkeypatch, args, expected):
    from typer.testing import CliRunner

    from tether.cli import app
    from tether.serve import server as serve_module

    seen = {}
    monkeypatch.setattr(serve_module, "serve", lambda *a, **kw: seen.update(kw))
    result = CliRunner().invoke(app, ["serve", tiny_model, *args])
    assert result.exit_code == 0, result.output
    got = {k: (None if seen[k] is None else str(seen[k])) if k == "weights_root" else seen[k] for k in expected}
    assert got == expected
    assert serve_module.LATENCY_ROWS == 4  # the Python entry points' default is the command's


@pytest.mark.parametrize("value", ["0", "x", "-2", "1.5"])
def test_a_bad_stream_interval_is_refused_naming_the_flag(tiny_model, value):
    from typer.testing import CliRunner

    from tether.cli import app

    result = CliRunner().invoke(app, ["serve", tiny_model, "--stream-interval", value])
    assert result.exit_code != 0 and f"--stream-interval {value}" in result.output and "auto" in result.output


def test_uvicorn_runs_on_uvloop_and_httptools():
    """The pinned uvloop and httptools are what uvicorn picks (serve_throughput --pin: 0.83 -> 0.91 of in-process)."""
    import uvloop
    from fastapi import FastAPI

    from tether.serve.http import uvicorn_config

    config = uvicorn_config(FastAPI(), log_level="warning", grace_s=1)
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    assert config.get_loop_factory() is uvloop.new_event_loop
