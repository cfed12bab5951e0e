import json
import math
import threading

import pytest

from tether.metrics import JsonlSink, MetricsRecorder, record_metric, set_recorder, timer


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
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [7, 8]
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
