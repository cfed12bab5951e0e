"""The error taxonomy of the OpenAI-compatible client: one exception type per thing the user must check.

Every message says what failed, where (method, URL with any ``user:password@`` removed, attempts) and what to
check, in the order of likelihood; the server's own words and the raw body (truncated to ``BODY_LIMIT``
characters) follow. The client redacts the key out of every message and body *before* an exception is built
(``redact``), so ``str(e)``, ``e.body`` and a traceback never show it.

Which failures are retried (by the client, with jittered backoff) and which are raised at once:

==================  =======================================  =========
type                cause                                    retried
==================  =======================================  =========
MissingKey          the key's variable is unset here         no (never sent)
MalformedKey        whitespace/newline in the key            no (never sent)
AuthError           401 / 403                                no
BadRequest          400 / 404 / 422 (other 4xx)              no
EndpointUnreachable refused, DNS, proxy: never left          yes
RateLimited         429 after the retries                    yes
ServerError         5xx, or a dropped connection             yes
LLMTimeout          no answer within ``timeout_s``           no (it would double the load)
MalformedResponse   not JSON, cut off, no ``choices``        no (the server did answer)
==================  =======================================  =========
"""

from __future__ import annotations

import json
import os
import re
import socket
from urllib.parse import urlsplit, urlunsplit

import httpx

BODY_LIMIT = 500
"""Characters of a raw body shown in a message."""


class LLMError(Exception):
    """Base of the client's errors. ``config_fault``: the request was refused before it was sent, because of
    the configuration or this process's environment (``tether ping`` exits 2 for these, 1 for the rest)."""

    config_fault = False

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None,
                 body: str | None = None, attempts: int = 0):
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body
        """The raw body, redacted and truncated; None when no body was read."""
        self.attempts = attempts
        """HTTP attempts made (0 = never sent)."""


class AuthError(LLMError):
    """401/403: the endpoint refused the key (or no key was sent)."""


class MissingKey(AuthError):
    """The key's environment variable is unset in this process: nothing was sent."""

    config_fault = True


class MalformedKey(AuthError):
    """The key holds whitespace or a newline (a copy-paste slip): nothing was sent."""

    config_fault = True


class BadRequest(LLMError):
    """400/404/422 (any 4xx but 401/403/429): the server understood and refused the request."""


class EndpointUnreachable(LLMError):
    """No connection: refused, DNS or proxy failure, connect timeout. The request never left this machine."""


class ConnectionRefused(EndpointUnreachable):
    """The host answered that nothing listens on the port."""


class RateLimited(LLMError):
    """429 after every retry."""


class ServerError(LLMError):
    """5xx after every retry, or the server dropped the connection before answering."""


class LLMTimeout(LLMError):
    """No complete answer within the request timeout."""


class MalformedResponse(LLMError):
    """A 2xx answer that is not usable: not JSON, cut off, or without a non-empty ``choices``."""


# ----------------------------------------------------------------------------- helpers the client uses


def redact(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every occurrence of each non-empty secret (and its stripped form) replaced by ``***``."""
    for s in secrets:
        for form in {s, s.strip()}:
            if len(form) >= 4:  # a 1-3 character "key" would turn ordinary text into stars
                text = text.replace(form, "***")
    return text


def display_url(url: str) -> str:
    """The URL without ``user:password@`` (a proxy or gateway URL may carry credentials)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


def host_port(url: str) -> str:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def truncated(body: str, limit: int = BODY_LIMIT) -> str:
    if len(body) <= limit:
        return body
    return body[:limit] + f"… ({len(body) - limit} more characters)"


def server_message(body: str) -> str | None:
    """The server's own words from an OpenAI-shaped (``{"error": {"message"}}``) or FastAPI-shaped
    (``{"detail"}``) error body, if there are any."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    for k in ("error", "detail", "message"):
        if isinstance(data.get(k), str) and data[k]:
            return data[k]
    if isinstance(data.get("detail"), list | dict):
        return json.dumps(data["detail"])[:BODY_LIMIT]
    return None


def doubled_segment(url: str) -> str | None:
    """The path segment that repeats back to back (``/v1/v1``), the mark of a path appended twice."""
    segments = [s for s in urlsplit(url).path.split("/") if s]
    for a, b in zip(segments, segments[1:]):
        if a == b:
            return a
    return None


_RATE_WORDS = re.compile(r"rate.?limit|too many requests|quota|throttl", re.IGNORECASE)
_MODEL_WORDS = re.compile(r"model", re.IGNORECASE)


def malformed_causes(body: str, content_type: str, model: str) -> list[str]:
    """The likely causes of a 2xx body without usable ``choices`` (the source document's "reading choices"
    troubleshooting), the ones the body itself points at first."""
    hinted: list[str] = []
    rest: list[str] = []
    wrong_model = (f"a wrong model id: the server may answer an unknown `model` ({model!r}) with an error "
                   "object instead of a generation; compare it with the ids GET <base_url>/models lists "
                   "(`tether ping` prints them)")
    rate = ("a rate-limit answer sent with status 200 instead of 429 (some gateways do): lower "
            "llm_client.requests_per_minute / tokens_per_minute / max_concurrency")
    other = ("a non-generation response: base_url points at something other than the API (a web page, a "
             "proxy's login or error page, a health endpoint), or the caller treated a non-generation "
             "response as one")
    (hinted if _MODEL_WORDS.search(body) else rest).append(wrong_model)
    (hinted if _RATE_WORDS.search(body) else rest).append(rate)
    (hinted if "html" in content_type.lower() or body.lstrip().startswith("<") else rest).append(other)
    return hinted + rest


def doubled(segment: str, url: str) -> str:
    return (f"the URL {url} repeats /{segment}/{segment}: /{segment} was appended to a base_url that already "
            f"ends in it; set base_url to end in a single /{segment} (tether appends nothing to it)")


def proxy_for(url: str) -> str | None:
    """The proxy variable that applies to ``url`` and the proxy's host:port, as httpx reads them."""
    parts = urlsplit(url)
    no_proxy = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    host = parts.hostname or ""
    for entry in (e.strip().lstrip(".") for e in no_proxy.split(",")):
        if entry == "*" or (entry and (host == entry or host.endswith("." + entry))):
            return None
    for name in (f"{parts.scheme.upper()}_PROXY", f"{parts.scheme}_proxy", "ALL_PROXY", "all_proxy"):
        value = os.environ.get(name)
        if value:
            return f"{name} is set (proxy {host_port(value if '://' in value else 'http://' + value)})"
    return None


def unreachable(method: str, url: str, e: Exception, probe: str) -> EndpointUnreachable:
    shown, where = display_url(url), host_port(url)
    proxy = proxy_for(url)
    chain: list[BaseException] = []
    cause = e.__cause__ or e.__context__
    while cause is not None and len(chain) < 5:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    refused = isinstance(e, httpx.ConnectError) and (
        any(isinstance(c, ConnectionRefusedError) for c in chain) or "refused" in str(e).lower())
    dns = any(isinstance(c, socket.gaierror) for c in chain) or "name or service not known" in str(e).lower() \
        or "nodename nor servname" in str(e).lower() or "name resolution" in str(e).lower()
    if isinstance(e, httpx.ProxyError):
        what = f"the proxy refused to connect to {where} ({e})"
    elif isinstance(e, httpx.UnsupportedProtocol):
        what = f"the URL's scheme is not http or https ({e})"
    elif dns:
        what = f"the host name of {where} does not resolve (DNS): check the host in base_url"
    elif refused:
        what = (f"connection to {where} refused: nothing listens on that port (or a firewall rejects it); check "
                f"that the server is running and the port in base_url")
    elif isinstance(e, httpx.ConnectTimeout):
        what = f"no answer to the connection attempt to {where}: a firewall or network drops it, or the host is down"
    else:
        what = f"could not connect to {where} ({e or type(e).__name__})"
    via = (f"; {proxy}: the connection goes through that proxy, so the failure may be the proxy's — if curl "
           f"reaches the endpoint but tether does not, compare the proxy variables of both processes or set "
           f"NO_PROXY={urlsplit(url).hostname}") if proxy else "; no proxy variable is set"
    cls = ConnectionRefused if refused and not proxy else EndpointUnreachable
    return cls(f"{method} {shown}: the request never left — {what}{via}. Try from this machine: curl "
               f"{display_url(probe)}", url=shown)
