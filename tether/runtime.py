"""Builds the running pieces from a RunConfig: model + tokenizer, engine, environments, agent loops.

Kept apart from the training loop so that ``tether train``, ``tether eval`` and the demo assemble the
same objects the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.agent.loop import AgentLoopBase, LoopLimits, make_agent_loop
from tether.config import ConfigError, EngineConfig, LLMClientConfig, PartialRolloutConfig, RunConfig
from tether.config.plan import Plan
from tether.engine.base import InferenceEngine, SamplingParams
from tether.engine.grammar import Grammars, GrammarUnavailable
from tether.engine.grammar import check_available as check_grammar_available
from tether.engine.local import LocalEngine
from tether.engine.remote import RemoteEngine
from tether.env.base import Env
from tether.env.customer_service import example_texts
from tether.env.plugin.env import ToolEnv
from tether.env.plugin.registry import EnvironmentNotFound, load_import_path
from tether.env.plugin.registry import resolve as resolve_environment
from tether.learner.model import cast_copy, ensure_tiny, load_model_and_tokenizer, torch_dtype
from tether.llm import LLMClient
from tether.locks import lock_file, unlock_file
from tether.reward.loop import RewardLoop
from tether.types import Task
from tether.warmstart.tiny_sft import build_tiny_sft, cache_key

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where built presets are kept: ``$TETHER_CACHE``, else ``~/.cache/tether``."""
    return Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether"))


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cached_build(target: Path, build: Callable[[Path], Any], *, what: str, note: str = "",
                 log: Callable[[str], None] = say) -> str:
    """``target`` if it holds a model, else ``build`` it there once: under an exclusive lock on
    ``target.lock`` (a second process waits instead of building it again), into a temporary folder that is
    renamed into place when complete. Nothing is left behind but the preset: a failed, refused or interrupted
    build (SIGTERM / SIGINT on the main thread: the temporary folder is removed, then the signal's exit code,
    143 / 130) removes its temporary folder, and the lock file goes when its holder is done (a waiter that had
    opened it locks the file that is there then: ``tether.locks``)."""
    if (target / "config.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f"{target.name}.lock"
    fd = lock_file(lock_path, on_wait=lambda: log(f"waiting for another process that is building the {what} preset "
                                                  f"into {target}"))
    try:
        if (target / "config.json").is_file():
            return str(target)
        log(f"building the {what} preset (one time{note}) into {target}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            with _signals_raise():
                t0 = time.perf_counter()
                build(tmp)
                os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"built {what} preset in {time.perf_counter() - t0:.0f} s, cached at {target}")
    finally:
        unlock_file(fd, lock_path)  # the file goes with its holder: a newcomer makes (and locks) a new one
    return str(target)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGINT raise ``SystemExit`` (143 / 130) while the block runs, so its ``finally`` clauses clean
    up; on the main thread only (elsewhere signals cannot be handled), restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def model_path(cfg: RunConfig) -> str:
    """The HF folder of the policy: ``model.path``, or a preset built once and cached (``cache_dir()``).

    ``tiny``: random weights (tests, benchmarks). ``tiny-sft``: the tiny model warm-started on the
    customer-service expert's demonstrations (``tether.warmstart.tiny_sft``), the one RL learns from."""
    if cfg.model.path:
        return cfg.model.path
    if cfg.model.preset == "tiny-sft":
        return cached_build(cache_dir() / f"tiny-sft-{cache_key(cfg)}",
                            lambda tmp: build_tiny_sft(cfg, tmp, log=lambda m: say(f"[tiny-sft] {m}")),
                            what="tiny-sft", note=", a few minutes on 2 idle cores, longer on a busy machine: the tiny "
                                                  "model warm-started on the customer-service expert's demonstrations")
    return ensure_tiny(cache_dir(), corpus=example_texts(400), seed=cfg.trainer.seed)


def env_factory(cfg: RunConfig) -> tuple[Callable[[], Env], Callable[[str], list[Task]]]:
    """``environment.name``'s environment (``tether.env.plugin.registry.resolve``: a registered name, an import path,
    an entry point or ``tau2:<domain>``) as ``(make_env(), list_tasks(split))`` for this run. One environment is
    built here, so that a config its tools or verifier cannot take fails now, not at the first episode; when it can
    ``spawn()`` (a ``ToolEnv``), the episodes' environments are spawned from it and share what it built per config."""
    make, list_tasks = resolve_environment(cfg.environment.name)  # EnvironmentNotFound (ValueError) says what it tried
    first = make(cfg)
    if cfg.environment.mcp_servers and not isinstance(first, ToolEnv):
        first.close()
        raise ConfigError(f"`environment.mcp_servers`: {cfg.environment.name} is a {type(first).__name__}, which takes "
                          "no MCP servers (a ToolEnvironment's environment does: tether.env.plugin)")

    def tasks(split: str) -> list[Task]:
        return list_tasks(split, cfg)

    if callable(getattr(first, "spawn", None)):
        return first.spawn, tasks
    first.close()
    return (lambda: make(cfg)), tasks


def shutdown_environment(make_env: Callable[[], Env]) -> None:
    """Release what the episodes ``make_env`` spawns share (an environment's ``shutdown()``: the OpenEnv servers
    tether started, a ToolEnv's MCP servers), at the end of the run; nothing for environments without one."""
    shutdown = getattr(getattr(make_env, "__self__", None), "shutdown", None)
    if callable(shutdown):
        shutdown()


def sampling_params(e: EngineConfig, *, greedy: bool = False) -> SamplingParams:
    """The engine section's sampling; ``greedy``: the plain argmax of the policy (held-out evaluation), without the
    truncation (which cannot change it) nor the penalties and min_tokens (which would score a shaped policy, not the
    one trained and deployed)."""
    if greedy:
        return SamplingParams(temperature=0.0, top_p=1.0, max_tokens=e.max_tokens)
    return SamplingParams(temperature=e.temperature, top_p=e.top_p, max_tokens=e.max_tokens, top_k=e.top_k,
                          min_p=e.min_p, repetition_penalty=e.repetition_penalty, presence_penalty=e.presence_penalty,
                          frequency_penalty=e.frequency_penalty, min_tokens=e.min_tokens)


def context_window(window: int, max_tokens: int, model_config: Any, where: str = "the model") -> int:
    """The agent loop's token budget per sequence (prompt + response) for this model; checked at start.

    ``engine.max_tokens`` at or past the model's ``max_position_embeddings`` is refused (ConfigError): no turn
    could ever generate that many tokens after its prompt. ``environment.state.context_window`` past them is
    clamped to them with a warning, not refused: the default (32768) is meant as "as long as the model
    allows", and a window the model cannot hold would otherwise fail at the first prompt that outgrows it.
    A model config without ``max_position_embeddings`` leaves the window as configured. ``window``:
    ``environment.state.context_window``, ``max_tokens``: ``engine.max_tokens``."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return window
    if max_tokens >= positions:
        raise ConfigError(f"`engine.max_tokens` = {max_tokens} does not fit {where}: its "
                          f"max_position_embeddings is {positions}, shared by a turn's prompt and its new tokens; "
                          f"set engine.max_tokens below {positions}")
    if window > positions:
        log.warning("environment.state.context_window = %d is more than %s's %d positions: episodes are cut at "
                    "%d tokens", window, where, positions, positions)
        return positions
    return window


def agent_loop(cfg: RunConfig, engine: InferenceEngine, tokenizer: Any, *, greedy: bool = False,
               window: int | None = None) -> AgentLoopBase:
    """The configured agent loop; ``window``: the context window checked against the model (``context_window``)."""
    grammars = None
    if cfg.agent_loop.name == "program":
        import tether.programs  # noqa: F401, PLC0415 — registers the loop (FastAPI, uvicorn: only when asked for)
    if cfg.agent_loop.constrained_tool_calls:  # masks the engine's logits: as wide as its model's (else the tokenizer)
        try:
            check_grammar_available()
        except GrammarUnavailable as e:
            raise ConfigError(f"`agent_loop.constrained_tool_calls` = true: {e}") from None
        vocab = getattr(getattr(getattr(engine, "model", None), "config", None), "vocab_size", None)
        grammars = Grammars(tokenizer, vocab or len(tokenizer))
    extra: dict[str, Any] = {}
    if cfg.agent_loop.name == "program":
        program = agent_program(cfg.agent_loop.program) if cfg.agent_loop.program else cfg.agent_loop.program_command
        extra = {"program": program, "timeout_s": cfg.agent_loop.program_timeout_s}
    return make_agent_loop(
        cfg.agent_loop.name, engine=engine, tokenizer=tokenizer, sampling=sampling_params(cfg.engine, greedy=greedy),
        limits=LoopLimits.from_config(cfg.agent_loop, window or cfg.environment.state.context_window),
        parser=cfg.tool_parser.name, stop_token_ids=tuple(cfg.tool_parser.stop_token_ids), grammars=grammars, **extra,
    )


def agent_program(path: str) -> Callable[..., Any]:
    """The function ``agent_loop.program`` names."""

    try:
        program = load_import_path(path, key="agent_loop.program")
    except EnvironmentNotFound as e:
        raise ConfigError(str(e)) from None
    if not callable(program):
        raise ConfigError(f"agent_loop.program {path!r} is a {type(program).__name__}, not a function of an Episode")
    return program


def local_engine(model: Any, plan: Plan, engine: EngineConfig, partial: PartialRolloutConfig,
                 version: int = 0, latency_rows: int = 0) -> LocalEngine:
    """The in-process engine over its own copy of the weights in ``model.dtype`` (``cast_copy``: the learner's float32
    copy keeps training; the engine's KV cache takes its dtype), whatever ``engine.type`` says: ``tether serve`` and
    the trainer's own validation engine are local in every run. ``latency_rows``: ``LocalEngine``'s (``tether serve
    --latency-rows``; rollouts' requests have no group, so it would not act on them)."""
    return LocalEngine(cast_copy(model, plan.dtype), version=version, max_batch=engine.max_batch_size,
                       seed=plan.seed, partial_rollout=partial.enabled, segment_length=partial.segment_length,
                       deterministic=plan.deterministic, latency_rows=latency_rows)


def rollout_engine(model: Any, plan: Plan, engine_cfg: EngineConfig, partial: PartialRolloutConfig,
                   client: LLMClientConfig, version: int = 0) -> LocalEngine | RemoteEngine:
    """The engine ``engine.type`` names: ``local_engine``, or ``remote`` — the server of the ``llm_client`` section
    (``tether.engine.remote``), loaded with ``model``'s weights as ``version`` before the first rollout, so that
    it samples from the policy the learner trains whatever checkpoint it was started with. ``client``: the
    ``llm_client`` section."""
    if engine_cfg.type != "remote":
        return local_engine(model, plan, engine_cfg, partial, version)
    engine = RemoteEngine(LLMClient.from_config(client), version=version,
                          max_model_len=getattr(model.config, "max_position_embeddings", None),
                          weight_sync_dir=engine_cfg.weight_sync_dir, model_config=model.config)
    dtype = torch_dtype(plan.dtype)
    try:  # in model.dtype, as every later sync sends them (tether.pipeline.weights)
        engine.update_weights({k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()},
                              version)
    except BaseException:
        engine.close()
        raise
    return engine


@dataclass
class Runtime:
    cfg: RunConfig
    model: Any  # the policy in float32 whatever ``model.dtype`` says: the learner's master weights (``build``)
    tokenizer: Any
    engine: LocalEngine | RemoteEngine  # both count their work in ``stats`` (perf/engine_busy_s)
    make_env: Callable[[], Env]
    tasks: Callable[[str], list[Task]]
    window: int | None = None  # the context window the model can hold (``context_window``)
    rewards: RewardLoop | None = None  # scores the rubrics when an LLM judge does (``tether.reward``)
    loops: list[AgentLoopBase] = field(default_factory=list)  # the loops made by ``loop``, closed with the runtime

    @classmethod
    def build(cls, cfg: RunConfig, model_dir: str | None = None, engine: Any = None) -> Runtime:
        """``engine``: a rollout engine that runs elsewhere (``backend: ray``); None = ``rollout_engine``, whose copy of
        the weights is in ``model.dtype`` while ``model`` (the learner's) is float32: mixed precision as verl and TRL
        do it (``tether.config.sections.ModelConfig.dtype``)."""
        path = model_dir or model_path(cfg)
        model, tokenizer = load_model_and_tokenizer(path, "float32")
        window = context_window(cfg.environment.state.context_window, cfg.engine.max_tokens, model.config,
                                where=f"the model at {path}")  # before the engine starts
        make_env, tasks = env_factory(cfg)
        if engine is None:
            engine = rollout_engine(model, Plan.of(cfg), cfg.engine, cfg.rollout.partial_rollout, cfg.llm_client)
        return cls(cfg, model, tokenizer, engine, make_env, tasks, window,
                   RewardLoop.from_config(cfg))

    def loop(self, *, greedy: bool = False) -> AgentLoopBase:
        loop = agent_loop(self.cfg, self.engine, self.tokenizer, greedy=greedy, window=self.window)
        self.loops.append(loop)
        return loop

    def close(self) -> None:
        for loop in self.loops:
            loop.close()
        self.engine.close()
        shutdown_environment(self.make_env)
