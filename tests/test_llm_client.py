"""tether.llm against a loopback fault server: each fault gives its documented diagnosis and exception type,
retries happen only where they help (counted), the shared limits hold, and the key never shows.

The server (``FaultServer``) answers like vLLM's OpenAI server: bearer auth on ``/v1/*`` (its 401 echoes the
presented key, as some gateways do, so that redaction is tested), chat and completions with ``usage``, ``/v1/models``,
404 for an unknown path or model, and a FIFO ``script`` of faults to answer first.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tether.config import load_config
from tether.llm import (
    AuthError,
    BadRequest,
    ConnectionRefused,
    EndpointUnreachable,
    LLMClient,
    LLMError,
    LLMTimeout,
    MalformedKey,
    MalformedResponse,
    MissingKey,
    RateLimited,
    ServerError,
    SharedGate,
    TokenBucket,
)
from tether.metrics import JsonlSink, MetricsRecorder, set_recorder

KEY = "sk-test-SECRET-1234"
MODEL = "tiny-policy"
PING = [{"role": "user", "content": "ping"}]


@dataclass
class Answer:
    """One scripted answer: ``body`` None = the normal answer for the path."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    cut_after: int | None = None
    """Send only this many bytes of the body (Content-Length says all of them), then close."""
    delay_s: float = 0.0


class FaultServer:
    """A threaded HTTP server on 127.0.0.1 (a free port); ``with FaultServer() as s: s.base_url``."""

    def __init__(self, key: str | None = KEY, script: list[Answer] = (), delay_s: float = 0.0,
                 usage_tokens: int | None = None):
        self.key, self.script, self.delay_s, self.usage_tokens = key, deque(script), delay_s, usage_tokens
        self.requests: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FaultServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server._handle(self)

            do_POST = do_GET

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # the default backlog of 5 drops a burst's SYNs: a 1 s retransmit each
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        body = json.loads(raw) if raw else None
        auth = h.headers.get("Authorization")
        with self.lock:
            self.requests.append({"method": h.command, "path": h.path, "auth": auth, "body": body,
                                  "t": time.monotonic()})
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.key is not None and h.path.startswith("/v1") and auth != f"Bearer {self.key}":
                presented = (auth or "").removeprefix("Bearer ")
                answer = Answer(401, {"error": {"message": f"Incorrect API key provided: {presented}",
                                                "type": "invalid_request_error", "code": "invalid_api_key"}})
            else:
                with self.lock:
                    answer = self.script.popleft() if self.script else Answer()
            time.sleep(answer.delay_s or self.delay_s)
            status, payload = (answer.status, answer.body) if answer.body is not None else self._normal(h, body)
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            h.send_response(status)
            h.send_header("Content-Type", answer.headers.pop("Content-Type", "application/json"))
            for k, v in answer.headers.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data if answer.cut_after is None else data[: answer.cut_after])
            h.wfile.flush()
            if answer.cut_after is not None:
                h.close_connection = True
        finally:
            with self.lock:
                self.in_flight -= 1

    def _normal(self, h: BaseHTTPRequestHandler, body: Any) -> tuple[int, Any]:
        if h.path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        if h.path in ("/v1/chat/completions", "/v1/completions"):
            if body.get("model") != MODEL:
                return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                       "type": "NotFoundError", "code": 404}}
            n = body.get("max_tokens", 8)
            usage = {"prompt_tokens": 1, "completion_tokens": 1,
                     "total_tokens": self.usage_tokens if self.usage_tokens is not None else 2}
            if h.path == "/v1/chat/completions":
                return 200, {"id": "c1", "object": "chat.completion", "model": MODEL, "usage": usage,
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "pong"}}]}
            return 200, {"id": "c2", "object": "text_completion", "model": MODEL, "usage": usage,
                         "choices": [{"index": 0, "text": "", "token_ids": list(range(n)), "finish_reason": "length"}]}
        if h.path == "/update_weights_from_disk":
            return 200, {"success": True, "message": "updated", "echo": body}
        return 404, {"detail": "Not Found"}


def closed_port() -> int:
    """A port with nothing listening on it (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No proxy from the machine, and the key in TETHER_TEST_KEY."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "NO_PROXY",
                 "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TETHER_TEST_KEY", KEY)


def client(base_url: str, **kw: Any) -> LLMClient:
    kw = {"api_key": "${TETHER_TEST_KEY}", "model": MODEL, "max_retries": 2, "backoff_s": 0.01, "timeout_s": 5.0,
          **kw}
    return LLMClient(base_url, **kw)


def call(c: LLMClient, coro_fn: Any = None) -> Any:
    async def main() -> Any:
        async with c:
            return await (coro_fn(c) if coro_fn else c.chat(PING, max_tokens=8))
    return asyncio.run(main())


def fails(exc_type: type[LLMError], c: LLMClient, coro_fn: Any = None) -> LLMError:
    with pytest.raises(exc_type) as info:
        call(c, coro_fn)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
    return info.value


# ----------------------------------------------------------------------------- the happy path and the keys


def test_chat_sends_model_key_and_body_read_from_the_environment_at_request_time(monkeypatch):
    monkeypatch.delenv("TETHER_TEST_KEY")
    with FaultServer() as s:
        c = client(s.base_url)  # built before the variable exists: the key is read per request
        monkeypatch.setenv("TETHER_TEST_KEY", KEY)
        reply = call(c)
    assert reply["choices"][0]["message"]["content"] == "pong"
    (req,) = s.requests
    assert req["path"] == "/v1/chat/completions" and req["auth"] == f"Bearer {KEY}"
    assert req["body"] == {"model": MODEL, "messages": PING, "max_tokens": 8}
    assert (c.stats.requests, c.stats.attempts, c.stats.retries, c.stats.by_status) == (1, 1, 0, {200: 1})


def test_llm_client_section_base_url_api_key_and_model_decide_the_request(monkeypatch):
    """Flip each seed key of the ``llm_client`` section and watch the request change."""
    with FaultServer() as a, FaultServer() as b:
        sets = [f"llm_client.base_url={a.base_url}", "llm_client.api_key=${TETHER_TEST_KEY}",
                f"llm_client.model={MODEL}"]
        call(LLMClient.from_config(load_config([], sets).llm_client))
        assert [r["auth"] for r in a.requests] == [f"Bearer {KEY}"] and not b.requests

        call(LLMClient.from_config(load_config([], sets + [f"llm_client.base_url={b.base_url}"]).llm_client))
        assert len(a.requests) == 1 and len(b.requests) == 1  # base_url: the other server

        monkeypatch.setenv("OTHER_KEY", "sk-other-0000")
        other_key = load_config([], sets + ["llm_client.api_key=${OTHER_KEY}"]).llm_client
        e = fails(AuthError, LLMClient.from_config(other_key))
        assert a.requests[-1]["auth"] == "Bearer sk-other-0000" and "OTHER_KEY" in str(e)  # api_key: another key

        monkeypatch.setenv("TETHER_TEST_MODEL", "other-model")
        e = fails(BadRequest, LLMClient.from_config(
            load_config([], sets + ["llm_client.model=${TETHER_TEST_MODEL}"]).llm_client))
        assert a.requests[-1]["body"]["model"] == "other-model" and "wrong model id" in str(e)  # model


def test_unset_variable_is_named_and_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("TETHER_TEST_KEY")
    with FaultServer() as s:
        e = fails(MissingKey, client(s.base_url))
    assert not s.requests and e.config_fault and e.attempts == 0
    assert "TETHER_TEST_KEY is not set in this process" in str(e) and "worker" in str(e)


@pytest.mark.parametrize("stray, word", [("\n", "a newline"), (" ", "whitespace")])
def test_key_with_stray_whitespace_is_refused_before_sending_and_not_printed(monkeypatch, stray, word):
    monkeypatch.setenv("TETHER_TEST_KEY", KEY + stray)
    with FaultServer() as s:
        e = fails(MalformedKey, client(s.base_url))
    assert not s.requests and e.config_fault
    assert f"contains {word} (at its end)" in str(e) and "TETHER_TEST_KEY" in str(e) and KEY not in str(e)


def test_401_names_the_variable_the_process_and_is_not_retried(monkeypatch):
    monkeypatch.setenv("TETHER_TEST_KEY", "sk-wrong-KEY-9999")
    with FaultServer() as s:
        e = fails(AuthError, client(s.base_url))
    msg = str(e)
    assert e.status == 401 and e.attempts == 1 and len(s.requests) == 1
    assert "refused the key from environment variable TETHER_TEST_KEY" in msg and "pid" in msg
    assert "Incorrect API key provided: ***" in msg  # the server echoed the key: redacted
    assert "sk-wrong-KEY-9999" not in msg and "sk-wrong-KEY-9999" not in e.body


def test_no_key_configured_says_none_was_sent():
    with FaultServer() as s:
        e = fails(AuthError, client(s.base_url, api_key=None))
    assert s.requests[0]["auth"] is None and "no key was sent (llm_client.api_key is not set)" in str(e)


def test_base_url_ending_in_v1_v1_is_diagnosed_on_the_401_and_the_404(monkeypatch):
    with FaultServer() as s:
        e404 = fails(BadRequest, client(s.base_url + "/v1"))
        monkeypatch.setenv("TETHER_TEST_KEY", "sk-wrong-KEY-9999")
        e401 = fails(AuthError, client(s.base_url + "/v1"))
    assert s.requests[0]["path"] == "/v1/v1/chat/completions"
    for e in (e404, e401):
        assert "repeats /v1/v1: /v1 was appended to a base_url that already ends in it" in str(e)
    assert str(e401).index("/v1/v1") < str(e401).index("TETHER_TEST_KEY")  # the likeliest cause first


# ----------------------------------------------------------------------------- retries: only where they help


def test_429_with_retry_after_is_waited_for_then_succeeds():
    rec = MetricsRecorder()
    prev = set_recorder(rec)
    try:
        with FaultServer(script=[Answer(429, {"error": {"message": "slow down"}}, {"Retry-After": "1"})]) as s:
            c = client(s.base_url)
            t = time.monotonic()
            reply = call(c)
            took = time.monotonic() - t
    finally:
        set_recorder(prev)
    assert reply["choices"] and (c.stats.attempts, c.stats.retries) == (2, 1) and len(s.requests) == 2
    assert 1.0 <= took < 2.0  # Retry-After: 1 honoured over a 10 ms backoff
    assert s.requests[1]["t"] - s.requests[0]["t"] >= 1.0
    assert rec.flush(0)["llm/retries"] == 1


@pytest.mark.parametrize("max_retries", [0, 2])
def test_429_every_time_is_rate_limited_after_max_retries(max_retries):
    script = [Answer(429, {"error": {"message": "Rate limit reached"}}, {"Retry-After": "0"})] * 5
    with FaultServer(script=script) as s:
        e = fails(RateLimited, client(s.base_url, max_retries=max_retries))
    assert e.attempts == len(s.requests) == 1 + max_retries
    assert "requests_per_minute" in str(e) and "Rate limit reached" in str(e)


def test_retry_after_beyond_the_limit_is_not_waited_for():
    with FaultServer(script=[Answer(429, {"error": {"message": "quota"}}, {"Retry-After": "3600"})]) as s:
        e = fails(RateLimited, client(s.base_url, max_retry_after_s=5))
    assert e.attempts == 1 and "Retry-After: 3600" in str(e)


def test_500_then_200_is_retried_and_succeeds():
    with FaultServer(script=[Answer(500, {"error": {"message": "CUDA out of memory"}})]) as s:
        c = client(s.base_url)
        assert call(c)["choices"]
    assert (c.stats.attempts, c.stats.retries, c.stats.by_status) == (2, 1, {500: 1, 200: 1})


@pytest.mark.parametrize("max_retries", [0, 3])
def test_500_every_time_is_a_server_error_after_max_retries(max_retries):
    with FaultServer(script=[Answer(503, {"error": {"message": "CUDA out of memory"}})] * 5) as s:
        e = fails(ServerError, client(s.base_url, max_retries=max_retries))
    assert e.attempts == len(s.requests) == 1 + max_retries and e.status == 503
    assert "the server failed" in str(e) and "CUDA out of memory" in str(e)


def test_closed_port_is_refused_names_host_and_port_and_is_retried():
    port = closed_port()
    c = client(f"http://127.0.0.1:{port}/v1")
    e = fails(ConnectionRefused, c)
    assert e.attempts == c.stats.attempts == 3  # 1 + max_retries: a server that is starting up answers later
    assert f"connection to 127.0.0.1:{port} refused" in str(e) and "the request never left" in str(e)
    assert "no proxy variable is set" in str(e)


def test_a_proxy_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", f"http://user:pw@127.0.0.1:{closed_port()}")
    with FaultServer() as s:
        e = fails(EndpointUnreachable, client(s.base_url, max_retries=0))
    assert not s.requests and "HTTP_PROXY is set (proxy 127.0.0.1:" in str(e) and "NO_PROXY=127.0.0.1" in str(e)
    assert "pw" not in str(e)


def test_body_cut_off_mid_transfer_is_malformed_and_not_retried():
    with FaultServer(script=[Answer(200, {"choices": [{"message": {"content": "a long answer " * 20}}]},
                                    cut_after=40)]) as s:
        e = fails(MalformedResponse, client(s.base_url))
    assert e.attempts == len(s.requests) == 1
    assert "the body was cut off after 40 bytes" in str(e) and '{"choices": [{"message": {"content": "a ' in str(e)


def test_truncated_json_body_is_malformed_and_shows_the_raw_body():
    with FaultServer(script=[Answer(200, b'{"id": "c1", "choices": [{"mess')]) as s:
        e = fails(MalformedResponse, client(s.base_url))
    assert e.attempts == 1 and "not complete JSON" in str(e) and '{"id": "c1", "choices": [{"mess' in e.body


@pytest.mark.parametrize("body, ctype, first_cause", [
    ({"object": "error", "message": "model not found: tiny"}, "application/json", "a wrong model id"),
    ({"error": {"message": "Rate limit exceeded, retry later"}}, "application/json", "a rate-limit answer"),
    ({"choices": []}, "application/json", "a wrong model id"),
    (b"<html><body>Sign in to the proxy</body></html>", "text/html", "a non-generation response"),
])
def test_200_without_choices_prints_the_raw_body_and_the_likely_cause_first(body, ctype, first_cause):
    with FaultServer(script=[Answer(200, body, {"Content-Type": ctype})]) as s:
        e = fails(MalformedResponse, client(s.base_url))
    causes = str(e).split("Likely causes:")[1]
    assert e.attempts == 1 and causes.strip().startswith(f"- {first_cause}"), str(e)
    assert "raw body" in str(e) and (body if isinstance(body, bytes) else json.dumps(body).encode()).decode() in e.body


def test_long_bodies_are_truncated_to_about_500_characters():
    with FaultServer(script=[Answer(200, {"data": "x" * 5000})]) as s:
        e = fails(MalformedResponse, client(s.base_url))
    assert len(e.body) < 600 and "more characters" in e.body


def test_timeout_s_decides_between_an_answer_and_a_timeout_which_is_not_retried():
    with FaultServer(delay_s=0.4) as s:
        e = fails(LLMTimeout, client(s.base_url, timeout_s=0.15))
        assert e.attempts == 1 and "within 0.15 s (llm_client.timeout_s)" in str(e)
        assert call(client(s.base_url, timeout_s=3.0))["choices"]


# ----------------------------------------------------------------------------- other endpoints


def test_completions_with_token_ids_and_extensions_and_root_endpoints():
    with FaultServer() as s:
        c = client(s.base_url)
        out = call(c, lambda c: c.completions([1, 2, 3], max_tokens=4, return_token_ids=True, stop_token_ids=[7]))
        assert out["choices"][0]["token_ids"] == [0, 1, 2, 3]
        assert s.requests[-1]["body"] == {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4,
                                          "return_token_ids": True, "stop_token_ids": [7]}
        assert call(c, lambda c: c.models()) == [MODEL]
        done = call(c, lambda c: c.post("/update_weights_from_disk", {"model_path": "/ckpt/step_3"}))
        assert done["success"] and s.requests[-1]["path"] == "/update_weights_from_disk"
    assert c.url_for("/health") == s.base_url.removesuffix("/v1") + "/health"
    assert c.url_for("models") == s.base_url + "/models"
    assert LLMClient("https://gw.example/api/v1").url_for("/health") == "https://gw.example/api/health"


# ----------------------------------------------------------------------------- shared limits


def _two_threads(base_url: str, per_thread: int, **kw: Any) -> list[LLMClient]:
    """Two clients of one endpoint, each on its own thread and event loop, ``per_thread`` concurrent calls."""
    clients = [client(base_url, **kw) for _ in range(2)]

    async def burst(c: LLMClient) -> None:
        async with c:
            await asyncio.gather(*(c.chat(PING, max_tokens=8) for _ in range(per_thread)))

    threads = [threading.Thread(target=asyncio.run, args=(burst(c),)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return clients


@pytest.mark.parametrize("cap", [3, 6])
def test_max_concurrency_is_shared_by_clients_on_two_threads(cap):
    with FaultServer(delay_s=0.1) as s:
        clients = _two_threads(s.base_url, 8, max_concurrency=cap)
    assert len(s.requests) == 16 and sum(c.stats.attempts for c in clients) == 16
    assert s.max_in_flight == cap  # reached, never passed: the cap is the endpoint's, not each client's
    assert clients[0].limits is clients[1].limits


@pytest.mark.parametrize("rpm", [None, 300])
def test_requests_per_minute_spaces_requests_as_computed(rpm):
    # 300/min = 5 per second, burst 5: requests 1-5 at once, then one every 0.2 s, the 10th at 1.0 s (arrival
    # times are counted from before the burst: a request can arrive late, never early)
    with FaultServer() as s:
        t0 = time.monotonic()
        clients = _two_threads(s.base_url, 5, requests_per_minute=rpm)
    start = sorted(r["t"] - t0 for r in s.requests)
    waited = sum(c.stats.limit_wait_s for c in clients)
    if rpm is None:
        assert waited == 0
    else:  # waits of 0.2 + 0.4 + 0.6 + 0.8 + 1.0 s, less what refills while the first requests are sent
        assert all(start[k] >= 0.2 * (k - 4) - 0.01 for k in range(5, 10)) and start[-1] < 1.6, start
        assert 1.0 <= waited <= 3.0


def test_tokens_per_minute_spaces_requests_by_their_tokens():
    # 2400 tokens/min = 40/s, burst 40; each call: 10 prompt ids + max_tokens 10 = 20 tokens (usage confirms 20),
    # so calls 1-2 start at once, call 3 at 0.5 s, call 4 at 1.0 s
    with FaultServer(usage_tokens=20) as s:
        c = client(s.base_url, tokens_per_minute=2400)

        async def four(c: LLMClient) -> None:
            await asyncio.gather(*(c.completions(list(range(10)), max_tokens=10) for _ in range(4)))
        t0 = time.monotonic()
        call(c, four)
    t = sorted(r["t"] - t0 for r in s.requests)
    assert t[2] >= 0.49 and t[3] >= 0.99 and t[3] < 1.5, t
    assert c.stats.limit_wait_s == pytest.approx(1.5, abs=0.2)  # 0 + 0 + 0.5 + 1.0, less the refill while they queue


def test_token_bucket_and_gate_by_hand():
    b = TokenBucket(per_minute=120)  # 2/s, burst 2
    assert [round(b.reserve(), 2) for _ in range(4)] == [0.0, 0.0, 0.5, 1.0]
    b.refund(3)  # a smaller answer than estimated gives the difference back
    assert round(b.reserve(), 1) == 0.0

    async def main() -> list[str]:
        gate, order = SharedGate(1), []

        async def hold(name: str, s: float) -> None:
            await gate.acquire()
            order.append(name)
            await asyncio.sleep(s)
            gate.release()
        first = asyncio.create_task(hold("a", 0.05))
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(hold("never", 0))
        late = asyncio.create_task(hold("b", 0))
        await asyncio.sleep(0.01)
        cancelled.cancel()  # a waiter cancelled in the queue takes no slot
        await asyncio.gather(first, late, return_exceptions=True)
        assert gate.in_use == 0
        return order
    assert asyncio.run(main()) == ["a", "b"]


# ----------------------------------------------------------------------------- the key never shows


def test_the_key_appears_in_no_exception_log_metric_or_file(tmp_path, caplog, capsys, monkeypatch):
    import logging

    caplog.set_level(logging.DEBUG)  # httpx and httpcore included
    rec = MetricsRecorder([JsonlSink(tmp_path / "metrics.jsonl")])
    prev = set_recorder(rec)
    seen: list[str] = []
    echo = Answer(200, {"error": {"message": f"bad request from key {KEY}"}})  # a body that holds the key
    try:
        with FaultServer(script=[echo, Answer(500, {"detail": f"key={KEY}"})] * 3) as s:
            for _ in range(2):
                with pytest.raises(LLMError) as info:
                    call(client(s.base_url, max_retries=0))
                e = info.value
                seen += [str(e), repr(e), e.body or "", "".join(traceback.format_exception(e))]
            monkeypatch.setenv("TETHER_TEST_KEY", "sk-wrong-" + KEY)
            with pytest.raises(AuthError) as info:
                call(client(s.base_url))
            seen += [str(info.value), info.value.body, "".join(traceback.format_exception(info.value))]
        with pytest.raises(ConnectionRefused) as info:
            call(client(f"http://127.0.0.1:{closed_port()}/v1", max_retries=1))
        seen.append("".join(traceback.format_exception(info.value)))
        rec.flush(0)
    finally:
        set_recorder(prev)
        rec.close()
    out = capsys.readouterr()
    assert "send_request_headers" in caplog.text and "retry 1/1" in caplog.text  # httpcore's and ours, captured
    seen += [caplog.text, out.out, out.err]
    assert "bad request from key ***" in seen[0] and "key=***" in seen[4]  # the bodies were shown, redacted
    for text in seen:
        assert KEY not in text
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and not any(KEY.encode() in p.read_bytes() for p in files)
