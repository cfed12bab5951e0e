"""``StubChatServer``: a small OpenAI-compatible chat endpoint for dry runs of the judge and the user simulator.

It answers ``POST …/chat/completions`` with ``answer(body)`` (a string, a list of ``n`` strings, or an
``(HTTP status, body text)`` pair to fail) after ``delay_s`` seconds, serves ``GET …/models``, and records
what it saw: the arrival time of every request (``arrivals``, ``time.monotonic()``), the bodies, and the most
requests in flight at once (``max_in_flight``) — so that a test or benchmark can check rate limits and
concurrency caps at the server, where they matter. Threaded (one thread per request), so slow answers overlap.

    with StubChatServer(lambda body: "SCORE: 0.5", delay_s=1.0) as judge:
        cfg.reward.judge_client.base_url = judge.base_url     # http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = str | list[str] | tuple[int, str]


def window_max(times: list[float], window_s: float) -> int:
    """The most of ``times`` that fall in any window of ``window_s`` seconds (a sliding window over arrivals)."""
    ts, best, lo = sorted(times), 0, 0
    for hi, t in enumerate(ts):
        while t - ts[lo] >= window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def bucket_excess(times: list[float], start: float, per_minute: float) -> float:
    """How far the requests of ``times`` went beyond a token bucket of ``per_minute`` (burst: one second's worth, at
    least 1, as ``tether.llm.limits.TokenBucket``) full at ``start``: max over k of k − (burst + rate · (t_k − start)),
    the k-th arrival at t_k. ≤ 0 when the limit held. A request stamped late (a busy server) only lowers it, so
    unlike a sliding-window count it cannot report an excess the client did not send."""
    rate = per_minute / 60.0
    burst = max(1.0, rate)
    return max((k - (burst + rate * (t - start)) for k, t in enumerate(sorted(times), 1)), default=0.0)


class StubChatServer:
    def __init__(self, answer: Callable[[dict[str, Any]], Answer], *, delay_s: float = 0.0, model: str = "stub"):
        self.answer, self.delay_s, self.model = answer, delay_s, model
        self.arrivals: list[float] = []
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "start the server first (with StubChatServer(...) as s)"
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> StubChatServer:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                stub._reply(self, 200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]})

            def do_POST(self) -> None:
                stub._chat(self)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 1024

            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)  # a client that gave up (a timeout) is not one

        self._server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _chat(self, h: BaseHTTPRequestHandler) -> None:
        t = time.monotonic()
        body = json.loads(h.rfile.read(int(h.headers.get("content-length") or 0)) or b"{}")
        with self._lock:
            self.arrivals.append(t)
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            out = self.answer(body)
        finally:
            with self._lock:
                self.in_flight -= 1
        if isinstance(out, tuple):
            status, text = out
            data = text.encode()
            h.send_response(status)
            h.send_header("content-type", "application/json")
            h.send_header("content-length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
            return
        texts = [out] * int(body.get("n") or 1) if isinstance(out, str) else list(out)
        self._reply(h, 200, {
            "id": "stub", "object": "chat.completion", "created": int(time.time()), "model": self.model,
            "choices": [{"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": c}}
                        for i, c in enumerate(texts)],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5 * len(texts), "total_tokens": 10 + 5 * len(texts)}})

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
