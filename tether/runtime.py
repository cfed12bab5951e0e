"""Builds the running pieces from a RunConfig: model + tokenizer, engine, environments, agent loops.

Kept apart from the training loop so that ``tether train``, ``tether eval`` and the demo assemble the
same objects the same way.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from tether.agent.loop import AgentLoopBase, LoopLimits, make_agent_loop
from tether.config import RunConfig
from tether.engine.base import InferenceEngine, SamplingParams
from tether.env.base import Env
from tether.env.customer_service import CustomerServiceEnv, example_texts
from tether.types import Task

# Environments selectable by ``environment.name``: a constructor taking the RunConfig and a task lister.
ENVIRONMENTS: dict[str, tuple[Callable[[RunConfig], Env], Callable[[str, RunConfig], list[Task]]]] = {
    "customer_service_agent": (CustomerServiceEnv, lambda split, cfg: CustomerServiceEnv(cfg).tasks(split)),
}


def cache_dir() -> Path:
    return Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether"))


def model_path(cfg: RunConfig) -> str:
    """The HF folder of the policy: ``model.path``, or the tiny preset built once and cached."""
    if cfg.model.path:
        return cfg.model.path
    from tether.learner.model import ensure_tiny

    return ensure_tiny(cache_dir(), corpus=example_texts(400), seed=cfg.trainer.seed)


def env_factory(cfg: RunConfig) -> tuple[Callable[[], Env], Callable[[str], list[Task]]]:
    try:
        make, list_tasks = ENVIRONMENTS[cfg.environment.name]
    except KeyError:
        raise ValueError(f"environment.name {cfg.environment.name!r} is not a known environment; "
                         f"known: {sorted(ENVIRONMENTS)}") from None
    return (lambda: make(cfg)), (lambda split: list_tasks(split, cfg))


def sampling_params(cfg: RunConfig, *, greedy: bool = False) -> SamplingParams:
    e = cfg.engine
    params = SamplingParams(temperature=e.temperature, top_p=e.top_p, max_tokens=e.max_tokens)
    return replace(params, temperature=0.0, top_p=1.0) if greedy else params


def agent_loop(cfg: RunConfig, engine: InferenceEngine, tokenizer: Any, *, greedy: bool = False) -> AgentLoopBase:
    return make_agent_loop(
        cfg.agent_loop.name, engine=engine, tokenizer=tokenizer, sampling=sampling_params(cfg, greedy=greedy),
        limits=LoopLimits.from_config(cfg.agent_loop, cfg.environment.state.context_window),
        parser=cfg.tool_parser.name, stop_token_ids=tuple(cfg.tool_parser.stop_token_ids),
    )


def local_engine(cfg: RunConfig, model: Any, version: int = 0) -> InferenceEngine:
    """The in-process engine over its own copy of the weights (the learner's copy keeps training)."""
    from tether.engine.local import LocalEngine

    if cfg.engine.type != "local":
        raise ValueError(f"engine.type {cfg.engine.type!r} is not available yet; use engine.type: local")
    partial = cfg.rollout.partial_rollout
    return LocalEngine(copy.deepcopy(model).eval(), version=version, max_batch=cfg.engine.max_batch_size,
                       seed=cfg.trainer.seed, partial_rollout=partial.enabled, segment_length=partial.segment_length)


@dataclass
class Runtime:
    cfg: RunConfig
    model: Any
    tokenizer: Any
    engine: InferenceEngine
    make_env: Callable[[], Env]
    tasks: Callable[[str], list[Task]]

    @classmethod
    def build(cls, cfg: RunConfig, model_dir: str | None = None) -> "Runtime":
        from tether.learner.model import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(model_dir or model_path(cfg), cfg.model.dtype)
        make_env, tasks = env_factory(cfg)
        return cls(cfg, model, tokenizer, local_engine(cfg, model), make_env, tasks)

    def loop(self, *, greedy: bool = False) -> AgentLoopBase:
        return agent_loop(self.cfg, self.engine, self.tokenizer, greedy=greedy)

    def close(self) -> None:
        self.engine.close()
