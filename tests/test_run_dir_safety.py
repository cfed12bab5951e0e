"""The run directory under misuse and interruption: reuse without --resume, --resume with a changed config, a torn
metrics line, SIGTERM in the middle of a step, a full disk. Through the real CLI (``tether train``), in forked
children where a signal or a kill is involved."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import SMALL_RUN, read_rows
from tether.cli import app
from tether.learner.checkpoint import latest_checkpoint

RUN = SMALL_RUN + """
trainer: {total_steps: 3, eval_every: 0, save_every: 1, seed: 3, trigger_parameter_sync_step: 1, eval_tasks: 2}
engine: {max_tokens: 8, temperature: 1.0}
"""


@pytest.fixture
def cfg(tmp_path, tiny_model):
    path = tmp_path / "cfg.yaml"
    path.write_text(RUN)
    return [str(path), "--set", f"model.path={tiny_model}"]


def cli(*args: str):
    return CliRunner().invoke(app, ["train", *args])


def test_reusing_a_run_dir_without_resume_is_refused_and_writes_nothing(cfg, tmp_path):
    run_dir = tmp_path / "run"
    assert cli(*cfg, "--run-dir", str(run_dir)).exit_code == 0
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    result = cli(*cfg, "--run-dir", str(run_dir))
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "already holds a run" in said and "--resume" in said
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before


def test_resume_with_a_changed_config_is_refused_unless_allowed(cfg, tmp_path):
    run_dir = tmp_path / "run"
    assert cli(*cfg, "--run-dir", str(run_dir), "--set", "trainer.total_steps=2").exit_code == 0
    recorded = (run_dir / "config.yaml").read_text()
    changed = cli(*cfg, "--run-dir", str(run_dir), "--resume", "--set", "policy_optimization.optimizer.lr=0.01")
    assert changed.exit_code == 2
    assert "policy_optimization.optimizer.lr: 0.001 → 0.01" in " ".join(changed.output.split())
    assert (run_dir / "config.yaml").read_text() == recorded  # a refused resume overwrote nothing
    # a longer run is a change a resume may make; the lr with --allow-config-change
    longer = cli(*cfg, "--run-dir", str(run_dir), "--resume", "--set", "policy_optimization.optimizer.lr=0.01",
                 "--allow-config-change", "policy_optimization.optimizer.lr")
    assert longer.exit_code == 0, longer.output
    assert [r["step"] for r in read_rows(run_dir)] == [0, 1, 2, 3]
    assert "lr: 0.01" in (run_dir / "config.yaml").read_text()


def test_a_torn_last_metrics_line_is_dropped_named_and_the_run_resumes(cfg, tmp_path):
    run_dir = tmp_path / "run"
    assert cli(*cfg, "--run-dir", str(run_dir), "--set", "trainer.total_steps=2").exit_code == 0
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/mean": 0.1')  # a write cut short by a full disk
    result = cli(*cfg, "--run-dir", str(run_dir), "--resume")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # the console wraps long lines
    assert "torn last line" in said and "metrics.jsonl" in said
    assert [r["step"] for r in read_rows(run_dir)] == [0, 1, 2, 3]


def _train_in_child(args: list[str]) -> None:
    app(["train", *args])  # exits through SystemExit with the CLI's code


def test_sigterm_during_a_step_saves_says_how_to_resume_and_resume_continues_exactly(cfg, tmp_path, capfd):
    run_dir = tmp_path / "run"
    args = [*cfg, "--run-dir", str(run_dir), "--set", "trainer.total_steps=6", "--set", "trainer.save_every=0"]
    child = multiprocessing.get_context("fork").Process(target=_train_in_child, args=(args,))
    child.start()
    deadline = time.time() + 120
    while time.time() < deadline and len(read_rows(run_dir) if (run_dir / "metrics.jsonl").exists() else []) < 2:
        time.sleep(0.05)  # step 1's row is written: the run is inside step 2
    os.kill(child.pid, signal.SIGTERM)
    child.join(120)
    assert child.exitcode == 143
    err = capfd.readouterr().err
    assert "SIGTERM" in err and "resume with: tether train" in err and "--resume" in err
    ckpt = latest_checkpoint(run_dir)
    stopped_at = int(ckpt.name.split("_")[1])
    assert 1 <= stopped_at < 6  # save_every=0: the checkpoint exists only because of the signal
    assert [r["step"] for r in read_rows(run_dir)] == list(range(stopped_at + 1))
    result = cli(*args, "--resume")
    assert result.exit_code == 0, result.output
    samples = read_rows(run_dir, "samples.jsonl")
    assert [s["step"] for s in samples] == list(range(1, 7))
    clean = tmp_path / "clean"
    assert cli(*cfg, "--run-dir", str(clean), "--set", "trainer.total_steps=6", "--set",
               "trainer.save_every=0").exit_code == 0
    assert [s["groups"] for s in samples] == [s["groups"] for s in read_rows(clean, "samples.jsonl")]


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_full_disk_stops_the_run_with_one_line_and_resume_completes_after_freeing_space(cfg, tmp_path):
    probe = tmp_path / "probe"
    assert cli(*cfg, "--run-dir", str(probe), "--set", "trainer.total_steps=1").exit_code == 0
    ckpt_bytes = sum(p.stat().st_size for p in (probe / "checkpoints" / "step_1").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, f"{max(4 * ckpt_bytes, 1 << 20)}"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        # leave room for about one and a half checkpoints: the second save runs out of space
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * max(free - int(1.5 * ckpt_bytes) - 64 * 1024, 0))
        run_dir = disk / "run"
        result = cli(*cfg, "--run-dir", str(run_dir))
        assert result.exit_code == 1, result.output
        said = " ".join(result.output.split())
        assert "no space left" in said and "Traceback" not in said
        last = latest_checkpoint(run_dir)
        assert last is not None and last.name == "step_1"
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(last)  # the last good checkpoint loads
        (disk / "filler").unlink()
        resumed = cli(*cfg, "--run-dir", str(run_dir), "--resume")
        assert resumed.exit_code == 0, resumed.output
        assert [r["step"] for r in read_rows(run_dir)] == [0, 1, 2, 3]
        assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the half-written save is gone
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
