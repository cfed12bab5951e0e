"""Teachers that score a finished segment — prompt + response ids — token by token, asynchronously.

``score_trajectory`` is called by the rollouter as each episode finishes (``Rollouter(score=...)``), inside the
episode's own coroutine: the other episodes keep generating meanwhile, and a group reaches the trainer once its
trajectories are scored — the reward loop's shape (verl scores per sample in ``_agent_loop_postprocess``).

- ``LocalTeacher``: a checkpoint in this process, run by one worker thread that takes every segment waiting and
  scores them in one right-padded forward (no lock with the rollout engine: it has its own thread and weights).
  ``deterministic`` scores one segment per forward, so a score does not depend on which others arrived with it.
- ``RemoteTeacher``: ``POST /v1/completions`` with the ids as the prompt, ``max_tokens: 1``, ``temperature: 1``
  and ``prompt_logprobs: k`` (vLLM's extension, as verl's teacher loop sends it; ``tether serve`` has it): the
  answer's ``prompt_logprobs[t]`` maps ids to ``{"logprob", "rank"}`` — the prompt token's own and the top k.

Scores are the teacher's log_softmax(logits) at temperature 1 (verl forces 1.0; vLLM's prompt log-probs are the
raw model's). A scoring failure (after the client's retries) is raised: the rollouter counts the episode as
failed with cause ``teacher`` and the group goes on without it, never with a made-up score.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tether.config import ConfigError
from tether.learner.model import load_model_and_tokenizer
from tether.llm import LLMClient
from tether.teacher.tokenizer import check_local, check_remote
from tether.types import TeacherScores, Trajectory


class Teacher(Protocol):
    top_k: int  # log-probs per position beyond the sampled token's (0 = the sampled token's only)

    async def score(self, ids: list[int], prompt_len: int) -> TeacherScores:
        """The teacher's scores of ``ids[prompt_len:]`` given everything before each."""
        ...

    def close(self) -> None: ...


class TeacherError(RuntimeError):
    """The teacher could not score a segment (the message says why and what to check)."""


async def score_trajectory(teacher: Teacher, traj: Trajectory) -> None:
    """Score every segment of ``traj`` (concurrently) and attach the scores as ``traj.teacher``."""
    segments = traj.segments
    scores = await asyncio.gather(*(teacher.score(s.prompt_ids + s.response_ids, len(s.prompt_ids))
                                    for s in segments))
    for seg, sc in zip(segments, scores):
        if len(sc.logprobs) != len(seg.response_ids):
            raise TeacherError(f"the teacher returned {len(sc.logprobs)} scores for {len(seg.response_ids)} tokens")
    traj.teacher = list(scores)


def _top(logp: torch.Tensor, k: int) -> tuple[list[list[int]] | None, list[list[float]] | None]:
    if not k:
        return None, None
    values, index = logp.topk(min(k, logp.shape[-1]), dim=-1)  # [R, K]
    return index.tolist(), values.tolist()


# ------------------------------------------------------------------------------------------------------ local


@dataclass
class _Request:
    ids: list[int]
    prompt_len: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    t0: float = field(default_factory=time.perf_counter)


class LocalTeacher:
    """A Hugging Face causal LM scored on a worker thread (module docstring)."""

    def __init__(self, model: Any, *, top_k: int = 0, max_batch: int = 16, deterministic: bool = False):
        self.model = model.eval().requires_grad_(False)
        self.top_k = top_k
        self.max_batch = 1 if deterministic else max_batch
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.forwards = 0  # batched forward passes run (tests, benchmarks)
        self._queue: deque[_Request] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="tether-teacher", daemon=True)
        self._thread.start()

    async def score(self, ids: list[int], prompt_len: int) -> TeacherScores:
        if not 0 < prompt_len <= len(ids):
            raise ValueError(f"prompt_len {prompt_len} must be in [1, {len(ids)}]")
        if prompt_len == len(ids):
            return TeacherScores([], [] if self.top_k else None, [] if self.top_k else None)
        loop = asyncio.get_running_loop()
        req = _Request(list(ids), prompt_len, loop, loop.create_future())
        with self._cv:
            if self._closed:
                raise TeacherError("the local teacher is closed")
            self._queue.append(req)
            self._cv.notify()
        return await req.future

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    pending = list(self._queue)
                    self._queue.clear()
                    break
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            try:
                results: list[Any] = self._forward(batch)
            except Exception as e:  # noqa: BLE001 — handed to every waiting caller, who raises it
                error = TeacherError(f"the local teacher's forward pass failed: {type(e).__name__}: {e}")
                results = [error] * len(batch)
            for req, res in zip(batch, results):
                req.loop.call_soon_threadsafe(_resolve, req.future, res)
        for req in pending:
            req.loop.call_soon_threadsafe(_resolve, req.future, TeacherError("the local teacher was closed"))

    def _forward(self, batch: list[_Request]) -> list[TeacherScores]:
        length = max(len(r.ids) for r in batch)
        device = next(self.model.parameters()).device
        ids = torch.full((len(batch), length), self.pad_id, dtype=torch.long)  # [b, T] right-padded
        attention = torch.zeros((len(batch), length), dtype=torch.long)  # [b, T]
        for i, r in enumerate(batch):
            ids[i, :len(r.ids)] = torch.tensor(r.ids)
            attention[i, :len(r.ids)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False).logits
        self.forwards += 1
        out = []
        for i, r in enumerate(batch):
            logp = torch.log_softmax(logits[i, r.prompt_len - 1:len(r.ids) - 1].float(), dim=-1)  # [R, V]
            target = torch.tensor(r.ids[r.prompt_len:], device=logp.device)  # [R]
            top_ids, top_lp = _top(logp, self.top_k)
            out.append(TeacherScores(logp.gather(1, target[:, None]).squeeze(1).tolist(), top_ids, top_lp,
                                     latency_s=time.perf_counter() - r.t0))
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _resolve(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


# ----------------------------------------------------------------------------------------------------- remote


class RemoteTeacher:
    """A teacher behind an OpenAI-compatible server, through ``client`` (a ``tether.llm.LLMClient``)."""

    def __init__(self, client: Any, *, top_k: int = 0):
        self.client, self.top_k = client, top_k
        self.requests = 0

    async def score(self, ids: list[int], prompt_len: int) -> TeacherScores:
        if not 0 < prompt_len <= len(ids):
            raise ValueError(f"prompt_len {prompt_len} must be in [1, {len(ids)}]")
        if prompt_len == len(ids):
            return TeacherScores([], [] if self.top_k else None, [] if self.top_k else None)
        t0 = time.perf_counter()
        answer = await self.client.completions(list(ids), max_tokens=1, temperature=1.0, prompt_logprobs=self.top_k)
        self.requests += 1
        scores = parse_prompt_logprobs(answer, ids, prompt_len, self.top_k, self.client.url_for("completions"))
        scores.latency_s = time.perf_counter() - t0
        return scores

    def close(self) -> None:
        """The client's connections close with their event loops; the server is not ours."""


def parse_prompt_logprobs(answer: Any, ids: list[int], prompt_len: int, top_k: int, url: str) -> TeacherScores:
    """The scores of ``ids[prompt_len:]`` from a completions answer's ``choices[0].prompt_logprobs``."""
    choice = (answer.get("choices") or [{}])[0] if isinstance(answer, dict) else {}
    entries = choice.get("prompt_logprobs") if isinstance(choice, dict) else None
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = "none" if not isinstance(entries, list) else f"{len(entries)} entries"
        raise TeacherError(f"POST {url}: `choices[0].prompt_logprobs` should hold {len(ids)} entries, one per "
                           f"prompt token, got {got}; the teacher needs a server that scores prompt tokens "
                           "(vLLM, tether serve) and is sent `prompt_logprobs`")
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for t in range(prompt_len, len(ids)):
        entry = entries[t]
        try:
            table = {int(k): v for k, v in entry.items()}
            logprobs.append(float(table[ids[t]]["logprob"]))
            ranked = sorted((v.get("rank") or 0, k, float(v["logprob"])) for k, v in table.items())
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise TeacherError(f"POST {url}: `prompt_logprobs[{t}]` does not score prompt token {ids[t]}: "
                               f"{str(entry)[:200]} ({type(e).__name__}: {e})") from None
        best = [(k, lp) for rank, k, lp in ranked if 1 <= rank <= top_k]
        top_ids.append([k for k, _ in best])
        top_lps.append([lp for _, lp in best])
    if not top_k:
        return TeacherScores(logprobs)
    return TeacherScores(logprobs, top_ids, top_lps)


# ---------------------------------------------------------------------------------------------------- building


def make_teacher(cfg: Any, student_tokenizer: Any) -> LocalTeacher | RemoteTeacher | None:
    """The configured teacher (None when ``teacher.enabled`` is false), its tokenizer checked against the student's."""
    tc = cfg.teacher
    if not tc.enabled:
        return None
    if not tc.rl_loss and cfg.policy_optimization.advantage.degenerate_group_filter.enabled:
        raise ConfigError("`teacher.rl_loss` is false (pure distillation: every rollout carries the teacher's signal) "
                          "but `policy_optimization.advantage.degenerate_group_filter.enabled` is true: it would "
                          "generate equal-reward groups again and drop them; set it to false")
    top_k = tc.top_k if tc.loss == "topk_forward_kl" else 0
    if tc.path is not None:
        model, tokenizer = load_model_and_tokenizer(tc.path, cfg.model.dtype)
        check_local(student_tokenizer, tokenizer, where=tc.path)
        return LocalTeacher(model, top_k=top_k, deterministic=cfg.trainer.deterministic)
    client = LLMClient.from_config(tc.remote)

    async def check() -> None:
        try:
            await check_remote(client, student_tokenizer)
        finally:
            await client.aclose()

    asyncio.run(check())
    return RemoteTeacher(client, top_k=top_k)
