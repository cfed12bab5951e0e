"""The OpenAI-compatible HTTP API over an ``InferenceEngine``: ``make_app(engine, tokenizer, ...)``.

Routes (every one but ``/health`` behind the bearer key when ``api_key`` is set):

- ``GET /health`` — liveness, no key needed: ``{"status": "ok", "weight_version": n}``
- ``GET /v1/models``, ``GET /v1/models/{id}`` — the served model and the LoRA adapters loaded (``parent``: its name)
- ``POST /v1/chat/completions`` — messages (+ ``tools``, ``tool_choice``), streaming, ``n``, logprobs
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

Every error answers ``{"error": {"message", "type", "param", "code"}}``: 400 a request the server cannot honour,
401 a missing or wrong key, 404 an unknown model or route, 405 a wrong method, 422 a body that fails validation
(wrong type, out of range, unknown field), 500 a server fault. The key is compared in constant time and never
logged or echoed.

All requests share the engine, so the local engine's continuous batching serves them together. The app does not
own the engine: whoever built it closes it (``tether.serve.server.serve`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tether.serve.adapters as adapters
import tether.serve.responses as responses
import tether.serve.weights as weights
from tether.engine.base import InferenceEngine
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

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 422: "invalid_request_error"}


def error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    detail = ErrorDetail(message=message, type=type or _TYPES.get(status, "server_error"), param=param, code=code)
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers)


def make_app(engine: InferenceEngine, tokenizer: Any, *, model_name: str, model: Any = None, parser: str = "hermes",
             extra_stop_ids: tuple[int, ...] = (), api_key: str | None = None, max_loras: int = 4,
             adapter_engine: Callable[[], InferenceEngine] | None = None) -> FastAPI:
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
    """
    model = model if model is not None else getattr(engine, "model", None)

    def generator(e: InferenceEngine, m: Any) -> Generator:
        return Generator(e, tokenizer, model=m, parser=parser, extra_stop_ids=extra_stop_ids)

    gen = generator(engine, model)
    if adapter_engine is None and model is not None:
        adapter_engine = _local_engine_like(engine, model)
    loras = adapters.Adapters(gen, model_name, adapter_engine, lambda e: generator(e, e.model), max_loras)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(loras.close)

    app = FastAPI(title="tether serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.generator = gen
    app.state.adapters = loras

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, type=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query")]
        param = ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p not in ('body', 'query'))}: "
                            f"{e.get('msg')}" for e in errors[:5])
        return error_response(422, message or "invalid request body", param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}", code="not_found")
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(401, "no API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

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
        return {"status": "ok", "weight_version": engine.version}

    api = APIRouter(dependencies=[Depends(check_key)])

    def card(name: str) -> ModelCard:
        loaded = loras.get(name)
        if loaded is None:
            return ModelCard(id=model_name, created=created, max_model_len=gen.max_model_len,
                             weight_version=engine.version)
        return ModelCard(id=name, created=loaded.created, max_model_len=gen.max_model_len,
                         weight_version=loaded.gen.engine.version, root=loaded.path, parent=model_name)

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card(model_name), *(card(a.name) for a in loras.all())]).model_dump()

    @api.get("/v1/models/{name:path}")
    async def one_model(name: str) -> dict[str, Any]:
        resolve(name)
        return card(name).model_dump()

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> Any:
        gen = resolve(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format other than text needs constrained decoding, which tether serve "
                                "does not do", param="response_format")
        choice = req.tool_choice
        if choice == "required" or (choice is not None and not isinstance(choice, str)):
            raise APIError(400, "tool_choice 'required' or a named function needs constrained decoding, which "
                                "tether serve does not do; use 'auto' (the default) or 'none'", param="tool_choice")
        tools = None if choice == "none" else req.tools
        prompt = gen.render_chat(req.messages, tools)
        gen.check_prompt(prompt, param="messages")
        max_tokens = gen.max_new(req.max_completion_tokens or req.max_tokens, len(prompt))
        stop_ids, strings = gen.stops(req, gen.chat_stop_ids)
        params = sampling_params(req, max_tokens, stop_ids)
        top_k = (req.top_logprobs or 0) if req.logprobs else 0
        run = gen.choices(prompt, params, n=req.n, strings=strings, top_k=top_k, skip_special_tokens=False)
        ident, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        view = responses.ChatView(gen, parse_tools=bool(tools), first_call_only=req.parallel_tool_calls is False,
                                  logprobs=req.logprobs)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = responses.chat_stream(view, run, ident=ident, created=now, model=req.model, prompt=prompt,
                                         include_usage=include_usage, return_token_ids=req.return_token_ids)
            return StreamingResponse(body, media_type="text/event-stream")
        (choices,) = await responses.gather([run])
        return responses.chat_response(view, choices, ident=ident, created=now, model=req.model, prompt=prompt,
                                       return_token_ids=req.return_token_ids).model_dump()

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        gen = resolve(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported by tether serve", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported by tether serve", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported by tether serve", param="best_of")
        prompts = _prompts(req.prompt, gen)
        for p in prompts:
            gen.check_prompt(p)
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs are not streamed by tether serve; send stream: false",
                           param="prompt_logprobs")
        max_tokens = [gen.max_new(req.max_tokens, len(p)) for p in prompts]
        stop_ids, strings = gen.stops(req, gen.eos_ids)
        runs = [gen.choices(p, sampling_params(req, m, stop_ids), n=req.n, strings=strings,
                             top_k=req.logprobs or 0, skip_special_tokens=req.skip_special_tokens)
                for p, m in zip(prompts, max_tokens)]
        ident, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = responses.completion_stream(gen, runs, prompts, n=req.n, ident=ident, created=now,
                                               model=req.model, logprobs=req.logprobs,
                                               return_token_ids=req.return_token_ids, include_usage=include_usage)
            return StreamingResponse(body, media_type="text/event-stream")
        scored = None  # vLLM's prompt_logprobs: a teacher scoring a student's tokens (tether.teacher)
        if req.prompt_logprobs is not None:
            k = req.prompt_logprobs
            scored = [[None if e is None else {i: PromptLogprob(**v) for i, v in e.items()}
                       for e in await asyncio.to_thread(gen.prompt_logprobs, p, k)] for p in prompts]
        answer = responses.completion_response(gen, await responses.gather(runs), prompts, ident=ident, created=now,
                                               model=req.model, logprobs=req.logprobs,
                                               return_token_ids=req.return_token_ids)
        for j, choice in enumerate(answer.choices if scored is not None else ()):
            choice.prompt_logprobs = scored[j // req.n]  # type: ignore[index]
        return answer.model_dump()

    @api.post("/update_weights_from_disk")
    async def update_from_disk(req: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        state = await weights.read_folder(req.model_path)
        version = engine.version + 1 if req.weight_version is None else req.weight_version
        await weights.apply(gen, state, version)
        return UpdateWeightsResponse(success=True, weight_version=engine.version,
                                     message=f"loaded {len(state)} tensors from {req.model_path}").model_dump()

    @api.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request,
                                 weight_version: int | None = Query(default=None, ge=0)) -> dict[str, Any]:
        state = weights.read_bytes(await request.body())
        version = engine.version + 1 if weight_version is None else weight_version
        await weights.apply(gen, state, version)
        return UpdateWeightsResponse(success=True, weight_version=engine.version,
                                     message=f"loaded {len(state)} tensors from the request body").model_dump()

    @api.post("/update_lora_adapter_from_tensor")
    async def update_lora_from_tensor(request: Request, scaling: float = Query(),
                                      weight_version: int | None = Query(default=None, ge=0)) -> dict[str, Any]:
        adapter = weights.read_bytes(await request.body())
        version = engine.version + 1 if weight_version is None else weight_version
        await adapters.push(gen, adapter, scaling, version)
        return UpdateWeightsResponse(success=True, weight_version=engine.version,
                                     message=f"merged a LoRA adapter of {len(adapter) // 2} layers").model_dump()

    @api.post("/v1/load_lora_adapter")
    async def load_lora(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await loras.load(req.lora_name, req.lora_path, replace=req.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")  # vLLM's answer

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await loras.unload(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @api.get("/get_weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": engine.version}

    app.include_router(api)
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
