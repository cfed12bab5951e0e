"""backend: ray with the LLM judge (``verifier.judge: llm``) and a teacher: both run in the rollouter actor
(``tether.distributed.actors.RolloutWorker``) beside the episodes, and a run records what the local backend records.

The in-process tests call a RolloutWorker's methods directly, each result pickled and unpickled as Ray would return
it; the cluster tests (one local 2-CPU Ray cluster for the module) train 2 sync steps of SMALL_RUN on the shared
tiny model in both backends, the judge a stub OpenAI-compatible server (``tether.reward.stub``) in this process."""

from __future__ import annotations

import asyncio
import pickle
import types
from pathlib import Path
from typing import Any

import pytest

from conftest import SMALL_RUN, read_rows
from tether.config import load_config
from tether.metrics import MetricsRecorder, set_recorder
from tether.reward.stub import StubChatServer

SECRET = "sk-judge-5b0e81d2c94f4a37"  # the judge's key: it must reach the actor and be written nowhere

ray = pytest.importorskip("ray")


class KeyedStub(StubChatServer):
    """The stub judge, also recording each request's Authorization header (the key the client sent)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.auth: list[str | None] = []

    def _chat(self, h: Any) -> None:
        self.auth.append(h.headers.get("authorization"))
        super()._chat(h)


def _judge_keys(stub: StubChatServer, *more: str) -> tuple[str, ...]:
    return ("environment.verifier.judge=llm", f"reward.judge_client.base_url={stub.base_url}",
            "reward.judge_client.model=judge", "reward.judge_client.max_retries=0",
            "reward.judge_client.api_key=${JUDGE_KEY}", *more)


def _cfg(tmp_path: Path, model: str, *overrides: str):
    base = tmp_path / "small_run.yaml"
    base.write_text(SMALL_RUN)
    return load_config([base], [f"model.path={model}", "trainer.total_steps=2", "trainer.save_every=2", *overrides])


# ---------------------------------------------------------------------------------- in process, no cluster

class Direct:
    """A RolloutWorker as the trainer's ``RolloutHandle.actor``: ``actor.method.remote(...)`` runs the method here,
    and its result crosses a pickle round trip as it would cross the object store."""

    def __init__(self, worker: Any):
        self.worker = worker

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.worker, name)

        async def remote(*args: Any) -> Any:
            return pickle.loads(pickle.dumps(await method(*pickle.loads(pickle.dumps(args)))))
        return types.SimpleNamespace(remote=remote)


def _worker_and_producer(cfg: Any, model: str) -> tuple[Any, Any, MetricsRecorder]:
    """A RolloutWorker built from ``cfg`` (pickled, as the driver hands it over) and the trainer's GroupProducer over
    a RemoteRollouter with the settling reward loop Run.build gives it; the recorder both record into."""
    from conftest import group_producer
    from tether.distributed.actors import RolloutWorker
    from tether.distributed.remote import RayParts
    from tether.reward.loop import RewardLoop

    worker = RolloutWorker(pickle.loads(pickle.dumps(cfg)), model, {})
    recorder = MetricsRecorder([])
    set_recorder(recorder)  # the worker made its EventLog the recorder: here both sides record into one (the test's)
    parts = RayParts(cfg.ray, Direct(worker))
    rollouter = parts.rollouter(rewards=RewardLoop.from_config(cfg), teacher=cfg.teacher.enabled)
    return worker, group_producer(cfg, rollouter), recorder


@pytest.fixture
def own_recorder():
    """The recorder that was active before the test, made active again after it (a RolloutWorker replaces it)."""
    prev = set_recorder(None)
    yield
    set_recorder(prev)


def test_the_rollout_worker_judges_episodes_and_the_trainer_settles_a_failure(tiny_model, tmp_path, monkeypatch,
                                                                             own_recorder):
    """The actor's reward loop calls the judge with the key handed to it; a garbage answer is counted there and the
    trainer's GroupProducer drops the group (``reward.on_judge_failure: drop_group``), as a local rollouter's."""
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    with KeyedStub(lambda b: "It is quite good.") as stub:
        cfg = _cfg(tmp_path, tiny_model, *_judge_keys(stub))
        worker, producer, recorder = _worker_and_producer(cfg, tiny_model)
        try:
            task = worker.rt.tasks("train")[0]
            assert worker.rollouters[False].rewards is worker.rollouters[True].rewards is not None
            produced = asyncio.run(producer.produce(task, 4, step=1, index=0))
        finally:
            worker.close()
    judged = [t for t in produced.group.trajectories if t.pending_judge is not None]
    assert judged and all(t.pending_judge.failed for t in judged)  # recorded on the trajectories, in the actor
    assert produced.dropped  # ... and settled by the trainer
    row = recorder.flush(1)
    n = sum(len(t.pending_judge.failed) for t in judged)
    assert row["reward/judge_failures/unparseable"] == row["reward/judge_failures"] == n == len(stub.arrivals)
    assert row["reward/judge_dropped_groups"] == 1
    assert stub.auth == [f"Bearer {SECRET}"] * len(stub.arrivals)


def test_the_rollout_worker_scores_episodes_with_the_teacher(tiny_model, tmp_path, own_recorder):
    """The actor loads the teacher (the tiny model itself) and scores every segment of each finished episode; the
    trainer's stand-in says a teacher scores, so no speculative resample attempt costs the teacher's forwards."""
    cfg = _cfg(tmp_path, tiny_model, "teacher.enabled=true", f"teacher.path={tiny_model}")
    worker, producer, _ = _worker_and_producer(cfg, tiny_model)
    try:
        assert worker.teacher is not None and worker.rollouters[True].score is None  # evaluation is not scored
        produced = asyncio.run(producer.produce(worker.rt.tasks("train")[0], 4, step=1, index=0))
        forwards = worker.teacher.forwards
    finally:
        worker.close()
    assert producer.rollouter.score is not None and not producer.concurrent_resamples
    trajs = produced.group.trajectories
    assert len(trajs) == 4 and forwards >= 1
    for t in trajs:
        assert t.teacher is not None and len(t.teacher) == len(t.segments)
        assert [len(s.logprobs) for s in t.teacher] == [len(seg.response_ids) for seg in t.segments]


# ------------------------------------------------------------------------ one cluster per module (conftest.cluster)

def _train_both(tmp_path: Path, model: str, *overrides: str) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """The same config trained locally and on Ray: (local rows, ray rows, local samples, ray samples)."""
    from tether.distributed.ray_backend import train_on_ray
    from tether.pipeline.trainer import train

    train(_cfg(tmp_path, model, *overrides), tmp_path / "local", show_progress=False)
    train_on_ray(_cfg(tmp_path, model, *overrides, "backend=ray"), tmp_path / "ray", show_progress=False)
    return (read_rows(tmp_path / "local"), read_rows(tmp_path / "ray"), read_rows(tmp_path / "local", "samples.jsonl"),
            read_rows(tmp_path / "ray", "samples.jsonl"))


def _names(row: dict, prefix: str) -> set[str]:
    return {k for k in row if k.startswith(prefix)}


def _total(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0) for r in rows)


@pytest.mark.slow
def test_judge_on_ray_records_the_local_runs_reward_metrics(cluster, tiny_model, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    answers = {"Grade": "SCORE: 0.5"}
    with KeyedStub(lambda b: answers.get(b["messages"][1]["content"][:5], "SCORE: 0.75")) as stub:
        keys = _judge_keys(stub)
        from tether.distributed.ray_backend import train_on_ray
        from tether.pipeline.trainer import train

        train(_cfg(tmp_path, tiny_model, *keys), tmp_path / "local", show_progress=False)
        local_requests = len(stub.arrivals)
        train_on_ray(_cfg(tmp_path, tiny_model, *keys, "backend=ray"), tmp_path / "ray", show_progress=False)
        ray_requests = len(stub.arrivals) - local_requests
        auth = list(stub.auth)
    a, b = read_rows(tmp_path / "local"), read_rows(tmp_path / "ray")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    hit = "reward/judge_cache_hits"  # recorded on a hit only: which duplicate prompt hits depends on timing
    for ra, rb in zip(a, b):
        assert _names(ra, "reward/") - {hit} == _names(rb, "reward/") - {hit}, ra["step"]
    for step in (1, 2):
        assert {"reward/judge_requests", "reward/judge_latency_s", "reward/judge_failures",
                "reward/response_quality"} <= _names(b[step], "reward/")
        for key in ("reward/mean", "reward/response_quality", "optim/loss"):  # sync mode: the same episodes
            assert a[step][key] == pytest.approx(b[step][key], abs=1e-6), (step, key)
        assert b[step]["reward/judge_failures"] == 0
    # every judge job is a request or a cache hit, in both; the actor's counts reached the trainer's rows
    assert (_total(a, "reward/judge_requests") + _total(a, hit)
            == _total(b, "reward/judge_requests") + _total(b, hit) > 0)
    assert _total(a, "reward/judge_requests") == local_requests and _total(b, "reward/judge_requests") == ray_requests
    assert ray_requests > 0 and auth == [f"Bearer {SECRET}"] * (local_requests + ray_requests)
    out, err = capfd.readouterr()  # the key: used by the actor, written nowhere
    assert SECRET not in out + err
    for path in (tmp_path / "ray").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    from ray._private.worker import _global_node  # Ray's own logs: its runtime-env agent logs runtime_env values

    for path in (Path(_global_node.get_session_dir_path()) / "logs").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_a_judge_failure_on_ray_is_counted_and_settled_as_locally(cluster, tiny_model, tmp_path, monkeypatch):
    """The judge answers garbage: every rubric fails as unparseable, each training group is dropped
    (``drop_group``) and each held-out episode falls back to the rule checks — the same counts in both backends."""
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    with StubChatServer(lambda b: "It is quite good.") as stub:
        a, b, sa, sb = _train_both(tmp_path, tiny_model, *_judge_keys(stub))
    for ra, rb in zip(a, b):
        assert _names(ra, "reward/") == _names(rb, "reward/"), ra["step"]
        for key in ("reward/judge_failures", "reward/judge_failures/unparseable", "reward/judge_dropped_groups",
                    "reward/rule_only_groups"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    assert b[1]["reward/judge_failures/unparseable"] > 0 and b[1]["reward/judge_dropped_groups"] == 2
    assert b[0]["reward/rule_only_groups"] == 4  # step 0's held-out evaluation, settled in the actor
    assert [r["dropped"] for r in sa] == [r["dropped"] for r in sb] == [[[1, 0], [1, 1]], [[2, 0], [2, 1]]]


@pytest.mark.slow
def test_teacher_on_ray_records_the_local_runs_teacher_metrics(cluster, tiny_model, tmp_path):
    """The teacher is the tiny model itself (a local checkpoint, loaded in the rollouter actor): KL ≈ 0."""
    a, b, _, _ = _train_both(tmp_path, tiny_model, "teacher.enabled=true", f"teacher.path={tiny_model}")
    for step in (1, 2):
        assert _names(a[step], "teacher/") == _names(b[step], "teacher/") == {"teacher/kl", "teacher/loss",
                                                                             "teacher/latency_s"}
        assert b[step]["teacher/latency_s"] > 0
        for key in ("teacher/kl", "teacher/loss"):
            assert a[step][key] == pytest.approx(b[step][key], abs=1e-5), (step, key)
        assert a[step]["reward/mean"] == pytest.approx(b[step]["reward/mean"], abs=1e-6)
    assert abs(b[1]["teacher/kl"]) < 1e-4  # the student is its own teacher at step 1


@pytest.mark.slow
def test_a_remote_teacher_is_checked_and_scores_in_the_rollouter_actor(cluster, tiny_model, tmp_path):
    """``teacher.remote``: the actor probes the server's tokenizer while it is built (an async actor's constructor
    runs inside its event loop, where the probe's ``asyncio.run`` cannot: ``actors.off_loop``) and scores there."""
    from tether.distributed.ray_backend import train_on_ray
    from tether.engine.local import LocalEngine
    from tether.learner.model import load_model_and_tokenizer
    from tether.serve import ServerThread, make_app

    model, tok = load_model_and_tokenizer(tiny_model)
    with LocalEngine(model) as engine, ServerThread(make_app(engine, tok, model_name="teacher")) as srv:
        cfg = _cfg(tmp_path, tiny_model, "backend=ray", "trainer.total_steps=1", "trainer.save_every=1",
                   "teacher.enabled=true", f"teacher.remote.base_url={srv.base_url}/v1", "teacher.remote.model=teacher")
        train_on_ray(cfg, tmp_path / "ray", show_progress=False)
    row = read_rows(tmp_path / "ray")[1]
    assert {"teacher/kl", "teacher/loss", "teacher/latency_s"} <= _names(row, "teacher/")
    assert abs(row["teacher/kl"]) < 1e-4  # the served model is the student at step 1
