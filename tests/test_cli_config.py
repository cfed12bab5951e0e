"""`tether config`: prints the merged config as YAML, exits 2 with the key path on bad input."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from tether.cli import app

SEEDS = sorted((Path(__file__).resolve().parents[1] / "configs" / "seeds").glob("*.yaml"))
runner = CliRunner()


def test_config_prints_resolved_yaml(monkeypatch):
    monkeypatch.delenv("TETHER_API_KEY", raising=False)  # printing needs no secret
    result = runner.invoke(app, ["config", *map(str, SEEDS), "--set", "agent_loop.max_parallel_calls=4",
                                 "--set", "tool_parser.stop_token_ids=[1,2]",
                                 "--set", "trainer.require_batches=1"])
    assert result.exit_code == 0, result.output
    assert len(SEEDS) == 6
    data = yaml.safe_load(result.stdout)
    assert data["rollout"]["mode"] == "fully_async"
    assert data["agent_loop"]["max_parallel_calls"] == 4
    assert data["tool_parser"]["stop_token_ids"] == [1, 2]
    assert data["trainer"]["class"] == "FullyAsyncTrainer"
    assert data["policy_optimization"]["optimizer"]["lr"] == 1e-6
    assert data["llm_client"]["api_key"] == "${TETHER_API_KEY}"
    assert "# derived: samples_per_step=64, prompts_per_step=8" in result.stdout


def test_bad_file_exits_2_with_key_path_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  scheduler:\n    max_staleness: -1\n")
    result = runner.invoke(app, ["config", str(bad)])
    assert result.exit_code == 2
    assert "rollout.scheduler.max_staleness" in result.stderr and "bad.yaml" in result.stderr
    assert result.stdout == "" and "Traceback" not in result.output


def test_bad_set_and_missing_file_exit_2(tmp_path):
    result = runner.invoke(app, ["config", str(SEEDS[0]), "--set", "learner.batchsize=3"])
    assert result.exit_code == 2 and "unknown key `learner.batchsize` in --set" in result.stderr
    result = runner.invoke(app, ["config", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 2 and "absent.yaml" in result.stderr


def test_secret_from_environment_or_set_never_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_API_KEY", "sk-env-secret-5150")
    cfg = tmp_path / "k.yaml"
    cfg.write_text('llm_client:\n  api_key: "${TETHER_API_KEY}"\n')
    result = runner.invoke(app, ["config", str(cfg)])
    assert result.exit_code == 0
    assert "sk-env-secret-5150" not in result.output and "${TETHER_API_KEY}" in result.stdout

    result = runner.invoke(app, ["config", str(cfg), "--set", "llm_client.api_key=sk-literal-6060"])
    assert result.exit_code == 0
    assert "sk-literal-6060" not in result.output and "api_key: '***'" in result.stdout
