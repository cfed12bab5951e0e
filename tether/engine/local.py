"""The in-process torch engine: continuous batching over a slot KV cache, driven by a worker thread.

Why our own scheduler: transformers' continuous batching (``generate_batch``) measured 8-9x *slower*
than plain ``generate`` on 2 CPU threads for the tiny model (412 vs 3,543 tokens/s, 64 x 64 tokens),
and ``generate`` itself wastes the steps between a request's end and the batch's longest one.

One step of the worker loop:
  1. apply queued weight updates — at once when nothing is running; with requests in flight, at the next
     interruption point (partial rollout: every ``segment_length`` decode steps, then their KV caches are
     recomputed under the new weights and a preemption counted for each) or, without partial rollout,
     once they have all finished (new requests wait meanwhile, so every generation has one version);
  2. admit queued requests (up to ``max_batch`` running, ``max_prefill_tokens`` padded new tokens per
     step), each starting from the longest cached prefix (a previous turn's cache, a shared system
     prompt; see ``prefix_cache.py``); prefill them as one batch and sample their first token. The order is
     fair across groups of requests (``fair_share.py``: the group running fewest first, and a group above its
     share of a full batch interrupted for one below it; with ``latency_rows``, large groups capped while a small
     one waits or runs); requests without a group, as rollouts', are admitted first come, first served;
  3. one decode step for every running request; finished requests leave at once.
Sampling (``sampling.py``) is one batched call per step. The truncation parameters (top_k, min_p) ride in it;
the logit-shaping ones (penalties, logit_bias, min_tokens) are computed on the rows that have them only, from
per-request state kept from the first token (a [V] mask of the prompt and output tokens for repetition_penalty, [V]
output counts for presence/frequency), so a batch without them costs what it did before. A grammar
(``SamplingParams.constraint``) is shaping too: its request's matcher masks the row last and accepts each token drawn;
a complete grammar finishes the request ("stop"). Recorded logprobs stay the unshaped, untruncated, unmasked model's
(``tether.engine.base``).
Results go back to each caller's event loop with ``call_soon_threadsafe``. Only the worker thread touches
the model: ``update_weights`` queues the new weights and waits until the worker has loaded them.

Determinism (``deterministic=True``, the config's ``trainer.deterministic``). On a CPU a row of a batched
matmul does not get the bits it gets alone: MKL runs one row through a matrix-vector kernel and several
through blocked ones, and attention's result depends on the padded key length (the step's longest
sequence). Which requests share a step, and which cached prefix a prompt starts from (a running sibling's
prompt, the parked previous turn, or nothing after an eviction), depends on when the requests arrive: on
asyncio and thread timing around tool calls and the user simulator. So two runs of one seed differed in
the last bits of the behaviour logprobs (5e-7, and a token now and then where two were nearly tied), hence
in the loss and the weights. In deterministic mode every request is computed on its own: its whole prompt
in one prefill (no prefix reuse), then one forward per token over its own length, and its own sampling
call. Sampling was per request already: each uniform draw comes from the request's generator, which the
caller seeds from the episode's identity (run seed, task, index, turn), not from arrival order. A
request's tokens and logprobs are then a function of its prompt, its seed and the weights each token was
sampled under, on one machine, torch build and thread count. The cost is the batching: decode time grows
with the number of running requests instead of staying almost flat (engine time 1.8x with 8 concurrent
requests of the tests' small model, 4.3x with 32). A request without a seed draws from the engine's shared
generator in arrival order, which concurrency makes irreproducible.

What that gives per mode: in ``sync`` mode the weights change only between steps, with nothing in flight,
so a run is reproducible bit for bit (metrics apart from wall-clock timings, samples, weights;
``tests/test_determinism.py``). The async modes keep the task plan, the episode seeds and the per-request
guarantee, but the weight version a group starts under, the token where a partial rollout switches
versions, which groups the staleness filter drops and the order groups reach the trainer all follow the
timing between rollouter and trainer: a run repeats only when that timing does (at ``max_staleness`` 0
they equal sync bit for bit). In every mode a wall-clock limit can still fork a run: an episode that
exceeds ``rollout.worker.task_timeout_s`` is retried with another seed, and a tool whose simulated latency
is within the event loop's lag of its ``timeout_ms`` may or may not time out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import torch

from tether.engine.base import FinishReason, GenerationResult, SamplingParams, TokenDelta
from tether.engine.fair_share import NO_CAP, large_groups, next_index, over_cap, victims
from tether.engine.forward import HFRunner, LlamaFamilyRunner, fast_path_problem
from tether.engine.lora import AdapterMerge
from tether.engine.prefix_cache import SlotTable
from tether.engine.request import Request, WeightUpdate, send, wake_all
from tether.engine.sampling import sample, shape_logits

log = logging.getLogger(__name__)


class LocalEngine:
    """InferenceEngine over an in-process HF causal LM.

    Llama/Qwen2/Qwen3 models run on a hand-written batched forward with a slot KV cache and prefix
    reuse; other architectures fall back to one HF forward per sequence per step. The engine snapshots
    the weights: change them only through ``update_weights``.
    """

    def __init__(self, model: Any, *, version: int = 0, num_threads: int | None = None,
                 max_batch: int = 128, max_prefill_tokens: int = 2048, prefix_cache_size: int = 64,
                 recompute_on_update: bool = True, fast_path: bool = True, seed: int = 0,
                 partial_rollout: bool = True, segment_length: int = 1, deterministic: bool = False,
                 latency_rows: int = 0):
        """
        num_threads: ``torch.set_num_threads`` for the worker (process-wide; None leaves it alone).
        max_batch: most requests decoded together; more wait in a queue.
        max_prefill_tokens: padded new prompt tokens prefilled per step (bounds step latency and the
            size of temporaries, which get slow on CPU beyond a few tens of MB).
        prefix_cache_size: finished requests whose KV cache is kept for a later prompt that extends it
            (next turn of a conversation); 0 keeps none. Costs that many extra cache slots.
        recompute_on_update: on a weight update, recompute in-flight requests' caches under the new
            weights (counted in ``num_preempted``); otherwise they keep the caches of the old ones.
        fast_path: use the hand-written forward when the architecture supports it.
        seed: generator for the requests that have no ``seed`` of their own.
        partial_rollout: a weight update interrupts in-flight generations, which resume under the new
            weights with the tokens generated so far (``rollout.partial_rollout.enabled``); False = the
            update waits until the in-flight generations have finished under the weights they started with.
        segment_length: with partial rollout, decode steps between interruption points: once a version is
            in place, every running generation gets at least this many tokens from it before the next
            update is applied (``rollout.partial_rollout.segment_length``; 1 = the next step).
        deterministic: compute every request on its own (a batch of one, no prefix reuse), so that its
            tokens and logprobs do not depend on which requests share a step (``trainer.deterministic``;
            see the module docstring). Costs the batching: decode time grows with the number of running
            requests instead of staying flat.
        latency_rows: fair admission's latency cap (``fair_share.large_groups``): while a group of at most this many
            requests is queued or running, groups of more hold at most this many rows together, the rest parked;
            otherwise they are admitted at most this many rows a step. 0 = off. Requests without a group are never
            capped (``tether serve --latency-rows``).
        """
        if segment_length < 1:
            raise ValueError(f"segment_length must be >= 1 decode step, got {segment_length}")
        self.model = model.eval()
        problem = fast_path_problem(model) if fast_path else "fast_path=False"
        if problem:
            log.info("LocalEngine: HF fallback (one forward per sequence per step): %s", problem)
        self._runner = HFRunner(model) if problem else LlamaFamilyRunner(model)
        self._adapters = AdapterMerge(model)  # update_adapter: the base weights it merges into
        self.deterministic = deterministic
        self._slots = SlotTable(self._runner, prefix_cache_size, reuse=not (problem or deterministic))
        self._max_len = model.config.max_position_embeddings
        self._vocab = model.get_output_embeddings().weight.shape[0]  # logits per row (logit_bias ids are checked)
        self.max_batch, self.max_prefill_tokens, self.latency_rows = max_batch, max_prefill_tokens, latency_rows
        self.recompute_on_update, self.num_threads = recompute_on_update, num_threads
        self.partial_rollout, self.segment_length = partial_rollout, segment_length
        self._segment_steps = segment_length  # decode steps since the last update; starts at a point
        self.stats: Counter[str] = Counter()  # prompt/cached/generated tokens, steps, preemptions, busy_s
        self._version = version
        self._stale = False  # weights changed since the running requests' caches were computed
        self._generator = torch.Generator().manual_seed(seed)
        self._cv = threading.Condition()  # guards _waiting, _updates, _closed
        self._waiting: deque[Request] = deque()
        self._updates: list[WeightUpdate] = []
        self._closed = False
        self._queue: deque[Request] = deque()  # worker-side queue, admitted in order
        self._threads_changed = False  # set_num_threads: the worker applies it before its next step
        self._admitting: list[Request] = []  # the requests the current step took from the queue
        self._grown: list[Request] = []  # streamed requests given tokens in the current step (woken after it)
        self._thread = threading.Thread(target=self._loop, name="tether-local-engine", daemon=True)
        self._thread.start()

    # --- public API --------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, group: Any = None) -> GenerationResult:
        """``group``: requests asked for together (one caller's), admitted fairly against other groups
        (``tether.engine.fair_share``); None: a group of its own."""
        req = self._submit(prompt_ids, params, group=group)
        if isinstance(req, GenerationResult):
            return req
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    async def stream(self, prompt_ids: list[int], params: SamplingParams, *, group: Any = None,
                     every: Callable[[], int] | None = None) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """``generate``, told as it goes: the tokens of each step as a ``TokenDelta`` as soon as the step that made
        them ends, then the finished ``GenerationResult`` (the same as ``generate``'s). Closing the iterator early
        aborts the request at the next step, as cancelling ``generate`` does. ``every``: the caller wants its tokens
        only once ``every()`` of them are new (asked by the engine's thread after each step), the first at once and
        the last when the request ends: fewer wake-ups of the caller's event loop, whose work for them competes with
        the engine's for the interpreter."""
        req = self._submit(prompt_ids, params, group=group, streamed=True, every=every)
        if isinstance(req, GenerationResult):
            yield req
            return
        sent = 0
        try:
            while True:
                if req.future.done():
                    result = req.future.result()
                    if len(result.token_ids) > sent:
                        yield TokenDelta(result.token_ids[sent:], result.logprobs[sent:], result.versions[sent:])
                    yield result
                    return
                n = len(req.versions)  # appended last of the three (_emit), on the worker thread
                if n > sent:
                    yield TokenDelta(req.tokens[sent:n], req.logprobs[sent:n], req.versions[sent:n])
                    sent = n
                    continue
                req.waiter = req.loop.create_future()  # (a wake for tokens read above finds it done: harmless)
                await req.waiter
        finally:
            if not req.future.done():
                req.cancelled = True
                req.future.cancel()

    def _submit(self, prompt_ids: list[int], params: SamplingParams, group: Any = None, streamed: bool = False,
                every: Callable[[], int] | None = None) -> Request | GenerationResult:
        """Queue a request (or return the empty result of one that has no room for a token)."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        params.check(self._vocab)
        if len(prompt_ids) >= self._max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                             f"{self._max_len} positions")
        max_new = min(params.max_tokens, self._max_len - len(prompt_ids))
        if max_new <= 0:
            return GenerationResult([], [], "length", [], 0)
        loop = asyncio.get_running_loop()
        gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        req = Request(list(prompt_ids), params, max_new, loop, loop.create_future(), gen,
                      truncates=bool(params.top_k or params.min_p), shapes=params.shapes_logits,
                      group=group, streamed=streamed, every=every,
                      matcher=None if params.constraint is None else params.constraint.matcher(params.stop_token_ids))
        with self._cv:
            if self._closed:
                raise RuntimeError("LocalEngine is closed")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load ``state_dict`` (all or some of the model's keys) at the next step boundary.

        Blocks until the worker has copied the weights in (at most one step), so the caller may reuse
        or modify its tensors afterwards, and every token sampled later carries ``version``. The weights loaded
        are the new base of a later ``update_adapter``.
        """
        self._load(state_dict, version)
        self._adapters.forget(state_dict)

    def update_adapter(self, adapter: dict[str, torch.Tensor], scaling: float, version: int) -> None:
        """Serve the base model plus a LoRA adapter (A, B by layer name; ``tether.engine.lora``) as ``version``: the
        adapter is merged into a copy of the base weights and loaded as ``update_weights`` loads weights."""
        self._load(self._adapters.merged(adapter, scaling), version)

    def unload_adapter(self, version: int) -> None:
        """Serve the base model again (the weights an adapter replaced) as ``version``."""
        self._load(self._adapters.base(), version)

    def _load(self, state_dict: dict[str, Any], version: int) -> None:
        update = WeightUpdate(state_dict, version)
        with self._cv:
            if self._closed:
                raise RuntimeError("LocalEngine is closed")
            self._updates.append(update)
            self._cv.notify()
        update.done.wait()
        if update.error is not None:
            raise update.error

    def set_num_threads(self, n: int) -> None:
        """The worker's torch threads from its next step on (e.g. half the cores when a learner computes beside it)."""
        if n < 1:
            raise ValueError(f"num_threads must be >= 1, got {n}")
        with self._cv:
            if n == self.num_threads:
                return
            self.num_threads = n
            self._threads_changed = True
            self._cv.notify()

    def close(self) -> None:
        """Stop the worker; requests still waiting or running end with finish_reason "abort"."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- worker ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._closed or self._waiting or self._queue or self._slots.running
                               or self._updates or self._threads_changed):
                        self._cv.wait()
                    if self._closed:
                        break
                    if self._threads_changed and self.num_threads:
                        torch.set_num_threads(self.num_threads)
                        self._threads_changed = False
                    updates = []
                    if self._updates and self._may_interrupt():
                        updates, self._updates = self._updates, []
                    self._queue.extend(self._waiting)
                    self._waiting.clear()
                for update in updates:
                    self._apply(update)
                try:
                    t0 = time.perf_counter()
                    self._step()
                    if self._grown:  # streamed requests that got tokens this step
                        wake_all(self._grown)
                        self._grown = []
                    # compute time (perf/engine_busy_s); typeshed's Counter holds ints, a Counter holds any number
                    self.stats["busy_s"] += time.perf_counter() - t0  # type: ignore[assignment]
                except Exception as exc:  # a failed step fails its requests, not the engine
                    log.exception("LocalEngine step failed")
                    running = self._slots.running
                    for req in [*running, *(r for r in self._admitting if r not in running)]:
                        send(req, exc)  # (a request taken from the queue but not yet placed is failed too)
                    self._slots.clear()
        with self._cv:
            leftover = [*self._slots.running, *self._queue, *self._waiting]
            updates, self._updates = self._updates, []
        for req in leftover:
            self._finish(req, "abort")
        for update in updates:
            update.error = RuntimeError("LocalEngine closed before applying the update")
            update.done.set()

    def _may_interrupt(self) -> bool:
        """Whether a pending weight update may be applied now (called under the lock)."""
        if not self._slots.running:
            return True
        return self.partial_rollout and self._segment_steps >= self.segment_length

    def _apply(self, update: WeightUpdate) -> None:
        try:
            unknown = sorted(set(update.state_dict) - set(self.model.state_dict()))
            if unknown:
                raise KeyError(f"update_weights: keys not in the model: {unknown[:5]}")
            self.model.load_state_dict(update.state_dict, strict=False)
            self._runner.reload()
            self._version = update.version
            self._stale = True
            self._segment_steps = 0
        except Exception as exc:  # noqa: BLE001 — reported to the caller of update_weights
            update.error = exc
        finally:
            update.done.set()

    def _step(self) -> None:
        version, slots = self._version, self._slots
        self.stats["steps"] += 1
        if self._stale:
            self._stale = False
            slots.drop_prefixes(running_too=not self.recompute_on_update)
            if slots.running and self.recompute_on_update:
                self._refill()
        new: list[Request] = []  # taken from the queue this step (failed with it if it fails)
        self._admitting = new
        starts: list[int] = []
        widest = 0
        draining = bool(self._updates) and not self.partial_rollout  # an update waits for the running to end
        interrupts = self.partial_rollout and not self.deterministic  # resumed from parked caches
        large, capped = large_groups(self._queue, slots.running, self.latency_rows) if self.latency_rows else NO_CAP
        if large:  # a capped group's cancelled requests may not reach the front for long: drop them now
            self._queue = deque(r for r in self._queue if not r.cancelled)
        if capped and interrupts and not draining:
            self._interrupt(over_cap(slots.running, large, self.latency_rows), "latency_parked")
        if self._queue and len(slots.running) >= self.max_batch and not draining and interrupts:
            self._interrupt(victims(self._queue, slots.running, self.max_batch))
        counts = Counter(r.group for r in slots.running)
        # rows the large groups may take this step: up to the cap while it is on, else ``latency_rows`` more
        room = self.latency_rows - (sum(counts[g] for g in large) if capped else 0)
        while self._queue and len(slots.running) < self.max_batch and not draining:
            i = next_index(self._queue, counts, large if room <= 0 else ())
            if i < 0:  # only capped groups wait
                break
            req = self._queue[i]
            if req.cancelled:
                del self._queue[i]
                continue
            context = req.context
            entry, cached = slots.lookup(context)
            widest_next = max(widest, len(context) - cached)
            if new and (len(new) + 1) * widest_next > self.max_prefill_tokens:
                break
            del self._queue[i]
            new.append(req)
            counts[req.group] += 1
            room -= req.group in large
            starts.append(slots.place(req, entry, cached))
            widest = widest_next
        if new:
            first = len(slots.running) - len(new)
            # When every new prompt is cached but its last token (a group's samples after the first), that token is
            # their input to this step's decode: no prefill call for them.
            tail_only = all(0 < st == len(r.context) - 1 for r, st in zip(new, starts))
            for a, b in self._batches(len(new)) if not tail_only else ():
                logits = self._runner.prefill([r.context for r in new[a:b]], list(range(first + a, first + b)),
                                              starts[a:b])
                self._emit(new[a:b], logits, version)
            self.stats["prompt_tokens"] += sum(len(r.context) for r in new)
            self.stats["cached_prompt_tokens"] += sum(starts)
            for req in new:
                slots.index(req)
            self._retire()
        if slots.running:
            self._segment_steps += 1
            running = slots.running
            shared = 0 if self.deterministic else slots.shared_prompt()
            for a, b in self._batches(len(running)):
                inputs = [r.tokens[-1] if r.tokens else r.prompt[-1] for r in running[a:b]]  # (tail_only)
                logits = self._runner.decode(inputs, first=a, shared=shared)
                self._emit(running[a:b], logits, version)
            self._retire()

    def _interrupt(self, reqs: list[Request], stat: str = "fair_interruptions") -> None:
        """Fair admission's interruption: park ``reqs``' caches and queue them first again, their tokens kept;
        counted in ``stats[stat]``."""
        if not reqs:
            return
        chosen = set(reqs)  # by identity (eq=False)
        done = [r in chosen for r in self._slots.running]
        order = [r for r in self._slots.running if r in chosen]
        self._slots.retire(done, park=done)
        for r in reversed(order):
            r.num_preempted += 1
            self._queue.appendleft(r)
        self.stats[stat] += len(order)

    def _batches(self, n: int) -> list[tuple[int, int]]:
        """Row ranges [a, b) of the n requests at hand that one forward computes: all of them together,
        or, in deterministic mode, each on its own."""
        return [(i, i + 1) for i in range(n)] if self.deterministic else [(0, n)]

    def _refill(self) -> None:
        """Recompute every running request's cache under the current weights, in prefill-sized chunks."""
        running = self._slots.running
        order = sorted(range(len(running)), key=lambda i: len(running[i].prompt) + len(running[i].tokens))
        chunk: list[int] = []
        for i in [*order, None]:
            length = 0 if i is None else len(running[i].prompt) + len(running[i].tokens) - 1
            if chunk and (i is None or self.deterministic or (len(chunk) + 1) * length > self.max_prefill_tokens):
                self._runner.prefill([running[j].prompt + running[j].tokens[:-1] for j in chunk], chunk)
                chunk = []
            if i is not None:
                chunk.append(i)
        for req in running:
            req.num_preempted += 1
        self.stats["preemptions"] += len(running)

    def _emit(self, reqs: list[Request], logits: torch.Tensor, version: int) -> None:
        """Sample one token for each of ``reqs`` from ``logits`` [len(reqs), V] and record it."""
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in reqs], device=device)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=device)
        # drawn on the CPU, where the generators live
        shared = sum(r.params.temperature > 0 and r.generator is None for r in reqs)  # from the engine's generator
        common = iter(torch.rand(shared, generator=self._generator).tolist())  # in the requests' order
        uniform = torch.tensor([0.0 if r.params.temperature <= 0 else r.uniform() if r.generator is not None
                                else next(common) for r in reqs])
        extra: dict[str, Any] = {}
        if any(r.truncates for r in reqs):
            extra["top_k"] = torch.tensor([r.params.top_k for r in reqs], device=device)
            extra["min_p"] = torch.tensor([r.params.min_p for r in reqs], device=device)
        shaped = [i for i, r in enumerate(reqs) if r.shapes]
        if shaped:
            extra["shaped"] = self._shaped([reqs[i] for i in shaped], logits, shaped)
        tokens, logprobs = sample(logits, temperature, top_p, uniform.to(device), **extra)
        self.stats["generated_tokens"] += len(reqs)
        for r, tok, lp in zip(reqs, tokens.tolist(), logprobs.tolist()):
            r.tokens.append(tok)
            r.logprobs.append(lp)
            r.versions.append(version)
            if r.seen is not None:
                r.seen[tok] = True
            if r.counts is not None:
                r.counts[tok] += 1
            if r.matcher is not None:
                r.matcher.accept(tok)
            if r.streamed and r.tell():
                self._grown.append(r)
            if tok in r.params.stop_token_ids or (r.matcher is not None and r.matcher.terminated):
                r.finish = "stop"
            elif len(r.tokens) >= r.max_new:
                r.finish = "length"

    @staticmethod
    def _shaped(reqs: list[Request], logits: torch.Tensor, where: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``where`` [S] of ``logits`` and their shaped logits [S, V] (``sample``'s ``shaped``) for ``reqs``,
        the requests of those rows, whose penalty state is created at their first token."""
        dev, vocab = logits.device, logits.shape[1]
        for r in reqs:
            p = r.params
            if p.repetition_penalty != 1.0 and r.seen is None:
                r.seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
                r.seen[torch.tensor([*r.prompt, *r.tokens], device=dev)] = True
            if (p.presence_penalty or p.frequency_penalty) and r.counts is None:  # (no tokens yet: the first emit)
                r.counts = torch.zeros(vocab, device=dev)

        def ids(values: list[Any], dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        pairs = [(i, tok, b) for i, r in enumerate(reqs) for tok, b in r.params.logit_bias]
        bias = None if not pairs else (ids([i for i, _, _ in pairs]), ids([t for _, t, _ in pairs]),
                                       ids([b for _, _, b in pairs], logits.dtype))
        stops = [(i, tok) for i, r in enumerate(reqs) if len(r.tokens) < r.params.min_tokens
                 for tok in r.params.stop_token_ids if tok < vocab]
        banned = None if not stops else (ids([i for i, _ in stops]), ids([t for _, t in stops]))
        rep = [(i, r.params.repetition_penalty, r.seen) for i, r in enumerate(reqs) if r.seen is not None]
        repetition = None if not rep else (ids([i for i, _, _ in rep]), ids([pen for _, pen, _ in rep], logits.dtype),
                                           torch.stack([seen for _, _, seen in rep]))
        freq = [(i, r.params, r.counts) for i, r in enumerate(reqs) if r.counts is not None]
        counts = None if not freq else (
            ids([i for i, _, _ in freq]), ids([q.presence_penalty for _, q, _ in freq], logits.dtype),
            ids([q.frequency_penalty for _, q, _ in freq], logits.dtype), torch.stack([n for _, _, n in freq]))
        shaped = shape_logits(logits[ids(where)], bias=bias, banned=banned, repetition=repetition, counts=counts)
        for k, r in enumerate(reqs):  # a grammar's mask last: the tokens it does not allow next get -inf
            if r.matcher is not None:
                r.matcher.mask(shaped[k:k + 1])
        return ids(where), shaped

    def _retire(self) -> None:
        """Hand finished (or cancelled) requests back; their caches stay parked for a next turn."""
        running = self._slots.running
        done = [r.finish is not None or r.cancelled for r in running]
        if not any(done):
            return
        for r, d in zip(running, done):
            if d:
                self._finish(r, r.finish or "abort")
        self._slots.retire(done, park=[r.finish is not None for r in running])

    def _finish(self, req: Request, reason: FinishReason) -> None:
        send(req, GenerationResult(req.tokens, req.logprobs, reason, req.versions, req.num_preempted))
