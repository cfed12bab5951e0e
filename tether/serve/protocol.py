"""The wire format of ``tether serve``: OpenAI's request and response bodies, plus the vLLM / SGLang fields that
token-in/token-out training needs, plus tether's own per-token ``weight_versions``.

Requests forbid unknown top-level fields (an answer to a field the server would silently ignore is a lie: 400 naming
it); a few that change nothing here are accepted by name (``user``, ``metadata``, ``store``, ``service_tier``). Every
sampling parameter of OpenAI and vLLM that the engine implements (``tether.engine.base.SamplingParams``) is accepted
and acts, and so do ``tool_choice``, ``response_format`` and a tool's ``strict`` (grammar-constrained decoding:
``tether.serve.structured``); fields that OpenAI defines but tether does not implement (``echo``, ``suffix``,
``best_of`` > ``n``) are accepted only at their neutral value; anything else answers 400 naming the field.
Messages and tools inside a request ignore unknown keys, as OpenAI's own server does: a client that appends a
response's ``message`` object to its history sends ``refusal``, ``annotations`` and the like.

Extensions, by origin:
- vLLM: ``return_token_ids`` (``prompt_token_ids`` and per-choice ``token_ids``), ``stop_token_ids``,
  ``ignore_eos``, ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``include_stop_str_in_output``,
  ``skip_special_tokens`` (chat: default false, the text the policy was trained to write and the tool parser reads;
  completions: default true), per-choice ``stop_reason``; a prompt of token ids;
  ``prompt_logprobs`` (completions, not streamed): each prompt token's log-probability and rank, and the top k at
  each position — how a teacher scores a student's tokens (``tether.teacher``).
- SGLang: ``/update_weights_from_disk`` and ``/get_weight_version`` bodies.
- tether: per-choice ``weight_versions`` (the policy version of each generated token: a partial rollout can span
  versions) and ``num_preempted`` (times a weight update interrupted the generation).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128  # choices per request
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI allows 20 in chat, vLLM 20 everywhere)
SEED_MAX = 2**63 - 1  # seeds are 64-bit signed integers (vLLM's bounds; torch's generators take them)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------------------------------------- errors


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error | authentication_error | not_found_error | server_error
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


# --------------------------------------------------------------------------------------------- requests


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments valid under parameters even under tool_choice auto (serve/structured.py)


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a dict is accepted too


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # text parts only: the served models read text
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class _Sampling(_Body):
    """Fields shared by chat and text completions."""

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Temperature | None = None  # None = 1.0; 0 = greedy
    top_p: TopP | None = None  # None = 1.0
    seed: Annotated[int, Field(ge=-SEED_MAX - 1, le=SEED_MAX)] | None = None  # choice i samples with seed + i
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # Sampling parameters of the engine (tether.engine.base.SamplingParams: what each does, in which order).
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM: -1 or 0 = off
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # 1 = off
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None  # no stop (token or string) before this many tokens
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (as text) → bias
    include_stop_str_in_output: bool = False  # vLLM: the text keeps the stop string or stop token that ended it
    # Accepted and ignored: they change nothing in what is generated.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False = only the first parsed call is returned
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None = the rest of the model's context
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name for max_tokens
    response_format: dict[str, Any] | None = None
    skip_special_tokens: bool = False  # vLLM's default is true: tether's chat text is the agent loop's
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (enable_thinking, ...)


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default; None = the rest of the context
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # 0 = sampled tokens only
    skip_special_tokens: bool = True
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # vLLM: score the prompt's tokens


class UpdateWeightsFromDiskRequest(_Body):
    model_path: str  # a Hugging Face folder with *.safetensors files
    weight_version: Annotated[int, Field(ge=0)] | None = None  # None = the served version + 1
    load_format: Literal["auto", "safetensors"] | None = None  # SGLang's field; safetensors is what is read


class LoadLoRAAdapterRequest(_Body):
    """vLLM's body of ``POST /v1/load_lora_adapter``."""

    lora_name: Annotated[str, Field(min_length=1)]  # the ``model`` requests send to use it
    lora_path: str  # a folder in peft's format on the server: adapter_config.json + adapter_model.safetensors
    load_inplace: bool = False  # replace an adapter already loaded under lora_name (else 400)


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's body of ``POST /v1/unload_lora_adapter``."""

    lora_name: Annotated[str, Field(min_length=1)]


# -------------------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tether"
    max_model_len: int | None = None
    weight_version: int
    root: str | None = None  # vLLM: a LoRA adapter's folder
    parent: str | None = None  # vLLM: the model a LoRA adapter applies to (None for the served model)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class _Extensions(BaseModel):
    stop_reason: int | str | None = None  # vLLM: the stop token id or stop string that ended the choice
    token_ids: list[int] | None = None  # vLLM, with return_token_ids: generated ids, stop id included
    weight_versions: list[int]  # tether: policy version of each generated token
    num_preempted: int = 0  # tether: weight updates that interrupted and resumed this generation


class ChatChoice(_Extensions):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: a token's log-probability at a prompt position, its rank in the vocabulary (1 = best)."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(_Extensions):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"]
    prompt_token_ids: list[int] | None = None  # vLLM, with return_token_ids
    # vLLM, with prompt_logprobs = k: per prompt position (None at the first), the prompt token and the top k, by id
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class UpdateWeightsResponse(BaseModel):
    success: bool
    weight_version: int
    message: str
