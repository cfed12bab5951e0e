"""The InferenceEngine protocol over an OpenAI-compatible server (``engine.type: remote``).

Token ids in, token ids and behaviour logprobs out: training stays token-in/token-out, nothing is re-tokenised.
One ``generate`` is one ``POST {base_url}/completions`` through ``tether.llm.LLMClient`` (its retries, shared
rate limits and error taxonomy)::

    {"model", "prompt": [ids], "max_tokens", "temperature", "top_p", "seed", "logprobs": 0,
     "stop_token_ids": [...], "ignore_eos": true, "return_token_ids": true,
     "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias"}
    → choices[0]: token_ids, logprobs.token_logprobs, finish_reason, weight_versions, num_preempted

``logprobs: 0`` asks for the sampled tokens' logprobs only (1 would make ``tether serve`` run a forward pass for
the alternatives, which nothing here reads); ``ignore_eos`` leaves the request's ``stop_token_ids`` — the agent
loop's end-of-turn ids, EOS among them — as the only stops, as ``LocalEngine`` has them. ``token_ids`` are the
vLLM extension (``return_token_ids``); a server that only returns ``logprobs.tokens`` as ``token_id:N`` strings
(vLLM's ``--return-tokens-as-token-ids``) is read too. ``weight_versions`` and ``num_preempted`` are tether's
extensions: without them every token carries the version pushed when the request was sent, and a request
counts no preemption. The last seven are sent only when they are on (vLLM's names; ``shaping_fields``).
Logprobs are what the server returns; ``tether serve`` returns the engine's ``log_softmax(logits / T)`` of the
unshaped logits before truncation (``tether.engine.base``), which the learner recomputes. vLLM's default
``logprobs_mode`` (raw_logprobs) is unshaped too, but taken before temperature as well; its processed modes would
make every penalty show as a behaviour/target mismatch.

Weight sync (``update_weights``, called by the trainer's ``WeightSync`` at every sync) pushes the whole state
dict and tags it with the version, at the server root (``base_url`` less ``/v1``):

- default, ``POST /update_weights_from_tensor?weight_version=N`` with the body ``safetensors.torch.save`` of the
  tensors (a tensor sharing storage with an earlier one, as tied embeddings do, is sent once);
- with ``engine.weight_sync_dir`` (a folder the server can read too), the tensors are written there as
  ``v{N}/model.safetensors`` (+ ``config.json``) and ``POST /update_weights_from_disk`` ``{"model_path",
  "weight_version"}`` — SGLang's endpoint. The previous version's folder is removed once the server has loaded
  the new one.

With ``model.lora`` the trainer pushes the adapter alone (``update_adapter``, from ``WeightSync``): A [r, in] and
B [out, r] of every adapted layer by the base model's layer names, ``POST /update_lora_adapter_from_tensor?
weight_version=N&scaling=S`` with the body ``safetensors.torch.save`` of them — tether serve's own endpoint (SGLang
and vLLM load adapters by name for requests, not into the served model at a version), after which the server serves
its base plus s · B @ A (``tether.serve.adapters``). Megabytes instead of the model's gigabytes. Always in the
request body: ``engine.weight_sync_dir`` is refused with ``model.lora`` at load (only tether serve takes the push,
and it takes it in the body).

The call returns when the server has answered ``success``: every token sampled afterwards carries the version.
Pushes are counted and timed in ``stats`` (``weight_updates``, ``weight_update_s``, ``weight_update_bytes``).

``stats["busy_s"]``: the remote engine cannot see the server's compute, so it counts the wall time during which
at least one of its requests was in flight (the trainer's ``perf/engine_busy_s``). An endpoint failure raises
the client's error type (``AuthError``, ``ServerError``, …) with its diagnosis, from this module, so the rollouter
files the failed episode under ``rollout/episode_failures/engine``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save, save_file

from tether.engine.base import FinishReason, GenerationResult, SamplingParams
from tether.llm import BadRequest, LLMError, MalformedResponse
from tether.metrics import BusyClock

T = TypeVar("T")
_FINISH: tuple[FinishReason, ...] = ("stop", "length", "abort")


class RemoteEngine:
    """InferenceEngine over an OpenAI-compatible server reached through ``client`` (a ``tether.llm.LLMClient``).

    version: the version of the weights the server holds now (the caller pushes them first when it does not
        know: ``tether.runtime.rollout_engine``).
    max_model_len: the model's context (``max_position_embeddings``): a prompt that fills it is refused and
        ``max_tokens`` clipped to the rest, as ``LocalEngine`` does; None leaves both to the server.
    weight_sync_dir: push weights through this folder and ``/update_weights_from_disk``; None = in the request
        body (``/update_weights_from_tensor``).
    model_config: an HF config written beside the weights in ``weight_sync_dir`` (a loadable checkpoint folder).
    update_timeout_s: the timeout of one weight push, seconds (a large model's body takes a while).
    """

    def __init__(self, client: Any, *, version: int = 0, max_model_len: int | None = None,
                 weight_sync_dir: str | Path | None = None, model_config: Any = None, update_timeout_s: float = 600.0):
        self.client = client
        self.max_model_len = max_model_len
        self.weight_sync_dir = Path(weight_sync_dir) if weight_sync_dir is not None else None
        self.model_config = model_config
        self.update_timeout_s = update_timeout_s
        self.stats: defaultdict[str, float] = defaultdict(float)  # requests, tokens, busy_s, weight_update*
        self._version = version
        self._lock = threading.Lock()  # guards stats and the in-flight count (requests come from several loops)
        self._clock = BusyClock()  # stats["busy_s"]: wall time with a request in flight
        self._last_folder: Path | None = None
        self._control = _LoopThread()  # weight pushes run on a loop of their own: update_weights is synchronous
        self._closed = False

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        params.check()
        if params.constraint is not None:
            raise ValueError("constraint: grammar-constrained decoding runs in the local engine; a remote server's own "
                             "structured outputs are not wired through RemoteEngine")
        max_new = params.max_tokens
        if self.max_model_len is not None:
            if len(prompt_ids) >= self.max_model_len:
                raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                                 f"{self.max_model_len} positions")
            max_new = min(max_new, self.max_model_len - len(prompt_ids))
        if max_new <= 0:
            return GenerationResult([], [], "length", [], 0)
        if self._closed:
            raise RuntimeError("RemoteEngine is closed")
        body: dict[str, Any] = {"max_tokens": max_new, "temperature": params.temperature, "top_p": params.top_p,
                                "logprobs": 0, "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True,
                                "return_token_ids": True}
        if params.seed is not None:
            body["seed"] = params.seed
        body.update(shaping_fields(params, max_new))
        sent_under = self._version
        self._enter()
        try:
            answer = await self.client.completions(list(prompt_ids), **body)
        except LLMError as e:  # raised again from here: the rollouter files it under the engine
            raise type(e)(str(e), url=e.url, status=e.status, body=e.body, attempts=e.attempts) from e
        finally:
            self._leave()
        result = parse_choice(answer["choices"][0], sent_under, self.client.url_for("completions"))
        with self._lock:
            self.stats["requests"] += 1
            self.stats["prompt_tokens"] += len(prompt_ids)
            self.stats["generated_tokens"] += len(result.token_ids)
            self.stats["preemptions"] += result.num_preempted
        return result

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Push ``state_dict`` to the server as ``version``; returns once the server has loaded it."""
        if self._closed:
            raise RuntimeError("RemoteEngine is closed")
        t0 = time.perf_counter()
        if self.weight_sync_dir is None:
            payload = state_bytes(state_dict)
            path = f"/update_weights_from_tensor?weight_version={version}"
            request = self.client.post(path, content=payload, timeout_s=self.update_timeout_s)
            size = len(payload)
        else:
            folder, size = self._write_folder(state_dict, version)
            path = "/update_weights_from_disk"
            # the version as a string: SGLang's field is a str, tether serve's an int that reads "3" as 3
            request = self.client.post(path, {"model_path": str(folder), "weight_version": str(version)},
                                       timeout_s=self.update_timeout_s)
        self._push(path, request, version, "the learner's weights cannot reach it: tether serve has both update "
                   "endpoints; for SGLang set engine.weight_sync_dir to a folder it can read "
                   "(/update_weights_from_disk); vLLM syncs weights through its own weight-transfer API, which tether "
                   "does not drive")
        if self.weight_sync_dir is not None:
            if self._last_folder is not None and self._last_folder != folder:
                shutil.rmtree(self._last_folder, ignore_errors=True)
            self._last_folder = folder
        self._count(t0, size)

    def update_adapter(self, adapter: dict[str, Any], scaling: float, version: int) -> None:
        """Push a LoRA adapter (``{"<layer>.lora_A": A [r, in], "<layer>.lora_B": B [out, r]}``, scaling s = alpha /
        rank) as ``version``: the server then serves its base weights plus s · B @ A. Only A and B travel, in the
        request body (``/update_lora_adapter_from_tensor``, tether serve's); returns once the server has merged it."""
        if self._closed:
            raise RuntimeError("RemoteEngine is closed")
        if self.weight_sync_dir is not None:
            raise ValueError("a LoRA adapter is pushed in the request body, not through engine.weight_sync_dir: "
                             "unset engine.weight_sync_dir (tether serve takes the adapter in the body)")
        t0 = time.perf_counter()
        payload = state_bytes(adapter)
        path = f"/update_lora_adapter_from_tensor?weight_version={version}&scaling={float(scaling)!r}"
        request = self.client.post(path, content=payload, timeout_s=self.update_timeout_s)
        self._push(path, request, version, "a LoRA run's adapter cannot reach it: with model.lora the rollout server "
                   "must be `tether serve` (SGLang and vLLM load adapters by name for requests, not into the served "
                   "model at a weight version); or train without model.lora")
        self._count(t0, len(payload))

    def _push(self, path: str, request: Coroutine[Any, Any, Any], version: int, why: str) -> None:
        """Run a weight push; a 404 / 405 (no such endpoint) is explained with ``why``; the server must report
        ``version``."""
        try:
            answer = self._control.run(request)
        except BadRequest as e:
            if e.status not in (404, 405):
                raise
            raise BadRequest(f"{e}\n  The server has no {path.partition('?')[0]} endpoint, so {why}",
                             url=e.url, status=e.status, body=e.body, attempts=e.attempts) from e
        _check_update(answer, version, self.client.url_for(path))
        self._version = version

    def _count(self, t0: float, size: int) -> None:
        with self._lock:
            self.stats["weight_updates"] += 1
            self.stats["weight_update_s"] += time.perf_counter() - t0
            self.stats["weight_update_bytes"] += size

    def server_version(self) -> int:
        """The version the server reports (``GET /get_weight_version``)."""
        return int(self._control.run(self.client.get("/get_weight_version"))["weight_version"])

    def close(self) -> None:
        """Stop the control loop and close its connections; the server keeps running (it is not ours)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._control.run(self.client.aclose())
        finally:
            self._control.close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- bookkeeping -------------------------------------------------------------------------------

    def _enter(self) -> None:
        self._clock.enter()

    def _leave(self) -> None:
        self._clock.leave()
        with self._lock:
            self.stats["busy_s"] = self._clock.busy_s

    def _write_folder(self, state_dict: dict[str, Any], version: int) -> tuple[Path, int]:
        """``weight_sync_dir/v{version}``: model.safetensors (+ config.json), written whole before it appears."""

        assert self.weight_sync_dir is not None
        self.weight_sync_dir.mkdir(parents=True, exist_ok=True)
        folder = self.weight_sync_dir / f"v{version}"
        tmp = self.weight_sync_dir / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(unique_tensors(state_dict), str(tmp / "model.safetensors"))
        if self.model_config is not None:
            self.model_config.to_json_file(str(tmp / "config.json"))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return folder, (folder / "model.safetensors").stat().st_size


def shaping_fields(params: SamplingParams, max_new: int) -> dict[str, Any]:
    """The request fields of ``params``' truncation and shaping parameters that are on, by vLLM's names (a server
    that does not know them never sees them at their defaults). ``min_tokens`` is clipped to ``max_new``: vLLM refuses
    a larger one, and the length limit ends the generation first anyway; ``logit_bias`` is OpenAI's map of token id
    strings to biases."""
    p, fields = params, {}
    for name, off in (("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                      ("frequency_penalty", 0.0)):
        if getattr(p, name) != off:
            fields[name] = getattr(p, name)
    if p.min_tokens:
        fields["min_tokens"] = min(p.min_tokens, max_new)
    if p.logit_bias:
        fields["logit_bias"] = {str(tok): bias for tok, bias in p.logit_bias}
    return fields


def unique_tensors(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """CPU, contiguous copies of ``state_dict``'s tensors; a tensor that shares its storage with an earlier one
    (tied embeddings) is kept once, under the first name: safetensors refuses shared storage, and loading the
    first name fills both."""
    seen: set[tuple[int, int]] = set()
    kept = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        kept[name] = t.detach().to("cpu").contiguous()
    return kept


def state_bytes(state_dict: dict[str, Any]) -> bytes:
    """The body of ``/update_weights_from_tensor``: ``safetensors.torch.save`` of ``unique_tensors``."""

    return save(unique_tensors(state_dict))


def parse_choice(choice: Any, version: int, url: str) -> GenerationResult:
    """A completion choice as a GenerationResult; ``version`` tags the tokens when the server gives none.

    Raises MalformedResponse naming the missing field: training needs the exact ids and their logprobs."""
    def bad(what: str) -> MalformedResponse:
        shown = json.dumps(choice)[:500]
        return MalformedResponse(f"POST {url}: {what}. The remote engine trains on the server's token ids and "
                                 f"logprobs and never re-tokenises text; choice: {shown}", url=url, body=shown)

    if not isinstance(choice, dict):
        raise bad("the choice is not an object")
    lp: dict[str, Any] = choice["logprobs"] if isinstance(choice.get("logprobs"), dict) else {}
    ids = choice.get("token_ids")
    if ids is None:  # vLLM with --return-tokens-as-token-ids: "token_id:123"
        tokens = lp.get("tokens")
        if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t[len("token_id:"):]) for t in tokens]
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise bad("the choice has no `token_ids` (send return_token_ids: true to a server that supports it — vLLM "
                  ">= 0.10.2, tether serve — or start vLLM with --return-tokens-as-token-ids)")
    logprobs = lp.get("token_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(ids) \
            or not all(isinstance(x, (int, float)) for x in logprobs):
        raise bad(f"`logprobs.token_logprobs` is not {len(ids)} numbers, one per generated token")
    versions = choice.get("weight_versions")
    if versions is None:
        versions = [version] * len(ids)
    elif not isinstance(versions, list) or len(versions) != len(ids):
        raise bad(f"`weight_versions` is not {len(ids)} versions, one per generated token")
    finish = choice.get("finish_reason")
    if finish not in _FINISH:
        raise bad(f"finish_reason {finish!r} is not one of {list(_FINISH)}")
    preempted = choice.get("num_preempted")
    if not isinstance(preempted, int):  # a server without it: each change of version is one interruption
        preempted = sum(a != b for a, b in zip(versions, versions[1:]))
    return GenerationResult(list(ids), [float(x) for x in logprobs], finish, [int(v) for v in versions], preempted)


def _check_update(answer: Any, version: int, url: str) -> None:
    if not isinstance(answer, dict) or answer.get("success") is False:
        raise MalformedResponse(f"POST {url}: the server did not load the weights of version {version}: "
                                f"{str(answer)[:500]}", url=url)
    said = answer.get("weight_version")
    if said is not None and str(said) != str(version):
        raise MalformedResponse(f"POST {url}: the server holds weight version {said} after loading version "
                                f"{version}: another trainer is pushing to the same server?", url=url)


class _LoopThread:
    """An event loop in a daemon thread: ``run(coro)`` from synchronous code, in any thread, even one whose own
    loop is running (``asyncio.run`` would refuse there). One loop, so the client keeps one connection pool."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tether-remote-engine", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
