"""The run directory under misuse and interruption: reuse without --resume, --resume with a changed config, a torn
metrics line, rows cut out of metrics.jsonl, a corrupt latest checkpoint, SIGTERM in the middle of a step, a full
disk. Through the real CLI (``tether train``), in forked children where a signal or a kill is involved. (Two runs
on one directory: ``test_run_lock.py``.)"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import read_rows
from tether.cli import app
from tether.learner.checkpoint import latest_checkpoint
from tether.pipeline.resume import resume_jsonl as _resume_jsonl
from tether.pipeline.run_lock import RunDirError


@pytest.fixture
def cfg(cli_run_args):
    return cli_run_args(3)


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


def _log(tmp_path: Path, steps: list[int], tail: str = "") -> Path:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in steps) + tail)
    return path


DAMAGE = [  # (the steps' rows, then a tail, checkpoint step, the refusal says)
    ([0, 1, 2, 5, 6], "", 6, "lacks the rows of steps 3–4, before checkpoint step_6"),
    ([0, 2, 4, 5], "", 5, "lacks the rows of steps 1, 3, before checkpoint step_5"),
    ([0, 1, 2, 3, 2, 3, 4, 5], "", 5, "holds the rows of steps 2–3 more than once, before checkpoint step_5"),
    ([0, 1, 2, 3, 4, 5], '{"step": 6, "x\n{"step": 7}\n', 7, "1 unreadable line(s) before its end (line 7"),
    ([0, 1, 2, 3, 4], '{"step": 5, "x', 5, "lacks the rows of step 5, before checkpoint step_5 (and ends in a torn"),
]


def test_resume_jsonl_drops_what_follows_the_checkpoint_and_refuses_what_is_missing_before_it(tmp_path):
    # an interruption: rows after the checkpoint (step 4) and a torn last line → dropped, the torn line named
    notes, text = _resume_jsonl(_log(tmp_path, [0, 1, 2, 3, 4, 5], '{"step": 6, "x'), 0, 4, ())
    assert [json.loads(line)["step"] for line in text.splitlines()] == [0, 1, 2, 3, 4]
    assert len(notes) == 1 and "torn last line" in notes[0]
    assert _resume_jsonl(_log(tmp_path, [0, 1, 2, 3, 4]), 0, 4, ()) == ([], None)  # nothing to do
    # damage: rows cut out before the checkpoint, repeated, a bad line before the end, the checkpoint's own row torn
    for steps, tail, last, said in DAMAGE:
        path = _log(tmp_path, steps, tail)
        with pytest.raises(RunDirError, match="--allow-config-change metrics.jsonl") as e:
            _resume_jsonl(path, 0, last, ())
        assert said in str(e.value) and "damage done to the file after it was written" in str(e.value)
        notes, _ = _resume_jsonl(path, 0, last, ("metrics.jsonl",))  # consent: kept as it is, said
        assert len(notes) == 1 and said.split(",")[0] in notes[0] and "allow" in notes[0]
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(RunDirError, match="lacks the rows of steps 0–3, before checkpoint step_3"):
        _resume_jsonl(tmp_path / "metrics.jsonl", 0, 3, ())
    with pytest.raises(RunDirError, match="samples.jsonl lacks the rows of steps 1–3"):  # samples: from step 1
        _resume_jsonl(tmp_path / "samples.jsonl", 1, 3, ())


def test_metrics_rows_cut_out_before_the_checkpoint_are_refused_unless_allowed(cfg, tmp_path):
    run_dir = tmp_path / "run"
    assert cli(*cfg, "--run-dir", str(run_dir), "--set", "trainer.total_steps=4",
               "--set", "trainer.save_every=4").exit_code == 0
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:2] + lines[4:]))  # steps 2–3 cut out: [0, 1, 4]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    refused = cli(*cfg, "--run-dir", str(run_dir), "--resume", "--set", "trainer.total_steps=5")
    said = " ".join(refused.output.split())
    assert refused.exit_code == 2 and said.startswith("error:") and "Traceback" not in said, refused.output
    assert "metrics.jsonl lacks the rows of steps 2–3, before checkpoint step_4" in said
    assert "--allow-config-change metrics.jsonl" in said
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing written
    allowed = cli(*cfg, "--run-dir", str(run_dir), "--resume", "--set", "trainer.total_steps=5",
                  "--allow-config-change", "metrics.jsonl")
    assert allowed.exit_code == 0, allowed.output
    assert "lacks the rows of steps 2–3" in " ".join(allowed.output.split())  # said again, as a warning
    assert [r["step"] for r in read_rows(run_dir)] == [0, 1, 4, 5]  # the gap stays a gap, nothing twice


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "model.safetensors"])
def test_a_corrupt_latest_checkpoint_is_refused_naming_the_complete_one_before_it(cfg, tmp_path, damaged):
    run_dir = tmp_path / "run"
    assert cli(*cfg, "--run-dir", str(run_dir), "--set", "trainer.total_steps=2").exit_code == 0
    ckpts = run_dir / "checkpoints"
    torn = ckpts / "step_2" / damaged
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])  # a copy cut short
    result = cli(*cfg, "--run-dir", str(run_dir), "--resume")
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and said.startswith("error:") and "Traceback" not in said, result.output
    assert len(result.output.strip().splitlines()) <= 3  # one line, however the console wraps it
    assert f"checkpoint {ckpts / 'step_2'} is corrupt: {torn}" in said
    assert f"the complete checkpoint before it is {ckpts / 'step_1'}" in said
    assert f"mv {ckpts / 'step_2'} {ckpts / 'corrupt-step_2'}" in said
    (ckpts / "step_2").rename(ckpts / "corrupt-step_2")  # as the message says
    resumed = cli(*cfg, "--run-dir", str(run_dir), "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert [r["step"] for r in read_rows(run_dir)] == [0, 1, 2, 3]
    assert [r["step"] for r in read_rows(run_dir, "samples.jsonl")] == [1, 2, 3]


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
