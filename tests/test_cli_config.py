"""`tether config`: prints the merged config as YAML (with `# warning:` lines), exits 2 with the key path on
bad input (including a key whose feature is not built). `--explain`: tests/test_config_honesty.py."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from tether.cli import app
from tether.config.support import REFUSED_SECTIONS

SEEDS = sorted((Path(__file__).resolve().parents[1] / "configs" / "seeds").glob("*.yaml"))
runner = CliRunner()


def supported(tmp_path):
    """The seed files less the sections refused at load (resource_pool, actor_worker)."""
    out = []
    for path in SEEDS:
        data = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k not in REFUSED_SECTIONS}
        (tmp_path / path.name).write_text(yaml.safe_dump(data))
        out.append(str(tmp_path / path.name))
    return out


def test_config_prints_resolved_yaml(tmp_path):
    result = runner.invoke(app, ["config", *supported(tmp_path), "--set", "agent_loop.max_parallel_calls=4",
                                 "--set", "tool_parser.stop_token_ids=[1,2]",
                                 "--set", "trainer.require_batches=1"])
    assert result.exit_code == 0, result.output
    assert len(SEEDS) == 6
    data = yaml.safe_load(result.stdout)
    assert data["rollout"]["mode"] == "fully_async"
    assert data["agent_loop"]["max_parallel_calls"] == 4
    assert data["tool_parser"]["stop_token_ids"] == [1, 2]
    assert "class" not in data["trainer"] and "rollouter" not in data  # the pipeline is held once: rollout.mode
    assert data["policy_optimization"]["optimizer"]["lr"] == 1e-6
    assert not REFUSED_SECTIONS & set(data)
    assert "# derived: samples_per_step=64, prompts_per_step=8" in result.stdout
    assert "# warning: policy_optimization.rollout_allocation.reallocation_interval = 100 >= " in result.stdout


def test_fully_async_seed_alone_resolves_to_fully_async():
    result = runner.invoke(app, ["config", str(SEEDS[3])])
    assert SEEDS[3].name == "fully_async_ppo.yaml" and result.exit_code == 0, result.output
    data = yaml.safe_load(result.stdout)
    assert data["rollout"]["mode"] == "fully_async"
    assert "class" not in data["trainer"] and "rollouter" not in data  # the seed's class keys: folded into the mode


def test_separation_seed_loads_with_its_pools():
    """Its resource_pool keys are the Ray backend's (tether.config.cluster), its actor_worker the trainer's."""
    result = runner.invoke(app, ["config", str(SEEDS[5])])
    assert SEEDS[5].name == "separation_config.yaml" and result.exit_code == 0, result.output
    pools = yaml.safe_load(result.stdout)["resource_pool"]
    assert pools["trainer_pool"]["num_gpus"] == pools["rollout_pool"]["num_gpus"] == 8


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
    # the resolved config shows the reference or ***, never the value
    monkeypatch.setenv("TETHER_API_KEY", "sk-env-secret-5150")
    cfg = tmp_path / "k.yaml"
    cfg.write_text('llm_client:\n  api_key: "${TETHER_API_KEY}"\n')
    result = runner.invoke(app, ["config", str(cfg)])
    assert result.exit_code == 0 and "${TETHER_API_KEY}" in result.stdout
    assert "sk-env-secret-5150" not in result.output

    result = runner.invoke(app, ["config", str(cfg), "--set", "llm_client.api_key=sk-literal-6060"])
    assert result.exit_code == 0 and "api_key: '***'" in result.stdout
    assert "sk-literal-6060" not in result.output
    result = runner.invoke(app, ["config", str(cfg), "--explain", "llm_client.api_key",
                                 "--set", "llm_client.api_key=sk-literal-6060"])
    assert result.exit_code == 0 and "sk-literal-6060" not in result.output and "***" in result.stdout
