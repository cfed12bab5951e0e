"""``LLMClient``: one OpenAI-compatible endpoint, async, with shared limits, retries and diagnoses.

Requests go through, in order: the key is read (``keys.KeySource``), the endpoint's token bucket takes the
estimated tokens once per call, then each attempt takes the request bucket and a concurrency slot
(``limits``), is sent, and is either returned, retried after a jittered backoff, or raised as the
``errors`` type that says what to check. The slot is held while a body is read and given back before a
backoff sleep, so a waiting retry does not block other callers.

Backoff before retry k (k = 1, 2, …): ``d = min(max_backoff_s, backoff_s * 2**(k-1))``, a uniform draw in
``[d/2, d]`` ("equal jitter": spread out, yet never near zero), and never less than the server's
``Retry-After``. A ``Retry-After`` above ``max_retry_after_s`` is not waited for: ``RateLimited`` at once,
naming it.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tether.llm.errors import (
    AuthError,
    BadRequest,
    EndpointUnreachable,
    LLMError,
    LLMTimeout,
    MalformedResponse,
    RateLimited,
    ServerError,
    display_url,
    doubled,
    doubled_segment,
    malformed_causes,
    redact,
    server_message,
    truncated,
    unreachable,
)
from tether.llm.keys import KeySource
from tether.llm.limits import EndpointLimits, limits_for
from tether.metrics import record_metric
from tether.secrets import interpolate

log = logging.getLogger("tether.llm")

_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504}) | frozenset(range(505, 600))


@dataclass
class ClientStats:
    """Counters of one client (``LLMClient.stats``)."""

    requests: int = 0
    """Calls (chat, completions, post, …)."""
    attempts: int = 0
    """HTTP requests sent (a retried call counts each)."""
    retries: int = 0
    failures: int = 0
    """Calls that raised."""
    by_status: dict[int, int] = field(default_factory=dict)
    """Answers received, per HTTP status."""
    limit_wait_s: float = 0.0
    """Seconds spent waiting for the rate limits (not the concurrency cap)."""


class LLMClient:
    """An OpenAI-compatible endpoint: ``chat``, ``completions``, ``models``, and ``post`` / ``get`` for the
    server's other endpoints.

    ``base_url`` ends in ``/v1`` (``http://host:8000/v1``) and is used as given: nothing is appended, so a
    ``/v1/v1`` there is a doubled path (diagnosed on the 401/404 it causes). A ``path`` without a leading ``/``
    is relative to ``base_url`` (``"chat/completions"``); a path with one is relative to the *server root*,
    which is ``base_url`` less its final ``/v1`` segment (``http://host:8000/v1`` → ``http://host:8000``;
    ``https://gw/api/v1`` → ``https://gw/api``; a ``base_url`` not ending in ``/v1`` is its own root), where
    vLLM and SGLang serve ``/health`` and ``/update_weights_from_disk``.

    ``api_key``: None, a string (literal or ``${VAR}``) or a ``Secret``, read at each request (``keys``);
    ``key_path``: the config key it came from, for messages (default: the Secret's own, else ``llm_client.api_key``).
    Limits (``max_concurrency``, ``requests_per_minute``, ``tokens_per_minute``) are shared with every
    client of the same ``(base_url, model)`` in this process (``limits``). One client may be used from several
    event loops and threads (an HTTP connection pool per loop).
    """

    def __init__(self, base_url: str, api_key: Any = None, model: str = "", *, timeout_s: float = 60.0,
                 max_retries: int = 3, max_concurrency: int = 64, requests_per_minute: float | None = None,
                 tokens_per_minute: float | None = None, backoff_s: float = 0.5, max_backoff_s: float = 20.0,
                 max_retry_after_s: float = 60.0, key_path: str | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {display_url(base_url)!r}")
        self.base_url = base_url.rstrip("/")
        self.root_url = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.key = KeySource(api_key, key_path)
        self.section = self.key.key_path.removesuffix(".api_key")
        """The endpoint's section in the config (``reward.judge_client``), named in messages."""
        self.limits: EndpointLimits = limits_for(self.base_url, model, max_concurrency=max_concurrency,
                                                 requests_per_minute=requests_per_minute,
                                                 tokens_per_minute=tokens_per_minute)
        self.stats = ClientStats()
        self._stats_lock = threading.Lock()  # callers on several threads share the counters
        self._http: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}  # a connection pool per event loop

    @classmethod
    def from_config(cls, section: Any, **overrides: Any) -> LLMClient:
        """A client from an endpoint section (``tether.config.sections.LLMClientConfig``: ``llm_client``,
        ``reward.judge_client``, ``environment.user_llm.client``, ``teacher.remote``): ``base_url`` and ``model``
        are resolved now (``${VAR}``; a missing variable is a ConfigError), the key at each request. Errors name
        the section's own keys (its ``key_path``)."""
        where = getattr(section, "key_path", "llm_client")
        kwargs: dict[str, Any] = dict(
            base_url=interpolate(section.base_url, f"{where}.base_url"), api_key=section.api_key,
            model=interpolate(section.model, f"{where}.model"), timeout_s=section.timeout_s,
            max_retries=section.max_retries, max_concurrency=section.max_concurrency,
            requests_per_minute=section.requests_per_minute, tokens_per_minute=section.tokens_per_minute,
            key_path=f"{where}.api_key")
        return cls(**{**kwargs, **overrides})

    # ------------------------------------------------------------------------- the API

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """POST ``chat/completions``; the parsed body, with a non-empty ``choices`` (else MalformedResponse).
        ``params`` go into the body as given (``max_tokens``, ``tools``, ``logprobs``, ``model`` to override…)."""
        _no_stream(params)
        body = {"model": self.model, "messages": messages, **params}
        est = sum(len(str(m.get("content") or "")) // 4 + 4 for m in messages) + _max_tokens(params)
        return await self._call("POST", "chat/completions", json_body=body, choices=True, tokens=est)

    async def completions(self, prompt: str | list[int] | list[str] | list[list[int]], **params: Any) -> dict[str, Any]:
        """POST ``completions``; ``prompt`` may be text or token ids (vLLM/SGLang token-in), and ``params`` may
        carry server extensions (``return_token_ids``, ``stop_token_ids``, ``logprobs``)."""
        _no_stream(params)
        body = {"model": self.model, "prompt": prompt, **params}
        if isinstance(prompt, str):
            est = len(prompt) // 4
        elif prompt and isinstance(prompt[0], list):
            est = sum(len(p) for p in prompt)
        elif prompt and isinstance(prompt[0], str):
            est = sum(len(p) // 4 for p in prompt)
        else:
            est = len(prompt)
        return await self._call("POST", "completions", json_body=body, choices=True, tokens=est + _max_tokens(params))

    async def models(self) -> list[str]:
        """The model ids the server lists (GET ``models``)."""
        body = await self._call("GET", "models")
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise MalformedResponse(f"GET {display_url(self.url_for('models'))} answered without a `data` list: "
                                    f"{truncated(json.dumps(body))}", url=self.url_for("models"))
        return [str(m.get("id")) for m in body["data"] if isinstance(m, dict)]

    async def post(self, path: str, json: Any = None, *, content: bytes | str | None = None,
                   timeout_s: float | None = None, retry: bool = True) -> Any:
        """POST to another endpoint (see the class docstring for ``path``); the parsed JSON body, or its text."""
        return await self._call("POST", path, json_body=json, content=content, timeout_s=timeout_s, retry=retry)

    async def get(self, path: str, *, timeout_s: float | None = None) -> Any:
        return await self._call("GET", path, timeout_s=timeout_s)

    def url_for(self, path: str) -> str:
        return self.root_url + path if path.startswith("/") else f"{self.base_url}/{path}"

    async def aclose(self) -> None:
        """Close this event loop's connection pool (the others are dropped with their loops)."""
        loop = asyncio.get_running_loop()
        http = self._http.pop(loop, None)
        if http is not None:
            await http.aclose()

    async def __aenter__(self) -> LLMClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ------------------------------------------------------------------------- one call, with retries

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        http = self._http.get(loop)
        if http is None:
            for closed in [lp for lp in self._http if lp.is_closed()]:  # their pools died with their loops
                del self._http[closed]
            # The connect timeout is short of the request's so that a black-holed host is an unreachable
            # endpoint (retried), not a request timeout.
            timeout = httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s))
            http = self._http[loop] = httpx.AsyncClient(timeout=timeout, trust_env=True, verify=_tls())
        return http

    async def _call(self, method: str, path: str, *, json_body: Any = None, content: bytes | str | None = None,
                    choices: bool = False, tokens: int = 0, timeout_s: float | None = None,
                    retry: bool = True) -> Any:
        self._count("requests")
        url = self.url_for(path)
        try:
            key = self.key.read()
            secrets = (key,) if key else ()
            try:
                return await self._attempts(method, url, json_body, content, key, secrets, choices, tokens,
                                            timeout_s or self.timeout_s, retry)
            except LLMError:
                raise
            except Exception as e:  # noqa: BLE001 — anything else (a protocol bug, a bad header) still never shows the key
                leaks = any(k in repr(e) for k in secrets)  # then the cause is left out of the traceback too
                raise LLMError(redact(f"{method} {display_url(url)} failed: {type(e).__name__}: {e}", secrets),
                               url=display_url(url)) from (None if leaks else e)
        except LLMError as e:
            self._count("failures")
            record_metric("llm/failures", 1, reduce="sum")
            log.info("%s", e)  # the caller decides what a failure is worth; the exception holds the diagnosis
            raise

    async def _attempts(self, method: str, url: str, json_body: Any, content: Any, key: str | None,
                        secrets: tuple[str, ...], choices: bool, tokens: int, timeout_s: float, retry: bool) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if self.limits.tokens is not None and tokens > 0:
            self._count("limit_wait_s", await self.limits.tokens.acquire(tokens))
        shown, attempt, t0 = display_url(url), 0, time.monotonic()
        while True:
            attempt += 1
            if self.limits.requests is not None:
                self._count("limit_wait_s", await self.limits.requests.acquire(1))
            await self.limits.gate.acquire()
            try:
                self._count("attempts")
                outcome = await self._send(method, url, headers, json_body, content, timeout_s)
            finally:
                self.limits.gate.release()
            status = outcome[0] if isinstance(outcome, tuple) else None
            if status is not None:
                with self._stats_lock:
                    self.stats.by_status[status] = self.stats.by_status.get(status, 0) + 1
            retryable = status in _RETRYABLE_STATUS or isinstance(outcome, (EndpointUnreachable, ServerError))
            if retryable and retry and attempt <= self.max_retries:
                delay = self._backoff(attempt, outcome)
                if delay is not None:
                    self._count("retries")
                    record_metric("llm/retries", 1, reduce="sum")
                    log.info("retry %d/%d of %s %s in %.2fs after %s", attempt, self.max_retries, method, shown,
                             delay, f"HTTP {status}" if status else type(outcome).__name__)
                    await asyncio.sleep(delay)
                    continue
            if isinstance(outcome, LLMError):
                outcome.attempts = attempt
                where = f"{method} {shown}"
                message = outcome.args[0].replace(where, f"{where} ({_tries(attempt, t0)})", 1)
                outcome.args = (redact(message, secrets),)
                raise outcome
            return self._parse(method, url, outcome, secrets, choices, tokens, attempt, t0)

    def _count(self, name: str, n: float = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def _backoff(self, attempt: int, outcome: Any) -> float | None:
        d = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        delay = random.uniform(d / 2, d)
        if isinstance(outcome, tuple):
            after = _retry_after(outcome[1].get("retry-after"))
            if after is not None:
                if after > self.max_retry_after_s:
                    return None  # not worth holding a rollout for: raise RateLimited now
                delay = max(delay, after)
        return delay

    async def _send(self, method: str, url: str, headers: dict[str, str], json_body: Any, content: Any,
                    timeout_s: float) -> tuple[int, httpx.Headers, bytes, str | None] | LLMError:
        """One attempt: ``(status, headers, body, cut_off_reason)``, or the transport failure as an LLMError."""
        shown = display_url(url)
        http = self._client()
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(timeout_s):
                request = http.build_request(method, url, json=json_body, content=content, headers=headers,
                                             timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)))
                response = await http.send(request, stream=True)
                try:
                    try:
                        async for chunk in response.aiter_bytes():
                            chunks.append(chunk)
                    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                        return response.status_code, response.headers, b"".join(chunks), str(e)
                finally:
                    await response.aclose()
                return response.status_code, response.headers, b"".join(chunks), None
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError, httpx.UnsupportedProtocol) as e:
            return unreachable(method, url, e, probe=self.url_for("models"))
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            return ServerError(f"{method} {shown}: the connection was closed before an answer "
                               f"({e or type(e).__name__}): the server crashed, restarted or dropped the request, "
                               f"or a proxy cut it; check the server's log", url=shown)
        except (TimeoutError, httpx.TimeoutException):
            return LLMTimeout(f"{method} {shown}: no complete answer within {timeout_s:g} s ({self.section}.timeout_s):"
                              f" the server is overloaded or the generation is long; raise the timeout, lower "
                              f"max_tokens or max_concurrency, or check the server's load", url=shown)

    def _parse(self, method: str, url: str, outcome: tuple[int, httpx.Headers, bytes, str | None],
               secrets: tuple[str, ...], choices: bool, tokens: int, attempt: int, t0: float) -> Any:
        status, headers, raw, cut = outcome
        shown = display_url(url)
        text = redact(raw.decode("utf-8", errors="replace"), secrets)
        body = truncated(text)
        said = server_message(text)
        tries = _tries(attempt, t0)
        ctype = headers.get("content-type", "")

        def fail(cls: type[LLMError], message: str) -> LLMError:
            full = f"{message}\n  server said: {said}" if said else message
            return cls(redact(f"{full}\n  raw body ({len(raw)} bytes, {ctype or 'no content-type'}): {body}", secrets),
                       url=shown, status=status, body=body, attempts=attempt)

        if status in (401, 403):
            checks = self.key.auth_checks()
            seg = doubled_segment(url)
            if seg:  # the likeliest cause when it is there: put it first
                checks.insert(0, doubled(seg, shown))
            raise fail(AuthError, f"HTTP {status} from {method} {shown} ({tries}): the endpoint refused "
                       f"{self.key.describe()}. Check:\n" + "\n".join(f"  - {c}" for c in checks))
        if status == 429:
            after = headers.get("retry-after")
            raise fail(RateLimited, f"HTTP 429 (rate limited) from {method} {shown} ({tries}"
                       f"{f', Retry-After: {after}' if after else ''}): the endpoint allows fewer requests or tokens"
                       f" than this process sends. Lower {self.section}.requests_per_minute, tokens_per_minute or "
                       f"max_concurrency (shared by every client of this endpoint in the process), raise "
                       f"max_retries, or raise the quota")
        if status >= 500:
            raise fail(ServerError, f"HTTP {status} from {method} {shown} ({tries}): the server failed "
                       f"(overloaded, out of memory, crashed, or a bad deployment or gateway); check its log")
        if status >= 400:
            hints = []
            seg = doubled_segment(url)
            if seg:
                hints.append(doubled(seg, shown))
            if status == 404 and not self.base_url.endswith("/v1") and not seg:
                hints.append(f"base_url ({display_url(self.base_url)}) does not end in /v1, where "
                             f"OpenAI-compatible servers serve: try {display_url(self.base_url)}/v1")
            if (said and "model" in said.lower()) or (status == 404 and choices and not hints):
                hints.append(f"a wrong model id: `model` is {self.model!r}; GET {display_url(self.base_url)}"
                             f"/models lists the served ids (`tether ping` prints them)")
            hint = ("Check:\n" + "\n".join(f"  - {h}" for h in hints)) if hints else \
                "the request was refused as sent: check the parameters the server names"
            raise fail(BadRequest, f"HTTP {status} from {method} {shown}: {hint}")
        if cut is not None:
            raise fail(MalformedResponse, f"HTTP {status} from {method} {shown}: the body was cut off after "
                       f"{len(raw)} bytes ({cut}): the server or a proxy closed the connection mid-answer; check the "
                       f"server's log (a crash or out-of-memory during the answer)")
        if not raw and not choices:
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            if not choices and "json" not in ctype:
                return text  # a plain-text answer of a non-generation endpoint
            raise fail(MalformedResponse, f"HTTP {status} from {method} {shown}: the body is not complete JSON "
                       f"(truncated, or not an API answer). Likely causes:\n"
                       + "\n".join(f"  - {c}" for c in malformed_causes(text, ctype, self.model))) from None
        if choices and not (isinstance(data, dict) and isinstance(data.get("choices"), list) and data["choices"]):
            raise fail(MalformedResponse, f"HTTP {status} from {method} {shown}: the answer has no non-empty "
                       f"`choices`. Likely causes:\n"
                       + "\n".join(f"  - {c}" for c in malformed_causes(text, ctype, self.model)))
        usage = data.get("usage") if isinstance(data, dict) else None
        if self.limits.tokens is not None and tokens > 0 and isinstance(usage, dict) \
                and isinstance(usage.get("total_tokens"), int):
            self.limits.tokens.refund(tokens - usage["total_tokens"])  # charge what was really used
        record_metric("llm/latency_s", time.monotonic() - t0)
        return data


# ----------------------------------------------------------------------------- helpers

_TLS: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    """One TLS context for every client (building one reads the CA bundle: tens of ms per client and loop)."""
    global _TLS
    if _TLS is None:
        _TLS = httpx.create_ssl_context(trust_env=True)  # as httpx's default: certifi, or SSL_CERT_FILE/DIR
    return _TLS



def _no_stream(params: dict[str, Any]) -> None:
    if params.get("stream"):
        raise ValueError("LLMClient does not stream: leave out stream=True (the whole answer is returned)")


def _max_tokens(params: dict[str, Any]) -> int:
    n = params.get("max_tokens", params.get("max_completion_tokens", 0)) or 0
    return int(n) * int(params.get("n", 1) or 1)


def _tries(attempt: int, t0: float) -> str:
    return f"{attempt} attempt{'s' if attempt > 1 else ''} in {time.monotonic() - t0:.1f} s"


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
