"""The OpenAI-compatible HTTP API over an ``InferenceEngine``: ``make_app(engine, tokenizer, ...)``.

Routes (every one but ``/health`` behind the bearer key when ``api_key`` is set):

- ``GET /health`` — liveness, no key needed: ``{"status": "ok", "weight_version": n, "serve/aborted": k}`` (k:
  requests whose client left before their answer)
- ``GET /v1/models``, ``GET /v1/models/{id}`` — the served model and the LoRA adapters loaded (``parent``: its name)
- ``POST /v1/chat/completions`` — messages (+ ``tools``, ``tool_choice``), streaming, ``n``, logprobs; ``tool_choice``
  required or named, a strict tool, ``response_format`` json_object / json_schema decode under a grammar
  (``tether.serve.structured``)
- ``POST /v1/completions`` — a prompt as text or token ids; token ids, logprobs and weight versions out;
  ``prompt_logprobs`` (vLLM's) scores the prompt's own tokens
- ``POST /update_weights_from_disk`` — ``{"model_path", "weight_version"}``: safetensors from a HF folder (SGLang's)
- ``POST /update_weights_from_tensor?weight_version=N`` — body ``safetensors.torch.save(state_dict)``, for a
  trainer on the same host
- ``POST /update_lora_adapter_from_tensor?weight_version=N&scaling=S`` — tether's own (SGLang and vLLM have no
  training-time adapter push): body ``safetensors.torch.save`` of a LoRA adapter's A and B by layer name
  (``tether.serve.adapters``); the served model becomes its base plus s · B @ A as version N
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``, ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``
  — vLLM's: a peft adapter folder served under ``lora_name`` (a request's ``model``) beside the base
  (``tether.serve.adapters``: each is a merged copy of the model, at most ``max_loras``)
- ``GET /get_weight_version``

Every error answers ``{"error": {"message", "type", "param", "code"}}``, as OpenAI and vLLM do: 400 a request the
server cannot honour or that fails validation (``param`` names the field, e.g. ``messages.0.content``; malformed JSON
and a wrong content type say so), 401 a missing or wrong key, 403 a weight update on a server that does not take
them, 404 an unknown model or route (a route missing its ``/v1`` says so), 405 a wrong method, 413 a body over
``max_request_bytes``, 500 a server fault. The key is compared in constant time and never logged or echoed.

Before any route runs (``_Gate``, an ASGI middleware): the key is checked, then the body is read up to
``max_request_bytes`` — so a caller without the key gets 401 whatever its body, and an oversized body costs the
server nothing but the bytes it read. Weight updates are refused there too unless allowed (a key is set, or
``weight_updates=True``: ``tether serve --enable-weight-updates``); a path they name must lie under ``weights_root``.

Nothing on the event loop grows with the input: parsing and validating the body, rendering and tokenizing the prompt
run in worker threads, and a chat prompt's text is bounded before it is rendered (``Generator.check_text``). A client
that disconnects aborts its request in the engine (which frees its slots at its next step); ``/health`` counts these
in ``serve/aborted``.

All requests share the engine, so the local engine's continuous batching serves them together. The app does not
own the engine: whoever built it closes it (``tether.serve.server.serve`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tether.serve.adapters as adapters
import tether.serve.responses as responses
import tether.serve.structured as structured
import tether.serve.weights as weights
from tether.engine.base import InferenceEngine
from tether.engine.grammar import Grammars
from tether.serve.generation import APIError, Generator, sampling_params
from tether.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PromptLogprob,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
)
from tether.serve.streaming import ChoiceStream

log = logging.getLogger(__name__)

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
_OPENAI_ROUTES = ("/chat/completions", "/completions", "/models", "/load_lora_adapter", "/unload_lora_adapter")

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


class _Trim:
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


class _Gate:
    """Before any route but ``/health``: the key (401), whether weight updates are allowed (403), and the body read
    whole up to ``max_bytes`` (413 past it; the tensor routes' bodies are not bounded), then replayed to the app.
    A client that leaves while its body is read counts in ``serve/aborted``."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_bytes: int, weight_updates: bool,
                 counters: Counter[str], trim: _Trim):
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


def _validation_error(errors: list[Any]) -> APIError:
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
        raise _validation_error(e.errors(include_url=False)) from None


async def read_body(request: Request, model: type[Body]) -> Body:
    return await asyncio.to_thread(parse_body, await request.body(), request.headers.get("content-type", ""), model)


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(engine: InferenceEngine, tokenizer: Any, *, model_name: str, model: Any = None, parser: str = "hermes",
             extra_stop_ids: tuple[int, ...] = (), api_key: str | None = None, max_loras: int = 4,
             adapter_engine: Callable[[], InferenceEngine] | None = None, weight_updates: bool = False,
             weights_root: str | Path | None = None, max_request_bytes: int | None = None,
             stream_interval: int = 1) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``model_name``.

    model: the engine's torch module, for ``max_model_len``, ``top_logprobs`` and ``/update_weights_from_disk``
        key checks (default: ``engine.model`` when the engine has one). Weight updates go through
        ``engine.update_weights``.
    parser: the tool-call parser of training (``tool_parser.name``); extra_stop_ids: ``tool_parser.stop_token_ids``.
    api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
    max_loras: the most LoRA adapters loaded at once through ``/v1/load_lora_adapter`` (vLLM's ``--max-loras``;
        each costs a copy of the model); 0 = none.
    adapter_engine: a new engine over a copy of the served model's current weights, for a loaded adapter (default:
        a ``LocalEngine`` over ``copy.deepcopy(model)``, deterministic when ``engine`` is). The app closes these
        engines: at unload, and when the server stops (``app.state.adapters.close()`` where no lifespan runs).
    weight_updates: allow the weight-update routes (``WEIGHT_ROUTES``) without a key; with a key they are allowed.
    weights_root: the folder under which ``/update_weights_from_disk`` and ``/v1/load_lora_adapter`` read (symlinks
        resolved); None = those two refuse every path.
    max_request_bytes: the largest body of a JSON route (413 above it); None = ``default_request_bytes`` of the
        model's context length.
    stream_interval: tokens per streamed chunk after a choice's first (vLLM's ``--stream-interval``; 1 = every
        decode step's).
    """
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1 token, got {stream_interval}")
    model = model if model is not None else getattr(engine, "model", None)
    root = None if weights_root is None else Path(weights_root).resolve()

    def generator(e: InferenceEngine, m: Any) -> Generator:
        return Generator(e, tokenizer, model=m, parser=parser, extra_stop_ids=extra_stop_ids)

    gen = generator(engine, model)
    grammars = Grammars(tokenizer, gen.vocab_size)  # tool_choice / response_format grammars (serve/structured.py)
    if adapter_engine is None and model is not None:
        adapter_engine = _local_engine_like(engine, model)
    loras = adapters.Adapters(gen, model_name, adapter_engine, lambda e: generator(e, e.model), max_loras)
    created = int(time.time())
    counters: Counter[str] = Counter()
    trim = _Trim()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(loras.close)

    app = FastAPI(title="tether serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.generator = gen
    app.state.adapters = loras
    app.state.counters = counters
    if max_request_bytes is None:
        max_request_bytes = default_request_bytes(gen.max_model_len)
    app.state.max_request_bytes = max_request_bytes
    app.add_middleware(_Gate, api_key=api_key, max_bytes=max_request_bytes,
                       weight_updates=weight_updates or api_key is not None, counters=counters, trim=trim)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(list(exc.errors()))
        return error_response(400, err.message, param=err.param, code=err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404:
            hint = ""
            if not path.startswith("/v1/") and path.rstrip("/").endswith(_OPENAI_ROUTES):
                hint = ": the OpenAI routes are under /v1 (a client's base_url ends in /v1, e.g. http://host:port/v1)"
            return error_response(404, f"no route {request.method} {path}{hint}", code="not_found")
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

    async def unless_gone(request: Request, work: Awaitable[Any]) -> Any:
        """``work``'s result, or its cancellation (the engine frees the request's slots at its next step) when the
        client disconnects first."""
        task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            counters["serve/aborted"] += 1
            trim.soon()
            raise _ClientGone
        return task.result()

    async def counted(body: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream that counts in ``serve/aborted`` when the client leaves before its end."""
        finished = False
        try:
            async for chunk in body:
                yield chunk
            finished = True
        finally:
            if not finished:
                counters["serve/aborted"] += 1
                trim.soon()

    def resolve(name: str) -> Generator:
        """The generator of the model a request names: the served model, or a loaded LoRA adapter."""
        if name == model_name:
            return gen
        loaded = loras.get(name)
        if loaded is None:
            also = "".join(f", {a.name!r}" for a in loras.all())
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}{also}",
                           param="model", code="model_not_found")
        return loaded.gen

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": engine.version, "serve/aborted": counters["serve/aborted"]}

    def card(name: str) -> ModelCard:
        loaded = loras.get(name)
        if loaded is None:
            return ModelCard(id=model_name, created=created, max_model_len=gen.max_model_len,
                             weight_version=engine.version)
        return ModelCard(id=name, created=loaded.created, max_model_len=gen.max_model_len,
                         weight_version=loaded.gen.engine.version, root=loaded.path, parent=model_name)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card(model_name), *(card(a.name) for a in loras.all())]).model_dump()

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> dict[str, Any]:
        resolve(name)
        return card(name).model_dump()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        req = await read_body(request, ChatCompletionRequest)
        gen = resolve(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = None if req.tool_choice == "none" else req.tools

        def prepare() -> tuple[list[int], Any, list[str]]:  # in a worker: rendering grows with the messages
            grammar = structured.chat_constraint(req, tools, grammars, parser=parser)  # compiling, too
            prompt = gen.render_chat(req.messages, tools, req.chat_template_kwargs)
            gen.check_prompt(prompt, param="messages")
            max_tokens = gen.max_new(req.max_completion_tokens or req.max_tokens, len(prompt))
            stop_ids, strings = gen.stops(req, gen.chat_stop_ids)
            params = sampling_params(req, max_tokens, stop_ids, gen.vocab_size)
            return prompt, params if grammar is None else replace(params, constraint=grammar), strings

        prompt, params, strings = await asyncio.to_thread(prepare)
        top_k = (req.top_logprobs or 0) if req.logprobs else 0
        ident, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        view = responses.ChatView(gen, parse_tools=bool(tools), first_call_only=req.parallel_tool_calls is False,
                                  logprobs=req.logprobs, skip=req.skip_special_tokens)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream and not top_k and (not tools or gen.parser == "hermes"):  # told as the tokens are made
            streams = [ChoiceStream(gen, p, strings, req.skip_special_tokens, req.include_stop_str_in_output,
                                    tools=bool(tools), first_call_only=req.parallel_tool_calls is False, group=ident,
                                    interval=stream_interval)
                       for p in gen.seeded(params, req.n)]
            body = responses.chat_stream_live(view, streams, ident=ident, created=now, model=req.model,
                                              prompt=prompt, include_usage=include_usage,
                                              return_token_ids=req.return_token_ids)
            return StreamingResponse(counted(body), media_type="text/event-stream")
        run = gen.choices(prompt, params, n=req.n, strings=strings, top_k=top_k,
                          skip_special_tokens=req.skip_special_tokens, include_stop=req.include_stop_str_in_output,
                          group=ident)
        if req.stream:
            body = responses.chat_stream(view, run, ident=ident, created=now, model=req.model, prompt=prompt,
                                         include_usage=include_usage, return_token_ids=req.return_token_ids)
            return StreamingResponse(counted(body), media_type="text/event-stream")
        (choices,) = await unless_gone(request, responses.gather([run]))
        return responses.chat_response(view, choices, ident=ident, created=now, model=req.model, prompt=prompt,
                                       return_token_ids=req.return_token_ids).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = await read_body(request, CompletionRequest)
        gen = resolve(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported by tether serve", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported by tether serve", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported by tether serve", param="best_of")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs are not streamed by tether serve; send stream: false",
                           param="prompt_logprobs")

        def prepare() -> tuple[list[list[int]], list[Any], list[str]]:  # in a worker: tokenizing grows with the text
            prompts = _prompts(req.prompt, gen)
            for p in prompts:
                gen.check_prompt(p)
            max_tokens = [gen.max_new(req.max_tokens, len(p)) for p in prompts]
            stop_ids, strings = gen.stops(req, gen.eos_ids)
            return prompts, [sampling_params(req, m, stop_ids, gen.vocab_size) for m in max_tokens], strings

        prompts, params, strings = await asyncio.to_thread(prepare)
        ident, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream and not req.logprobs:  # told as the tokens are made (logprobs 0 included)
            streams = [ChoiceStream(gen, q, strings, req.skip_special_tokens, req.include_stop_str_in_output,
                                    group=ident, interval=stream_interval)
                       for sp in params for q in gen.seeded(sp, req.n)]
            body = responses.completion_stream_live(gen, streams, prompts, n=req.n, ident=ident, created=now,
                                                    model=req.model, logprobs=req.logprobs is not None,
                                                    return_token_ids=req.return_token_ids,
                                                    include_usage=include_usage)
            return StreamingResponse(counted(body), media_type="text/event-stream")
        runs = [gen.choices(p, sp, n=req.n, strings=strings, top_k=req.logprobs or 0,
                            skip_special_tokens=req.skip_special_tokens, include_stop=req.include_stop_str_in_output,
                            group=ident) for p, sp in zip(prompts, params)]
        if req.stream:
            body = responses.completion_stream(gen, runs, prompts, n=req.n, ident=ident, created=now,
                                               model=req.model, logprobs=req.logprobs,
                                               return_token_ids=req.return_token_ids, include_usage=include_usage)
            return StreamingResponse(counted(body), media_type="text/event-stream")
        scored = None  # vLLM's prompt_logprobs: a teacher scoring a student's tokens (tether.teacher)
        if req.prompt_logprobs is not None:
            k = req.prompt_logprobs
            scored = [[None if e is None else {i: PromptLogprob(**v) for i, v in e.items()}
                       for e in await asyncio.to_thread(gen.prompt_logprobs, p, k)] for p in prompts]
        answer = responses.completion_response(gen, await unless_gone(request, responses.gather(runs)), prompts,
                                               ident=ident, created=now, model=req.model, logprobs=req.logprobs,
                                               return_token_ids=req.return_token_ids)
        for j, choice in enumerate(answer.choices if scored is not None else ()):
            choice.prompt_logprobs = scored[j // req.n]  # type: ignore[index]
        return answer.model_dump()

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> dict[str, Any]:
        req = await read_body(request, UpdateWeightsFromDiskRequest)
        state = await weights.read_folder(weights.under_root(req.model_path, root, "model_path"))
        version = engine.version + 1 if req.weight_version is None else req.weight_version
        await weights.apply(gen, state, version)
        return UpdateWeightsResponse(success=True, weight_version=engine.version,
                                     message=f"loaded {len(state)} tensors from {req.model_path}").model_dump()

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request,
                                 weight_version: int | None = Query(default=None, ge=0)) -> dict[str, Any]:
        state = await asyncio.to_thread(weights.read_bytes, await request.body())
        version = engine.version + 1 if weight_version is None else weight_version
        await weights.apply(gen, state, version)
        return UpdateWeightsResponse(success=True, weight_version=engine.version,
                                     message=f"loaded {len(state)} tensors from the request body").model_dump()

    @app.post("/update_lora_adapter_from_tensor")
    async def update_lora_from_tensor(request: Request, scaling: float = Query(),
                                      weight_version: int | None = Query(default=None, ge=0)) -> dict[str, Any]:
        adapter = await asyncio.to_thread(weights.read_bytes, await request.body())
        version = engine.version + 1 if weight_version is None else weight_version
        await adapters.push(gen, adapter, scaling, version)
        return UpdateWeightsResponse(success=True, weight_version=engine.version,
                                     message=f"merged a LoRA adapter of {len(adapter) // 2} layers").model_dump()

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> PlainTextResponse:
        req = await read_body(request, LoadLoRAAdapterRequest)
        await loras.load(req.lora_name, weights.under_root(req.lora_path, root, "lora_path"), replace=req.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")  # vLLM's answer

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> PlainTextResponse:
        req = await read_body(request, UnloadLoRAAdapterRequest)
        await loras.unload(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": engine.version}

    return app

def _local_engine_like(engine: Any, model: Any) -> Callable[[], InferenceEngine]:
    """A new LocalEngine over a copy of ``model`` (deterministic when ``engine`` is)."""
    from tether.engine.local import LocalEngine  # noqa: PLC0415 — the app serves any engine

    deterministic = bool(getattr(engine, "deterministic", False))
    return lambda: LocalEngine(copy.deepcopy(model), deterministic=deterministic)


def _prompts(prompt: Any, gen: Generator) -> list[list[int]]:
    """The request's prompts as token ids: one text, one id list, a batch of texts or of id lists."""
    if isinstance(prompt, str):
        return [gen.encode(prompt)]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [gen.encode(p) if isinstance(p, str) else list(p) for p in prompt]
