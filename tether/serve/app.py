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

Before any route runs (``tether.serve.gate.Gate``, an ASGI middleware): the key is checked, then the body is read up to
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
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tether.serve.adapters as adapters
import tether.serve.responses as responses
import tether.serve.structured as structured
import tether.serve.weights as weights
from tether.engine.base import InferenceEngine
from tether.engine.grammar import Grammars
from tether.serve.gate import Gate, Trim, default_request_bytes, error_response, read_body, validation_error
from tether.serve.generation import APIError, Generator, sampling_params
from tether.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    PromptLogprob,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
)
from tether.serve.streaming import ChoiceStream, Pace

log = logging.getLogger(__name__)

_OPENAI_ROUTES = ("/chat/completions", "/completions", "/models", "/load_lora_adapter", "/unload_lora_adapter")


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(engine: InferenceEngine, tokenizer: Any, *, model_name: str, model: Any = None, parser: str = "hermes",
             extra_stop_ids: tuple[int, ...] = (), api_key: str | None = None, max_loras: int = 4,
             adapter_engine: Callable[[], InferenceEngine] | None = None, weight_updates: bool = False,
             weights_root: str | Path | None = None, max_request_bytes: int | None = None,
             stream_interval: int | None = None) -> FastAPI:
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
    weight_updates: allow the weight-update routes (``gate.WEIGHT_ROUTES``) without a key; with a key they are allowed.
    weights_root: the folder under which ``/update_weights_from_disk`` and ``/v1/load_lora_adapter`` read (symlinks
        resolved); None = those two refuse every path.
    max_request_bytes: the largest body of a JSON route (413 above it); None = ``default_request_bytes`` of the
        model's context length.
    stream_interval: tokens per streamed chunk after a choice's first (vLLM's ``--stream-interval``; 1 = every
        decode step's); None = auto, by how many choices stream at once (``streaming.Pace``).
    """
    pace = Pace(stream_interval)
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
    trim = Trim()

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
    app.add_middleware(Gate, api_key=api_key, max_bytes=max_request_bytes,
                       weight_updates=weight_updates or api_key is not None, counters=counters, trim=trim)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
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
                                    pace=pace)
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
                                    group=ident, pace=pace)
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
