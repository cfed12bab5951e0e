"""A request's way in to ``tether serve``, before and around its route: the bearer key (401), whether weight updates
are allowed (403), the body read whole up to ``max_request_bytes`` (413 past it) by ``Gate``, an ASGI middleware; then
in the route the body parsed into its request model (``read_body``: 400 naming what is wrong); every error as
OpenAI's ``{"error": {...}}`` body (``error_response``)."""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import json
from collections import Counter
from typing import Any, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tether.serve.generation import APIError
from tether.serve.protocol import ErrorDetail, ErrorResponse

# The default bound of a JSON body: 128 bytes per token of the model's context (a full context is ~4-8 bytes a token
# as text, up to 6x that escaped as JSON, or <= 8 bytes a token as an id list: room for a full prompt with large tool
# schemas, or a completions batch of 16 full id lists), at least 4 MiB. A body over it cannot hold a prompt the model
# takes, so it is refused from its Content-Length before a byte is read or parsed (parsing 20 MB of JSON holds the
# interpreter for ~0.2 s, stalling every request). 32 MiB when the context length is unknown.
MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN, MAX_REQUEST_BYTES = 4 << 20, 128, 32 << 20


def default_request_bytes(max_model_len: int | None) -> int:
    if max_model_len is None:
        return MAX_REQUEST_BYTES
    return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * max_model_len)

# Routes whose body is a tensor file, not a JSON request (a model's weights: any size), and the weight updates.
_TENSOR_ROUTES = frozenset({"/update_weights_from_tensor", "/update_lora_adapter_from_tensor"})
WEIGHT_ROUTES = _TENSOR_ROUTES | {"/update_weights_from_disk", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error"}

Body = TypeVar("Body", bound=pydantic.BaseModel)


def error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    detail = ErrorDetail(message=message, type=type or _TYPES.get(status, "server_error"), param=param, code=code)
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers)


def _key_problem(api_key: str | None, authorization: str) -> str | None:
    if api_key is None:
        return None
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given:
        return "no API key: send the header 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        return "incorrect API key provided"
    return None


def _malloc_trim() -> None:
    """Hand the heap memory glibc keeps free in its arenas back to the system (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class Trim:
    """``malloc_trim`` in a worker a second after the last large body or aborted request: glibc keeps the memory of
    a freed multi-MB body (and of an aborted request's buffers) in per-thread arenas, where RSS never comes down."""

    def __init__(self) -> None:
        self.handle: asyncio.TimerHandle | None = None

    def soon(self) -> None:
        loop = asyncio.get_running_loop()
        if self.handle is not None:
            self.handle.cancel()
        self.handle = loop.call_later(1.0, lambda: loop.run_in_executor(None, _malloc_trim))


_LARGE_BODY = 4 << 20  # bodies over this are followed by a trim
# A body over the bound but under this is read (and dropped, a chunk at a time) before the 413 is sent: a client still
# sending when the connection closes sees a broken connection, not the answer. Larger ones are cut off.
_DRAIN_BYTES = 64 << 20


async def _drain(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


class Gate:
    """Before any route but ``/health``: the key (401), whether weight updates are allowed (403), and the body read
    whole up to ``max_bytes`` (413 past it; the tensor routes' bodies are not bounded), then replayed to the app.
    A client that leaves while its body is read counts in ``serve/aborted``."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_bytes: int, weight_updates: bool,
                 counters: Counter[str], trim: Trim):
        self.app, self.api_key, self.max_bytes, self.weight_updates = app, api_key, max_bytes, weight_updates
        self.counters, self.trim = counters, trim

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path == "/health":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self._refusal(path, headers)
        if refusal is None and path not in _TENSOR_ROUTES:
            declared = headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_bytes:
                refusal = self._too_large(int(declared))
                if int(declared) <= _DRAIN_BYTES:  # read and dropped unparsed, so that the client reads the 413
                    await _drain(receive)
            else:
                chunks, size = [], 0
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self.counters["serve/aborted"] += 1
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_bytes:
                        refusal = self._too_large(None)
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
                if refusal is None:
                    receive = _replay(b"".join(chunks), receive)
                del chunks
                if size > _LARGE_BODY:
                    self.trim.soon()
        if refusal is not None:
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, path: str, headers: dict[str, str]) -> JSONResponse | None:
        problem = _key_problem(self.api_key, headers.get("authorization", ""))
        if problem is not None:
            return error_response(401, problem, code="invalid_api_key")
        if path in WEIGHT_ROUTES and not self.weight_updates:
            return error_response(
                403, f"{path}: weight updates are off on this server, which has no API key; start it with "
                     f"--enable-weight-updates (or --api-key-env VAR) to allow them (engine.type: remote training "
                     f"needs this)", code="weight_updates_disabled")
        return None

    def _too_large(self, declared: int | None) -> JSONResponse:
        size = f"{declared} bytes" if declared is not None else "more"
        return error_response(413, f"the request body is {size}; this server takes at most {self.max_bytes} bytes "
                                   f"(tether serve --max-request-bytes)", code="request_too_large",
                              headers={"connection": "close"})


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read handed out first (then the client's own messages: a disconnect)."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _field(loc: tuple[Any, ...]) -> str:
    """Pydantic's error location as a field path: ``messages.0.content`` (union members' type names left out)."""
    return ".".join(str(p) for p in loc if isinstance(p, int) or ("[" not in p and p not in (
        "body", "query", "str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal")))


def validation_error(errors: list[Any]) -> APIError:
    first = errors[0] if errors else {}
    message = "; ".join(f"{_field(e.get('loc', ())) or 'body'}: "
                        f"{'unknown parameter' if e.get('type') == 'extra_forbidden' else e.get('msg')}"
                        for e in errors[:5])
    return APIError(400, message or "invalid request body", param=_field(first.get("loc", ())) or None,
                    code="invalid_value")


def parse_body(body: bytes, content_type: str, model: type[Body]) -> Body:
    """The request body as ``model``: 400 naming what is wrong (content type, JSON syntax with its line and column,
    the fields that fail validation). Runs in a worker thread: its cost grows with the body."""
    kind = content_type.split(";")[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise APIError(400, f"the body must be JSON sent with 'Content-Type: application/json', not {kind!r}",
                       code="invalid_content_type")
    try:
        data = json.loads(body)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: not UTF-8 text ({e.reason} at byte {e.start})",
                       code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


async def read_body(request: Request, model: type[Body]) -> Body:
    return await asyncio.to_thread(parse_body, await request.body(), request.headers.get("content-type", ""), model)
