"""Shared fixtures: one tiny model per test session (per xdist worker) and a short-run helper."""

from __future__ import annotations

import json
import os
from pathlib import Path

# One OpenMP thread unless asked otherwise, as `make test` runs: several tests fork a child that runs torch, and a
# child forked after the parent ran a GNU OpenMP team of 2+ threads can hang in its first parallel region (seen:
# `pytest tests/test_run_dir_safety.py` run alone). Set before torch is imported by any test module.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SEEDS = REPO / "configs" / "seeds"  # the six seed configs, as shipped in the repository

# A small run of the real training loop: 20 train tasks, 2 tasks × 4 rollouts per step, short turns.
SMALL_RUN = """
environment: {num_train_tasks: 20, num_eval_tasks: 4}
engine: {max_tokens: 12, temperature: 1.0}
agent_loop: {max_assistant_turns: 2, max_user_turns: 2}
learner: {batch_size: 8, mini_batch_size: 8, gradient_accumulation_steps: 1, update_frequency: 1}
policy_optimization:
  advantage: {group_size: 4, normalization: group, degenerate_group_filter: {enabled: false}}
  optimizer: {lr: 1e-3, warmup_steps: 0}
trainer: {total_steps: 3, eval_every: 0, save_every: 3, seed: 3, trigger_parameter_sync_step: 1}
metrics: {tensorboard: false}
"""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 1-layer, 32-wide tiny model (the real build path: tokenizer, template, HF folder)."""
    from tether.env.customer_service import example_texts
    from tether.learner.model import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", corpus=example_texts(100), num_hidden_layers=1,
                      hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def process_gone(pid: int) -> bool:
    """Has process ``pid`` exited (reaped, or a zombie)? /proc races with the reaping: a process reaped between the
    open and the read of its stat file raises ProcessLookupError, and counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def read_rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / name).read_text().splitlines() if line.strip()]


@pytest.fixture
def metrics():
    """A MetricsRecorder of its own for the test (what record_metric records goes there)."""
    from tether.metrics import MetricsRecorder, set_recorder

    rec = MetricsRecorder([])
    prev = set_recorder(rec)
    yield rec
    set_recorder(prev)


@pytest.fixture
def small_run(tiny_model, tmp_path):
    """``small_run(name, *overrides, files=())`` trains SMALL_RUN (+ files, + overrides) on the tiny model and
    returns ``(metrics rows, samples rows, run_dir)``."""
    from tether.config import load_config
    from tether.pipeline.trainer import train

    base = tmp_path / "small_run.yaml"
    base.write_text(SMALL_RUN)

    def run(name: str, *overrides: str, files: tuple = ()):
        cfg = load_config([base, *files], [f"model.path={tiny_model}", *overrides])
        train(cfg, tmp_path / name, show_progress=False)
        return read_rows(tmp_path / name), read_rows(tmp_path / name, "samples.jsonl"), tmp_path / name

    return run


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster (2 CPUs, no dashboard) per test module, unless one is running; skips without ray."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def start_killing_the_rollouter(actors: dict, run_dir: Path, ready, timeout_s: float = 500):
    """A thread that kills the rollouter actor (``actors["rollout"]``; Ray restarts it, as after a lost node) the first
    time, once step 1 is logged, its ``stats()`` satisfy ``ready``; returns (the thread, the stats it was killed at)."""
    import threading
    import time

    import ray

    killed: dict = {}

    def kill() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "rollout" in actors and (run_dir / "metrics.jsonl").is_file() and len(read_rows(run_dir)) >= 2:
                stats = ray.get(actors["rollout"].stats.remote())
                if ready(stats):
                    killed.update(stats)
                    ray.kill(actors["rollout"], no_restart=False)
                    return
            time.sleep(0.05)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer, killed


def train_on_ray_killing_the_rollouter(cfg, run_dir: Path, ready, timeout_s: float = 500) -> dict:
    """``train_on_ray(cfg, run_dir)`` under ``start_killing_the_rollouter``; returns the stats it was killed at."""
    from tether.distributed.ray_backend import train_on_ray

    actors: dict = {}
    killer, killed = start_killing_the_rollouter(actors, run_dir, ready, timeout_s)
    train_on_ray(cfg, run_dir, show_progress=False, on_start=actors.update)
    killer.join(timeout=5)
    return killed


def counted_server(engine, tokenizer, **app_kwargs):
    """``tether serve``'s app over ``engine`` started in a thread, with ``.calls``: requests per path."""
    from collections import Counter

    from tether.serve import ServerThread, make_app

    app = make_app(engine, tokenizer, model_name="tiny", **app_kwargs)
    calls: Counter = Counter()

    @app.middleware("http")
    async def count(request, call_next):
        calls[request.url.path] += 1
        return await call_next(request)

    server = ServerThread(app).start()
    server.calls = calls
    return server


def group_producer(cfg, rollouter, **kw):
    """``GroupProducer`` with ``cfg``'s values, as ``Run.build`` hands them (tether.pipeline.build)."""
    from tether.pipeline.shaping import GroupProducer

    return GroupProducer(rollouter, cfg.policy_optimization, seed=cfg.trainer.seed, sync=cfg.rollout.mode == "sync",
                         **kw)


def rollout_allocator(cfg, **kw):
    """``RolloutAllocator`` with ``cfg``'s values, as ``Run.build`` hands them."""
    from tether.pipeline.shaping import RolloutAllocator

    return RolloutAllocator(cfg.policy_optimization.rollout_allocation, cfg.policy_optimization.advantage.group_size,
                            **kw)


def batch_source(cfg, producer, batch_tasks, weights, **kw):
    """``make_source`` with ``cfg``'s plan and sections, as ``Run.build`` hands them."""
    from tether.config.plan import Plan
    from tether.pipeline.modes import make_source

    return make_source(Plan.of(cfg), producer, batch_tasks, weights, buffer=cfg.buffer,
                       replay_buffer_size=cfg.rollout.partial_rollout.replay_buffer_size,
                       normalization=cfg.policy_optimization.advantage.normalization, **kw)


def learner_args(cfg) -> dict:
    """``Learner``'s arguments after the model and the reference, from ``cfg``, as ``Run.build`` hands them."""
    from tether.config.plan import Plan

    return dict(lc=cfg.learner, po=cfg.policy_optimization, temperature=cfg.engine.temperature,
                max_response_tokens=Plan.of(cfg).max_response_tokens, teacher=cfg.teacher,
                worker=cfg.actor_worker.class_)


def make_learner(model, cfg, ref_model=None):
    """A ``Learner`` with ``cfg``'s sections and plan values (tether.learner.fsdp.run_learner, strategy none)."""
    from tether.learner.learner import Learner

    return Learner(model, ref_model, **learner_args(cfg))


@pytest.fixture
def cli_run_args(tmp_path, tiny_model):
    """``cli_run_args(steps)``: the config arguments of a ``tether train`` of SMALL_RUN on the tiny model that saves
    every step (``[FILE, "--set", "model.path=…"]``), for the CLI's crash, resume and failure tests."""

    def make(steps: int) -> list[str]:
        path = tmp_path / "cfg.yaml"
        path.write_text(SMALL_RUN + f"""
trainer: {{total_steps: {steps}, eval_every: 0, save_every: 1, seed: 3, trigger_parameter_sync_step: 1, eval_tasks: 2}}
engine: {{max_tokens: 8, temperature: 1.0}}
""")
        return [str(path), "--set", f"model.path={tiny_model}"]

    return make


def random_trajectories(vocab: int, n: int = 8, seed: int = 0, *, prompt_len: int = 4, head: int = 5, gap: int = 2,
                        min_logp: float = 2.0):
    """``n`` trajectories of random tokens in groups of 4 (task ``t{i // 4}``): a response of 2..``head`` model
    tokens, 0..``gap`` tool tokens, 1..4 model tokens; behaviour logprobs uniform in [-9, -``min_logp``], version 0."""
    import random

    from tether.types import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        mask = [1] * rng.randint(2, head) + [0] * rng.randint(0, gap) + [1] * rng.randint(1, 4)
        out.append(Trajectory(
            task_id=f"t{i // 4}", prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
            response_ids=[rng.randrange(vocab) for _ in mask], response_mask=mask,
            logprobs=[-rng.uniform(min_logp, 9.0) if m else 0.0 for m in mask],
            versions=[0 if m else -1 for m in mask]))
    return out
