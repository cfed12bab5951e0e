"""How a failed run ends, through the real ``tether train``: a line or three on the terminal (what failed; for a
failure of the run, the last complete checkpoint and the command that resumes from it), the exit code the CLI
documents (1 the run failed, 2 bad input), and the traceback in ``RUN/train.log`` only, never on the terminal.
Also the last resort of every command (``tether.cli_common.Group``): one line, the traceback in a file it names."""

from __future__ import annotations

import copy
import shlex
import threading
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import read_rows
from tether.cli import app
from tether.learner.checkpoint import latest_checkpoint
from tether.pipeline import trainer


@pytest.fixture
def cfg(cli_run_args):
    return cli_run_args(4)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def said(result, code: int) -> list[str]:
    """The lines from ``error:`` on (before them: the run's progress and warnings), once the exit code is checked
    and no traceback reached the terminal."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    assert "error:" in result.output, result.output
    return result.output[result.output.index("error:"):].splitlines()


def run_failed(result, run_dir: Path) -> list[str]:
    """Exit 1 with exactly three lines: the error (naming train.log), the last complete checkpoint, the resume
    command; the traceback in RUN/train.log."""
    lines = said(result, 1)
    assert len(lines) == 3, lines
    assert lines[0].endswith(f"(traceback: {run_dir / 'train.log'})"), lines
    assert lines[1] == f"last complete checkpoint: {latest_checkpoint(run_dir) or 'none'}", lines
    assert lines[2].startswith("resume with: tether train ") and lines[2].endswith(f"--run-dir {run_dir} --resume")
    log = (run_dir / "train.log").read_text()
    assert "ERROR the run failed: " in log and "Traceback (most recent call last)" in log
    return lines


@pytest.mark.slow
def test_an_exception_in_the_middle_of_a_run_names_the_checkpoint_and_the_printed_command_resumes(
        cfg, tmp_path, monkeypatch):
    """A RuntimeError at step 3, after step 2's checkpoint: exit 1, that checkpoint, the resume command; the
    command as printed finishes the run, every step once."""
    real, calls = trainer.step_metrics, []

    def fault_at_step_3(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        real(*args)

    monkeypatch.setattr(trainer, "step_metrics", fault_at_step_3)
    run_dir = tmp_path / "run"
    lines = run_failed(invoke("train", *cfg, "--run-dir", str(run_dir)), run_dir)
    assert lines[0].startswith("error: RuntimeError: injected fault"), lines
    assert latest_checkpoint(run_dir).name == "step_2"
    assert "RuntimeError: injected fault" in (run_dir / "train.log").read_text()
    monkeypatch.setattr(trainer, "step_metrics", real)
    command = shlex.split(lines[2].removeprefix("resume with: "))
    assert command[:2] == ["tether", "train"]
    resumed = invoke(*command[1:])
    assert resumed.exit_code == 0, resumed.output
    assert [r["step"] for r in read_rows(run_dir)] == [0, 1, 2, 3, 4]


def test_a_failure_before_the_run_wrote_anything_is_one_line_naming_the_traceback_file(cfg, tmp_path,
                                                                                      monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("broken before the run directory")

    monkeypatch.setattr(trainer, "train", broken)
    run_dir = tmp_path / "run"
    lines = said(invoke("train", *cfg, "--run-dir", str(run_dir)), 1)
    assert len(lines) == 1 and lines[0].startswith("error: RuntimeError: broken before the run directory"), lines
    where = Path(lines[0].rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert "Traceback (most recent call last)" in where.read_text() and not run_dir.exists()
    where.unlink()


def test_an_unset_key_variable_of_the_remote_engine_is_bad_input(cfg, tmp_path, monkeypatch):
    """engine.type remote, llm_client.api_key: ${VAR} with VAR unset: nothing is sent; exit 2 with one line naming
    the key path and the variable (was a 64-line traceback, exit 1), and how to resume the run it started."""
    monkeypatch.delenv("SOME_UNSET_VAR", raising=False)
    run_dir = tmp_path / "run"
    lines = said(invoke("train", *cfg, "--run-dir", str(run_dir), "--set", "engine.type=remote",
                        "--set", "llm_client.base_url=http://127.0.0.1:9/v1",
                        "--set", "llm_client.api_key=${SOME_UNSET_VAR}"), 2)
    assert len(lines) == 2, lines
    assert lines[0].startswith("error: llm_client.api_key is ${SOME_UNSET_VAR}, but environment variable "
                               "SOME_UNSET_VAR is not set"), lines
    assert lines[1].startswith(f"{run_dir} holds this run now: after the fix, resume with: tether train ")
    assert "--set 'llm_client.api_key=${SOME_UNSET_VAR}'" in lines[1]  # a reference, not a secret: shown
    assert "Traceback (most recent call last)" in (run_dir / "train.log").read_text()


def test_a_truncated_trainer_state_on_resume_is_one_line(cfg, tmp_path):
    """The latest checkpoint's trainer_state.pt cut short (was 49 lines, exit 1): refused in a line or two
    (tether/learner/checkpoint.py names the complete one before it), no traceback on the terminal."""
    run_dir = tmp_path / "run"
    assert invoke("train", *cfg, "--run-dir", str(run_dir), "--set", "trainer.total_steps=2").exit_code == 0
    state = run_dir / "checkpoints" / "step_2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    result = invoke("train", *cfg, "--run-dir", str(run_dir), "--resume", "--set", "trainer.total_steps=3")
    lines = said(result, 2)
    assert len(lines) <= 2 and "trainer_state.pt" in lines[0] and "step_1" in " ".join(lines), lines


def test_any_command_s_uncaught_exception_is_one_line_with_the_traceback_in_a_file(tmp_path, monkeypatch):
    """The last resort (tether.cli_common.Group): `tether report` meeting a bug."""
    import tether.report

    def bug(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(tether.report, "build_report", bug)
    lines = said(invoke("report", str(tmp_path)), 1)
    assert len(lines) == 1 and lines[0].startswith("error: KeyError: 'a bug' (traceback: "), lines
    where = Path(lines[0].rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert "Traceback (most recent call last)" in where.read_text()
    where.unlink()
    # bad input from any command: exit 2, one line, no file
    monkeypatch.setattr(tether.report, "build_report", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad")))
    assert said(invoke("report", str(tmp_path)), 2) == ["error: bad"]


def test_the_endpoint_lost_in_the_middle_of_a_run_names_it_the_checkpoint_and_the_resume_command(
        cfg, tmp_path, tiny_model):
    """engine.type remote against `tether serve`'s app, which is stopped after the weights of step 2 are pushed
    (was 219 lines and no way to resume): exit 1, one line naming the endpoint, the last checkpoint, the resume
    command."""
    from tether.engine.local import LocalEngine
    from tether.learner.model import load_model_and_tokenizer
    from tether.serve import ServerThread, make_app

    model, tokenizer = load_model_and_tokenizer(tiny_model)
    engine = LocalEngine(copy.deepcopy(model).eval())
    server_app = make_app(engine, tokenizer, model_name="tiny", weight_updates=True)  # --enable-weight-updates
    pushes: Counter = Counter()
    server = ServerThread(server_app)

    @server_app.middleware("http")
    async def lose_after_step_2(request, call_next):
        response = await call_next(request)
        if request.url.path == "/update_weights_from_tensor":
            pushes["n"] += 1
            if pushes["n"] == 3:  # the push at start, then steps 1 and 2
                threading.Thread(target=server.stop).start()
        return response

    server.start()
    run_dir = tmp_path / "run"
    try:
        result = invoke("train", *cfg, "--run-dir", str(run_dir), "--set", "engine.type=remote",
                        "--set", f"llm_client.base_url={server.base_url}/v1", "--set", "llm_client.model=tiny",
                        "--set", "llm_client.max_retries=0")
    finally:
        server.stop()
        engine.close()
    lines = run_failed(result, run_dir)
    assert f"127.0.0.1:{server.port}" in lines[0] and "refused" in lines[0], lines
    assert latest_checkpoint(run_dir) is not None


def test_a_run_refused_because_another_holds_the_directory_writes_nothing_there(cfg, tmp_path):
    """Even when the holder rewrites config.yaml meanwhile (it resumed): the refusal is one line, exit 2, and the
    holder's train.log gets none of the refused run's failure."""
    from tether.pipeline import run_lock

    run_dir = tmp_path / "run"
    assert invoke("train", *cfg, "--run-dir", str(run_dir), "--set", "trainer.total_steps=1").exit_code == 0
    log = (run_dir / "train.log").read_text()
    holder = run_lock.RunLock(run_dir).acquire()
    real = run_lock.RunLock.acquire

    def holder_writes_meanwhile(self):
        (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text())
        return real(self)

    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(run_lock.RunLock, "acquire", holder_writes_meanwhile)
            lines = said(invoke("train", *cfg, "--run-dir", str(run_dir), "--resume"), 2)
    finally:
        holder.release()
    assert len(lines) == 1 and "in use by another run" in lines[0], lines
    assert (run_dir / "train.log").read_text() == log
