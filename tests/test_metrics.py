import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest

from tether.config import ConfigError, RunConfig
from tether.metrics import JsonlSink, MetricsRecorder, TensorBoardSink, make_sinks, record_metric, set_recorder, timer


def test_reductions_and_jsonl(tmp_path):
    rec = MetricsRecorder([JsonlSink(tmp_path / "metrics.jsonl")])
    prev = set_recorder(rec)
    try:
        for v in (1.0, 2.0, 6.0):
            record_metric("reward/mean", v)              # mean = 3.0
            record_metric("agent/tool_calls", v, "sum")  # sum = 9.0
            record_metric("rollout/policy_version_lag_max", v, "max")
        record_metric("optim/loss", float("nan"), "last")
        row = rec.flush(step=7)
        record_metric("reward/mean", 5.0)
        rec.flush(step=8)
    finally:
        set_recorder(prev)
        rec.close()
    assert row["reward/mean"] == 3.0 and row["agent/tool_calls"] == 9.0
    assert row["rollout/policy_version_lag_max"] == 6.0 and math.isnan(row["optim/loss"])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [7, 8]
    assert lines[1] == {"step": 8, "reward/mean": 5.0}


def test_no_recorder_is_a_noop_and_reduce_conflict_is_an_error():
    set_recorder(None)
    record_metric("x", 1.0)  # nothing to record into; must not raise
    rec = MetricsRecorder()
    rec.record("x", 1.0, "sum")
    with pytest.raises(ValueError, match="reduce='mean' after reduce='sum'"):
        rec.record("x", 1.0, "mean")


def test_threads_and_timer():
    rec = MetricsRecorder()
    prev = set_recorder(rec)
    try:
        ts = [threading.Thread(target=lambda: [record_metric("n", 1.0, "sum") for _ in range(1000)]) for _ in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        with timer("perf/step_time"):
            pass
        row = rec.flush(0)
    finally:
        set_recorder(prev)
    assert row["n"] == 4000.0
    assert 0.0 <= row["perf/step_time"] < 1.0


# ----------------------------------------------------------------------------------------------------- sinks


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a W&B ``.wandb`` file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log framing — 32 KiB blocks of [crc32 (4), length (2, LE), type (1: full, 2: first, 3: middle,
    4: last)] fragments, a block's tail of fewer than 7 bytes left as padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # padding at the end of a block
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero fill: nothing more was written
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_make_sinks_follows_the_metrics_section(tmp_path):
    sinks = make_sinks(tmp_path / "a", tensorboard=False)
    assert [type(s) for s in sinks] == [JsonlSink]
    sinks[0].write(3, {"reward/mean": 1.0})
    [s.close() for s in sinks]
    assert json.loads((tmp_path / "a" / "metrics.jsonl").read_text()) == {"step": 3, "reward/mean": 1.0}
    sinks = make_sinks(tmp_path / "b", tensorboard=True)
    assert [type(s) for s in sinks] == [JsonlSink, TensorBoardSink]
    [s.close() for s in sinks]
    assert list((tmp_path / "b" / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_on_without_the_package_fails_naming_key_and_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb → ImportError
    with pytest.raises(ConfigError, match=r"`metrics\.wandb`.*tether\[wandb\]"):
        make_sinks(tmp_path, wandb=True)


def test_wandb_offline_run_holds_the_metrics_and_no_secret(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "home" / sub))  # nothing written outside tmp_path
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "wandbkey-do-not-log-1234567890abcdef12345678")
    monkeypatch.setattr(sys, "argv", ["tether", "train", "--set", "llm_client.api_key=sk-do-not-log-42"])
    cfg = RunConfig()
    cfg.metrics.tensorboard, cfg.metrics.wandb = False, True
    run = tmp_path / "run"
    rec = MetricsRecorder(make_sinks(run, tensorboard=False, wandb=True, config=cfg.redacted_dict()))
    prev = set_recorder(rec)
    try:
        record_metric("reward/mean", 0.25)
        record_metric("optim/loss", float("nan"))
        rec.flush(step=0)
        record_metric("reward/mean", 0.75)
        rec.flush(step=1)
    finally:
        set_recorder(prev)
        rec.close()
    import wandb

    wandb.teardown()  # finish() can return before wandb-core's writer has flushed the run file; this waits for it
    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    records = read_wandb_records(wandb_file)
    history = [(r.history.step.num, {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                     for i in r.history.item})
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(step, row["reward/mean"]) for step, row in history] == [(0, 0.25), (1, 0.75)]
    assert math.isnan(history[0][1]["optim/loss"])
    config = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
              for r in records if r.WhichOneof("record_type") == "run" for i in r.run.config.update}
    assert config["metrics"]["wandb"] is True  # the resolved (redacted) config travels with the run
    for f in run.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert b"wandbkey-do-not-log" not in data and b"sk-do-not-log" not in data, f


def test_a_resume_in_the_same_second_shows_each_step_once(tmp_path):
    """TensorBoard reads event files in name order (<seconds>.<host>.<pid>): a killed run's file from this very
    second whose pid sorts last must still be read before the resumed run's, or its steps come after."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tensorboard"
    killed = TensorBoardSink(log_dir)
    for step in (1, 2, 3):  # step 3 was written after the last checkpoint (step 2)
        killed.write(step, {"reward/mean": float(step)})
    killed.close()
    [old] = log_dir.glob("events.out.tfevents.*")
    parts = old.name.split(".")
    parts[3], parts[5] = str(int(time.time())), "99999999"  # this second, a pid that sorts after any real one
    old.rename(log_dir / ".".join(parts))

    resumed = TensorBoardSink(log_dir, purge_step=3)
    for step in (3, 4):
        resumed.write(step, {"reward/mean": 10.0 * step})
    resumed.close()
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_an_event_file_from_a_clock_ahead_is_not_waited_for(tmp_path):
    log_dir = tmp_path / "tensorboard"
    log_dir.mkdir()
    (log_dir / f"events.out.tfevents.{int(time.time()) + 3600}.host.1.0").write_bytes(b"")  # an hour ahead
    t0 = time.perf_counter()
    TensorBoardSink(log_dir).close()
    assert time.perf_counter() - t0 < 5.0
