"""``tether train examples/openenv_env/config.yaml`` through the real CLI, the OpenEnv server started by tether: the
run trains, the server is gone after it; a server killed in the middle of an episode costs that episode (counted by
cause, the server started again) or, with ``environment.openenv.on_server_death: stop``, stops the run with one
line naming the server."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("openenv")

from conftest import read_rows  # noqa: E402
from tests.conftest import process_gone
from tether.cli import app  # noqa: E402
from tether.env.openenv.env import OpenEnvEpisode  # noqa: E402
from tether.env.openenv.server import ServerProcess  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openenv_env"




@pytest.fixture
def servers(monkeypatch):
    """The PIDs of every server process tether starts, in order."""
    pids: list[int] = []
    launch = ServerProcess.launch

    def spied(self):
        launch(self)
        pids.append(self.pid)

    monkeypatch.setattr(ServerProcess, "launch", spied)
    return pids


def train(tiny_model, run_dir, *overrides):
    args = ["train", "config.yaml", "--set", "model.preset=null", "--set", f"model.path={tiny_model}",
            *(a for o in overrides for a in ("--set", o)), "--run-dir", str(run_dir)]
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_tether_train_runs_the_openenv_example_and_stops_its_server(tiny_model, tmp_path, monkeypatch, servers):
    monkeypatch.chdir(EXAMPLE)
    result = train(tiny_model, tmp_path / "run")
    assert result.exit_code == 0, result.output
    rows = [r for r in read_rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["rollout/generated_trajectories"] == 8
        assert all(math.isfinite(r[k]) for k in ("reward/mean", "reward/openenv", "optim/loss", "optim/grad_norm"))
        assert not any(k.startswith("env/openenv_errors") for k in r)
    evals = [json.loads(line) for f in (tmp_path / "run" / "validation").glob("step_*.jsonl")
             for line in f.read_text().splitlines()]
    assert len(evals) == 8  # 4 held-out seeds, at step 0 and at the end
    assert all("I am thinking of a number" in json.dumps(e) for e in evals)  # the server's reset reached the model
    assert len(servers) == 1 and process_gone(servers[0])  # environment.openenv.servers: 1, stopped with the run


def kill_server_after_reset(monkeypatch, servers, nth: int):
    """SIGKILL the server right after the ``nth`` episode's reset: that episode's session dies in its middle."""
    resets = []
    reset = OpenEnvEpisode.reset

    def killing(self, task_id=None):
        obs = reset(self, task_id)
        resets.append(task_id)
        if len(resets) == nth:
            os.kill(self._where.server.pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self._where.server.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        return obs

    monkeypatch.setattr(OpenEnvEpisode, "reset", killing)
    return resets


def test_a_killed_server_fails_its_episodes_counted_and_the_run_goes_on(tiny_model, tmp_path, monkeypatch,
                                                                        servers):
    monkeypatch.chdir(EXAMPLE)
    kill_server_after_reset(monkeypatch, servers, nth=13)  # in step 2 (step 0's evaluation: 4, step 1: 8)
    result = train(tiny_model, tmp_path / "run")
    assert result.exit_code == 0, result.output
    rows = {r["step"]: r for r in read_rows(tmp_path / "run") if "reward/mean" in r}
    assert sorted(rows) == [1, 2, 3, 4]
    hit = rows[2]
    assert hit["env/openenv_errors/server_died"] == 1  # the killed session's episode, counted by cause
    assert "env/openenv_errors/connection" not in hit  # a replacement running meanwhile does not hide the death
    assert hit["rollout/episode_errors"] == 1  # that attempt failed (rollout.worker.retry_on_failure re-made it)
    assert hit["env/openenv_server_restarts"] == 1  # the next episode found it dead and started it again
    assert hit["rollout/generated_trajectories"] == 8 - hit.get("rollout/episode_failures/env", 0)
    for step in (1, 3, 4):  # before and after: every episode ran
        assert rows[step]["rollout/generated_trajectories"] == 8 and "env/openenv_errors/server_died" not in rows[step]
    assert all(math.isfinite(r["optim/loss"]) for r in rows.values())
    assert len(servers) == 2 and all(process_gone(p) for p in servers)  # the one killed and its replacement, stopped


def test_on_server_death_stop_ends_the_run_with_one_line(tiny_model, tmp_path, monkeypatch, servers):
    monkeypatch.chdir(EXAMPLE)
    kill_server_after_reset(monkeypatch, servers, nth=13)
    result = train(tiny_model, tmp_path / "run", "environment.openenv.on_server_death=stop")
    assert result.exit_code == 1, result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert line.startswith("error: StopRun: OpenEnv server 0 (guess_server:app, pid ")
    assert "died (exit status -9)" in line and "environment.openenv.on_server_death: stop" in line
    assert "Traceback" not in result.output
    rows = [r for r in read_rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1]  # step 2 never finished
    assert len(servers) == 1 and process_gone(servers[0])  # not restarted; stopped
