"""Errors, not tracebacks: bad input to `tether eval` / `tether train` / `--set` exits with one line naming what
is wrong (exit 2), a secret is never echoed, and a token budget the model cannot hold is refused at start."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tether.cli import app
from tether.config import ConfigError, load_config
from tether.runtime import Runtime, context_window

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("environment: {num_train_tasks: 5, num_eval_tasks: 2}\nengine: {max_tokens: 8}\n"
                    "agent_loop: {max_assistant_turns: 1}\n")
    return path


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    text = " ".join(result.output.split())  # rich may wrap long lines
    assert text.startswith("error:"), result.output
    for needle in needles:
        assert needle in text, result.output
    return text


# ------------------------------------------------------------------------------------------- tether eval

@pytest.mark.parametrize("n", ["0", "-62"])
def test_eval_tasks_must_be_positive(tiny_model, config, n):
    # 0 was a ZeroDivisionError; -62 silently evaluated the first 2 of 64 tasks
    result = runner.invoke(app, ["eval", tiny_model, "--config", str(config), "--tasks", n])
    assert result.exit_code == 2 and "--tasks" in result.output and "Traceback" not in result.output


@pytest.fixture
def corrupt_checkpoint(tiny_model, tmp_path):
    ckpt = tmp_path / "step_1"
    shutil.copytree(tiny_model, ckpt)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # torn: the header promises more than the file holds
    return ckpt


def test_eval_of_a_corrupt_safetensors_file_names_it(corrupt_checkpoint, config):
    result = runner.invoke(app, ["eval", str(corrupt_checkpoint), "--config", str(config)])
    one_line_error(result, str(corrupt_checkpoint / "model.safetensors"), "not a readable safetensors file")


def test_eval_refuses_max_tokens_the_model_cannot_hold(tiny_model, config):
    result = runner.invoke(app, ["eval", tiny_model, "--config", str(config), "--set", "engine.max_tokens=5000"])
    one_line_error(result, "engine.max_tokens", "5000", "max_position_embeddings is 4096")


# ------------------------------------------------------------------------------------------ tether train

def test_train_resume_from_a_corrupt_checkpoint_names_the_file(corrupt_checkpoint, config, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.move(corrupt_checkpoint, run / "checkpoints" / "step_1")
    (run / "checkpoints" / "step_1" / "trainer_state.pt").write_bytes(b"")
    result = runner.invoke(app, ["train", str(config), "--run-dir", str(run), "--resume"])
    one_line_error(result, str(run / "checkpoints" / "step_1" / "model.safetensors"))


def test_train_from_a_corrupt_model_path_names_the_file(corrupt_checkpoint, config, tmp_path):
    result = runner.invoke(app, ["train", str(config), "--run-dir", str(tmp_path / "run"),
                                 "--set", f"model.path={corrupt_checkpoint}"])
    one_line_error(result, str(corrupt_checkpoint / "model.safetensors"))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_train_refuses_a_run_dir_that_is_a_file(config, tmp_path):
    run = tmp_path / "run"
    run.write_text("not a folder")
    one_line_error(runner.invoke(app, ["train", str(config), "--run-dir", str(run)]), str(run), "not a directory")
    below = run / "sub"  # a parent that is a file: mkdir would raise NotADirectoryError
    one_line_error(runner.invoke(app, ["train", str(config), "--run-dir", str(below)]), str(below), "not a directory")


@pytest.mark.parametrize("where", ["chmod", "read-only file system"])
def test_train_refuses_a_run_dir_it_cannot_write(config, tmp_path, where):
    if where == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes through permission bits")
        parent = tmp_path / "ro"
        parent.mkdir()
        parent.chmod(0o555)
    else:
        parent = Path("/proc/sys")  # mounted read-only in containers
        if os.access(parent, os.W_OK):
            pytest.skip("/proc/sys is writable here")
    result = runner.invoke(app, ["train", str(config), "--run-dir", str(parent / "run")])
    one_line_error(result, str(parent / "run"), "not writable")


# -------------------------------------------------------------------------------------------------- --set

def test_a_boolean_is_not_a_number(config):
    # true was accepted as 1 (a bool is an int to pydantic's lax mode)
    with pytest.raises(ConfigError, match=r"`trainer.total_steps` = True in --set: expected an integer"):
        load_config(config, ["trainer.total_steps=true"])
    with pytest.raises(ConfigError, match=r"`policy_optimization.optimizer.lr` = False in --set: expected a number"):
        load_config(config, ["policy_optimization.optimizer.lr=false"])
    overrides = ["trainer.total_steps=3", "learner.gradient_accumulation_steps=2"]
    assert load_config(config, overrides).trainer.total_steps == 3
    assert load_config(config, ["rollout.partial_rollout.enabled=true"]).rollout.partial_rollout.enabled is True


@pytest.mark.parametrize("value", ["[unclosed-sk-SECRET", "{key: sk-SECRET", "[sk-SECRET, 2]", "{a: sk-SECRET}"])
def test_a_malformed_secret_is_never_echoed(config, value):
    result = runner.invoke(app, ["config", str(config), "--set", f"llm_client.api_key={value}"])
    assert result.exit_code == 2 and "llm_client.api_key" in result.output
    assert "SECRET" not in result.output


def test_an_override_without_equals_sign_that_may_hold_a_secret_is_not_echoed(config):
    result = runner.invoke(app, ["config", str(config), "--set", "llm_client.api_key:sk-SECRET"])
    assert result.exit_code == 2 and "expected key.path=value" in result.output and "SECRET" not in result.output


@pytest.mark.parametrize("command", ["config", "train"])
def test_set_with_a_space_for_the_equals_sign_never_echoes_the_value(config, tmp_path, command):
    # typer takes `llm_client.api_key` as the --set value and `sk-…` as a config FILE: "config file not found: sk-…"
    secret = "sk-proj-abc123SECRETvalue"
    run = ["--run-dir", str(tmp_path / "run")] if command == "train" else []
    for args in ([command, "--set", "llm_client.api_key", secret, *run],  # the key's value as the only FILE
                 [command, str(config), "--set", "llm_client.api_key", secret, *run]):
        text = one_line_error(runner.invoke(app, args), "--set llm_client.api_key: no value",
                              "--set takes key.path=value as one word", "not shown")
        assert "SECRET" not in text and "sk-" not in text
    assert not (tmp_path / "run").exists()


def test_a_config_file_named_like_a_key_is_not_echoed(config):
    text = one_line_error(runner.invoke(app, ["config", str(config), "hf_abcdefSECRET123"]),
                          "config file not found", "not shown", "--set takes key=value")
    assert "SECRET" not in text
    one_line_error(runner.invoke(app, ["config", "missing.yaml"]), "config file not found: missing.yaml")
    one_line_error(runner.invoke(app, ["config", str(config), "--set", "trainer.total_steps", "5"]),
                   "--set trainer.total_steps: no value", "--set trainer.total_steps=VALUE")


@pytest.mark.parametrize("text", ["", "\n\n", "# all commented out\n# trainer: {total_steps: 3}\n", "{}\n"])
def test_an_empty_config_as_the_only_file_is_refused(tmp_path, config, text):
    # it started 100 steps of the random preset
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    for command in (["config"], ["train", "--run-dir", str(tmp_path / "run")]):
        one_line_error(runner.invoke(app, [*command, str(empty)]), f"{empty} is empty: it sets no key")
    assert not (tmp_path / "run").exists()
    # an empty file among several is an overlay left empty: allowed
    result = runner.invoke(app, ["config", str(config), str(empty)])
    assert result.exit_code == 0 and "num_train_tasks: 5" in result.output, result.output


def test_a_malformed_ordinary_value_is_still_shown(config):
    result = runner.invoke(app, ["config", str(config), "--set", "engine.max_tokens=[12"])
    assert result.exit_code == 2 and "[12" in result.output


# ---------------------------------------------------------------------------------------- token budget

def test_context_window_past_the_model_is_clamped_with_a_warning(tiny_model, config, caplog):
    cfg = load_config(config, [f"model.path={tiny_model}"])
    assert cfg.environment.state.context_window == 32768
    with caplog.at_level(logging.WARNING, logger="tether.runtime"):
        rt = Runtime.build(cfg)
    try:
        assert rt.loop().limits.context_window == 4096  # the tiny model's positions
        assert "context_window = 32768 is more than" in caplog.text and "4096" in caplog.text
    finally:
        rt.close()
    small = load_config(config, ["environment.state.context_window=1024"])
    assert context_window(small.environment.state.context_window, small.engine.max_tokens, rt.model.config) == 1024
    with pytest.raises(ConfigError,
                       match=r"`engine.max_tokens` = 4096 does not fit .* max_position_embeddings is 4096"):
        context_window(cfg.environment.state.context_window, 4096, rt.model.config)


# -------------------------------------------------------------------------------------------- python -m

@pytest.mark.parametrize("module", ["tether", "tether.cli"])
def test_python_dash_m_runs_the_cli(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0 and "train" in out.stdout and "eval" in out.stdout, out.stdout + out.stderr
