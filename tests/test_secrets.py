"""Secrets in one module (``tether.secrets``): one interpolator, one name rule, and errors that name the key path
each secret (or endpoint value) came from — the judge's, the user simulator's and the teacher's own, not
``llm_client``'s. That no secret reaches a dump, a log or a request's output: tests/test_config.py,
tests/test_llm_client.py, tests/test_metrics.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tether.config import ConfigError, RunConfig, load_config
from tether.llm import LLMClient, MissingKey
from tether.secrets import Secret, interpolate, looks_secret, redact_by_name

ENDPOINTS = {  # the endpoint sections of a run, each as given in Python
    "llm_client": {"llm_client": {"base_url": "${TETHER_TEST_UNSET_URL}", "api_key": "${TETHER_TEST_UNSET_KEY}"}},
    "reward.judge_client": {
        "environment": {"verifier": {"judge": "llm"}},
        "reward": {"judge_client": {"base_url": "${TETHER_TEST_UNSET_URL}", "api_key": "${TETHER_TEST_UNSET_KEY}"}}},
    "environment.user_llm.client": {
        "environment": {"user_simulator": "llm",
                        "user_llm": {"client": {"base_url": "${TETHER_TEST_UNSET_URL}",
                                                "api_key": "${TETHER_TEST_UNSET_KEY}"}},
                        "action_space": [{"name": "respond_to_user", "params": ["message"], "timeout_ms": 600_000}]}},
    "teacher.remote": {
        "teacher": {"enabled": True,
                    "remote": {"base_url": "${TETHER_TEST_UNSET_URL}", "api_key": "${TETHER_TEST_UNSET_KEY}"}},
        "policy_optimization": {"advantage": {"degenerate_group_filter": {"enabled": False}}}},
}


def _section(cfg: RunConfig, path: str):
    section = cfg
    for part in path.split("."):
        section = getattr(section, part)
    return section


@pytest.mark.parametrize("path", ENDPOINTS)
def test_each_endpoint_names_its_own_keys(path, monkeypatch):
    monkeypatch.delenv("TETHER_TEST_UNSET_URL", raising=False)
    monkeypatch.delenv("TETHER_TEST_UNSET_KEY", raising=False)
    section = _section(RunConfig.model_validate(ENDPOINTS[path]), path)
    assert section.key_path == path and section.api_key.key_path == f"{path}.api_key"
    with pytest.raises(ConfigError, match=rf"`{path}\.base_url` refers to environment variable TETHER_TEST_UNSET_URL"):
        LLMClient.from_config(section)
    with pytest.raises(ConfigError, match=rf"`{path}\.api_key` refers to environment variable TETHER_TEST_UNSET_KEY"):
        section.api_key.get()

    monkeypatch.setenv("TETHER_TEST_UNSET_URL", "http://127.0.0.1:9/v1")
    client = LLMClient.from_config(section)
    with pytest.raises(MissingKey) as e:
        asyncio.run(client.chat([{"role": "user", "content": "hi"}]))
    assert str(e.value).startswith(f"{path}.api_key is ${{TETHER_TEST_UNSET_KEY}}, but environment variable "
                                   "TETHER_TEST_UNSET_KEY is not set")
    assert client.section == path


def test_an_endpoint_without_a_key_says_which_key_is_not_set():
    cfg = RunConfig.model_validate({"environment": {"verifier": {"judge": "llm"}},
                                    "reward": {"judge_client": {"base_url": "http://127.0.0.1:9/v1"}}})
    client = LLMClient.from_config(cfg.reward.judge_client)
    assert client.key.describe() == "no key (reward.judge_client.api_key is not set)"


def test_a_dumped_literal_key_is_diagnosed_as_the_placeholder(tmp_path):
    dump = load_config([], ["llm_client.api_key=sk-literal-3131"]).to_yaml()
    (tmp_path / "dump.yaml").write_text(dump)
    client = LLMClient.from_config(load_config([tmp_path / "dump.yaml"]).llm_client)
    assert any("placeholder `***`" in check for check in client.key.auth_checks())


def test_one_interpolator_and_one_name_rule(monkeypatch):
    monkeypatch.setenv("TETHER_TEST_A", "x")
    monkeypatch.delenv("TETHER_TEST_B", raising=False)
    assert interpolate("${TETHER_TEST_A}-${TETHER_TEST_A}", "k") == "x-x"
    with pytest.raises(ConfigError, match=r"`a.b` refers to environment variable TETHER_TEST_B, which is not set"):
        interpolate("${TETHER_TEST_B}", "a.b")
    assert [n for n in ("api_key", "key", "hf_token", "client_secret", "PASSWORD", "API_KEY") if looks_secret(n)] == \
        ["api_key", "key", "hf_token", "client_secret", "PASSWORD", "API_KEY"]
    assert not any(looks_secret(n) for n in ("monkey", "keys", "batch_size", "keep_recent_k"))
    assert Secret("${TETHER_TEST_A}").redacted() == "${TETHER_TEST_A}" and Secret("sk-1${X}").redacted() == "***"
    assert Secret("${A}${B}").variables() == ["A", "B"]
    assert redact_by_name({"env": [{"API_KEY": "sk-9", "name": "x"}]}) == {"env": [{"API_KEY": "***", "name": "x"}]}


def test_metrics_sits_below_the_config():
    code = "import sys, tether.metrics; print(sorted(m for m in sys.modules if m.startswith('tether.config')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
