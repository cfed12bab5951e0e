"""One run per directory (``tether.pipeline.run_lock``): a second run on a directory in use is refused with one line
naming the holder's PID and host (exit 2), and a lock left by a killed run is taken over. The concurrent runs are
real processes (``python -m tether train``); the holder of the lock is paused (SIGSTOP) while the second run tries,
so the overlap does not depend on timing."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import REPO, SMALL_RUN, read_rows
from tether.cli import app
from tether.pipeline.run_lock import LOCK_FILE, RunDirError, RunLock

RUN = SMALL_RUN + """
trainer: {total_steps: 2, eval_every: 0, save_every: 1, seed: 3, trigger_parameter_sync_step: 1, eval_tasks: 2}
engine: {max_tokens: 8, temperature: 1.0}
"""
HOLD = "import sys, time; from tether.pipeline.run_lock import RunLock; RunLock(sys.argv[1]).acquire(); " \
       "print('held', flush=True); time.sleep(600)"


@pytest.fixture
def cfg(tmp_path, tiny_model):
    path = tmp_path / "cfg.yaml"
    path.write_text(RUN)
    return [str(path), "--set", f"model.path={tiny_model}"]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def holder(run_dir: Path) -> subprocess.Popen:
    """Another process that takes the lock of ``run_dir`` and keeps it (until killed)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env())
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def lock_pid(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def test_a_live_holder_is_refused_with_its_pid_and_host_and_a_killed_ones_lock_is_taken_over(tmp_path, cfg):
    run_dir = tmp_path / "new" / "run"
    p = holder(run_dir)  # a fresh run on a new directory, just started
    try:
        with pytest.raises(RunDirError, match=rf"in use by another run \(PID {p.pid} on host "
                                              rf"{socket.gethostname()}, since "):
            RunLock(run_dir).acquire()
        result = CliRunner().invoke(app, ["train", *cfg, "--run-dir", str(run_dir)])  # a second fresh run
        said = " ".join(result.output.split())
        assert result.exit_code == 2 and said.startswith("error:") and f"PID {p.pid} on host" in said, result.output
        assert "Traceback" not in result.output
        assert sorted(q.name for q in run_dir.iterdir()) == [LOCK_FILE]  # the refused run wrote nothing
    finally:
        p.kill()  # kill -9: the kernel releases the lock; the file, naming a dead PID, stays
        p.wait()
    assert lock_pid(run_dir) == p.pid
    lock = RunLock(run_dir).acquire()  # taken over
    assert lock_pid(run_dir) == os.getpid()
    lock.release()
    assert not (run_dir / LOCK_FILE).exists()


def test_a_lock_file_naming_a_dead_pid_on_this_host_does_not_block(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": "then"}))
    lock = RunLock(run_dir).acquire()
    assert lock_pid(run_dir) == os.getpid()
    lock.release()


def test_a_refused_acquire_leaves_no_directory_and_release_is_idempotent(tmp_path):
    lock = RunLock(tmp_path / "a" / "b").acquire()
    lock.release(remove_created=True)
    lock.release()
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        RunLock(tmp_path / "file").acquire()


def _train_in_child(args: list[str], fault: str) -> None:
    os.environ["TETHER_FAULT"] = fault
    app(["train", *args])


@pytest.mark.slow
def test_a_run_killed_by_kill_9_leaves_a_lock_that_the_resume_takes_over(tmp_path, cfg):
    run_dir = tmp_path / "run"
    args = [*cfg, "--run-dir", str(run_dir)]
    child = multiprocessing.get_context("fork").Process(target=_train_in_child, args=(args, "metrics@2"))
    child.start()
    child.join(300)
    assert child.exitcode == -signal.SIGKILL
    assert lock_pid(run_dir) == child.pid  # left behind by the killed run
    result = CliRunner().invoke(app, ["train", *args, "--resume"])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_rows(run_dir)] == [0, 1, 2]
    assert not (run_dir / LOCK_FILE).exists()  # released by the run that finished


@pytest.mark.slow
def test_two_resumes_of_one_run_the_second_exits_2_naming_the_first_which_finishes(tmp_path, cfg):
    run_dir = tmp_path / "run"
    assert CliRunner().invoke(app, ["train", *cfg, "--run-dir", str(run_dir)]).exit_code == 0  # steps 0–2
    command = [sys.executable, "-m", "tether", "train", *cfg, "--run-dir", str(run_dir), "--resume",
               "--set", "trainer.total_steps=5"]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    try:
        deadline = time.time() + 120
        while lock_pid(run_dir) != first.pid and first.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert lock_pid(run_dir) == first.pid, "the first resume did not take the lock"
        first.send_signal(signal.SIGSTOP)  # holds the lock while the second tries, however fast each one is
        try:
            second = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env())
        finally:
            first.send_signal(signal.SIGCONT)
        said = " ".join((second.stdout + second.stderr).split())
        assert second.returncode == 2, said
        assert said.startswith("error:") and f"PID {first.pid} on host {socket.gethostname()}" in said, said
        assert "Traceback" not in said
        out, _ = first.communicate(timeout=300)
        assert first.returncode == 0, out
    finally:
        first.kill()
    assert [r["step"] for r in read_rows(run_dir)] == list(range(6))  # each step once
    assert [r["step"] for r in read_rows(run_dir, "samples.jsonl")] == list(range(1, 6))
    assert not (run_dir / LOCK_FILE).exists()
    assert "in use by another run" not in (run_dir / "train.log").read_text()  # the refused run wrote nothing there
