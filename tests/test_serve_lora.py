"""LoRA adapters through ``tether serve`` (``tether.serve.adapters``), on the tests' tiny model, with numbers.

- a tether LoRA checkpoint loaded by name (vLLM's ``/v1/load_lora_adapter``) is served as peft's own model of it:
  greedy tokens are its argmax and their logprobs a teacher-forced forward of ``PeftModel.from_pretrained`` within
  1e-5 (float32), while the served model's name still gives the base's; unloaded, its name is 404;
- a bad adapter folder, a name loaded twice, one adapter too many are answered 400 naming what is wrong;
- ``RemoteEngine.update_adapter`` (a LoRA run's weight sync) sends A and B only, the server reports the version and
  then serves the learner's peft policy;
- a ``model.lora`` run with ``engine.type: remote`` samples the policy it trains (``rollout/logp_abs_diff_mean``
  < 1e-5) and syncs the adapter's bytes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil

import httpx
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conftest import counted_server
from test_lora import trained
from tether.config import ConfigError, load_config
from tether.config.sections import LoraConfig
from tether.engine.base import SamplingParams
from tether.engine.local import LocalEngine
from tether.engine.remote import RemoteEngine, state_bytes
from tether.learner import load_model_and_tokenizer, lora
from tether.learner.checkpoint import save_checkpoint
from tether.llm import BadRequest, LLMClient
from tether.serve import ServerThread

PUSH, TENSOR = "/update_lora_adapter_from_tensor", "/update_weights_from_tensor"
PROMPTS = [[5, 17, 99, 4, 250, 31], [12, 7, 301, 44], [88, 3, 19, 200, 61, 9, 70]]


@pytest.fixture(scope="module")
def ckpt(tiny_model, tmp_path_factory):
    """A tether LoRA checkpoint (rank 4, alpha 32: s = 8) after one training step: peft's folder format."""
    learner = trained(tiny_model)
    _, tokenizer = load_model_and_tokenizer(tiny_model)
    return save_checkpoint(tmp_path_factory.mktemp("lora") / "step_1", learner, tokenizer, {"step": 1})


@pytest.fixture
def server(tiny_model, tmp_path_factory):
    """``server(**make_app_kwargs)``: the tiny model served as "tiny" on a LocalEngine; requests counted by path.
    Weight updates allowed, from any folder of the tests' temporary ones."""
    started = []

    def start(**kw):
        model, tokenizer = load_model_and_tokenizer(tiny_model)
        engine = LocalEngine(copy.deepcopy(model))
        kw = {"weight_updates": True, "weights_root": tmp_path_factory.getbasetemp(), **kw}
        s = counted_server(engine, tokenizer, **kw)
        s.engine = engine
        started.append((s, engine))
        return s

    yield start
    for s, engine in started:
        s.stop()  # the app's lifespan closes the adapters' engines
        engine.close()


def teacher_forced(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """log_softmax of each of ``ids`` after ``prompt`` by one forward pass (greedy requests: T = 1)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def greedy(url: str, model: str, prompt: list[int], n: int = 12) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n,
                                                     "temperature": 0, "logprobs": 0, "ignore_eos": True,
                                                     "return_token_ids": True}, timeout=60)


def choice_of(r: httpx.Response) -> tuple[list[int], torch.Tensor]:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["token_ids"], torch.tensor(c["logprobs"]["token_logprobs"])


def load(url: str, name: str, path, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **kw},
                      timeout=60)


def test_a_loaded_adapter_serves_the_peft_model_and_the_base_name_the_base(server, ckpt, tiny_model):
    s = server()
    url = s.base_url
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(ckpt)).eval()
    base, _ = load_model_and_tokenizer(tiny_model)
    r = load(url, "support-v1", ckpt)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'support-v1' added successfully.", r.text
    cards = httpx.get(url + "/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [("tiny", None, None),
                                                                  ("support-v1", "tiny", str(ckpt))]
    assert httpx.get(url + "/v1/models/support-v1").json()["parent"] == "tiny"
    worst_lora = worst_base = 0.0
    apart = []
    for prompt in PROMPTS:
        ids, lps = choice_of(greedy(url, "support-v1", prompt))
        worst_lora = max(worst_lora, (lps - teacher_forced(peft, prompt, ids)).abs().max().item())
        with torch.inference_mode():  # greedy: the peft model's argmax, token by token
            assert ids == peft(input_ids=torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:].argmax(
                -1).tolist()
        apart.append((lps - teacher_forced(base, prompt, ids)).abs().max().item())
        base_ids, base_lps = choice_of(greedy(url, "tiny", prompt))
        worst_base = max(worst_base, (base_lps - teacher_forced(base, prompt, base_ids)).abs().max().item())
    print(f"\nadapter by name: max |served - peft teacher-forced| = {worst_lora:.1e}; base: {worst_base:.1e}; "
          f"adapter vs base on the adapter's tokens: {min(apart):.1e}..{max(apart):.1e}")
    assert worst_lora < 1e-5 and worst_base < 1e-5
    assert min(apart) > 1e-3  # the adapter is not the base: the comparison above can fail
    chat = httpx.post(url + "/v1/chat/completions", json={"model": "support-v1", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hello"}]}, timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "support-v1"

    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "support-v1"})
    assert r.status_code == 200 and "removed" in r.text
    gone = greedy(url, "support-v1", PROMPTS[0])
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]] == ["tiny"]
    again = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "support-v1"})
    assert again.status_code == 404 and "'support-v1' is not loaded" in again.json()["error"]["message"]
    assert s.engine.version == 0  # the served model never changed


def other_width_adapter(folder, hidden: int):
    """A real peft adapter (rank 4, default targets) of a 1-layer model ``hidden`` wide."""
    config = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=300)
    peft = lora.wrap(Qwen2ForCausalLM(config), LoraConfig(rank=4))
    peft.save_pretrained(str(folder))
    return folder


def edited(ckpt, folder, *, config: dict | None = None, rename: tuple[str, str] | None = None, drop: str = ""):
    """A copy of ``ckpt`` with adapter_config.json fields set, tensor names edited, or a file removed."""
    shutil.copytree(ckpt, folder)
    if config:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if rename:
        weights = load_file(folder / "adapter_model.safetensors")
        save_file({k.replace(*rename): v for k, v in weights.items()}, folder / "adapter_model.safetensors")
    if drop:
        (folder / drop).unlink()
    return folder


def test_adapter_errors_name_what_is_wrong(server, ckpt, tmp_path):
    s = server(max_loras=2)
    url = s.base_url
    assert load(url, "a", ckpt).status_code == 200

    def refused(name, path, status=400, **kw) -> str:
        r = load(url, name, path, **kw)
        assert r.status_code == status, r.text
        return r.json()["error"]["message"]

    assert "'a' is already loaded" in refused("a", ckpt) and "load_inplace" in refused("a", ckpt)
    assert load(url, "a", ckpt, load_inplace=True).status_code == 200  # vLLM's replace in place
    assert "the served model's own name" in refused("tiny", ckpt)
    assert "is not a folder on the server" in refused("b", tmp_path / "nowhere")
    assert "has no adapter_config.json" in refused("b", edited(ckpt, tmp_path / "c1", drop="adapter_config.json"))
    assert "has no adapter_model.safetensors" in refused(
        "b", edited(ckpt, tmp_path / "c2", drop="adapter_model.safetensors"))
    assert "do not have the rank r=8" in refused("b", edited(ckpt, tmp_path / "c3", config={"r": 8}))
    assert "target_modules ['gate_up_proj']" in refused(
        "b", edited(ckpt, tmp_path / "c4", config={"target_modules": ["q_proj", "gate_up_proj"]}))
    assert "use_dora" in refused("b", edited(ckpt, tmp_path / "c5", config={"use_dora": True}))
    msg = refused("b", edited(ckpt, tmp_path / "c6", rename=("layers.0.", "layers.7.")))
    assert "not linear layers of the served model" in msg and "model.layers.7." in msg
    msg = refused("b", other_width_adapter(tmp_path / "wide", 48))
    assert "do not fit the served model's shapes" in msg and "(48, 4)" in msg, msg
    assert load(url, "b", ckpt).status_code == 200
    msg = refused("c", ckpt)
    assert "--max-loras 2" in msg and "['a', 'b']" in msg
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert greedy(url, "nope", PROMPTS[0]).status_code == 404
    engines = [a.gen.engine for a in s.server.config.app.state.adapters.all()]
    assert len(engines) == 2
    s.stop()  # the app's lifespan closes the adapters' engines
    for engine in engines:
        with pytest.raises(RuntimeError, match="closed"):
            asyncio.run(engine.generate(PROMPTS[0], SamplingParams(max_tokens=1)))


def remote_of(s) -> RemoteEngine:
    return RemoteEngine(LLMClient(s.base_url + "/v1", model="tiny", max_retries=0))


def test_update_adapter_sends_the_adapter_alone_and_the_server_serves_the_policy(server, tiny_model, tmp_path):
    s = server()
    learner = trained(tiny_model)
    policy = learner.model.eval()
    adapter, scaling = learner.adapter_for_engine(), learner.lora_scaling
    remote = remote_of(s)
    remote.update_adapter(adapter, scaling, 1)
    sent = len(state_bytes(adapter))
    full = len(state_bytes(learner.state_dict_for_engine()))
    assert s.calls[PUSH] == 1 and s.calls[TENSOR] == 0
    assert remote.stats["weight_update_bytes"] == sent < full / 10, (sent, full)  # 16 KiB vs 0.54 MiB
    assert remote.version == s.engine.version == remote.server_version() == 1

    def worst() -> float:
        async def all_prompts():
            return await asyncio.gather(*(remote.generate(p, SamplingParams(temperature=0.0, max_tokens=12))
                                          for p in PROMPTS))

        out = asyncio.run(all_prompts())
        assert all(set(o.versions) == {remote.version} for o in out)
        return max((torch.tensor(o.logprobs) - teacher_forced(policy, p, o.token_ids)).abs().max().item()
                   for p, o in zip(PROMPTS, out))

    assert worst() < 1e-5
    remote.update_adapter(adapter, scaling, 2)  # merged from the base again, not onto the last merge
    assert worst() < 1e-5 and remote.server_version() == 2
    wide = lora.adapter_for_engine(lora.wrap(Qwen2ForCausalLM(Qwen2Config(
        hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=300)), LoraConfig(rank=4)))  # an adapter of a model 48 wide, not 32
    with pytest.raises(BadRequest, match="do not fit the served model's shapes"):
        remote.update_adapter(wide, scaling, 3)
    assert remote.server_version() == 2 and remote.stats["weight_updates"] == 2
    with pytest.raises(ValueError, match="engine.weight_sync_dir"):
        RemoteEngine(remote.client, weight_sync_dir=tmp_path).update_adapter(adapter, scaling, 3)
    remote.close()


def test_a_server_without_the_adapter_endpoint_is_named_with_what_to_do():
    from fastapi import FastAPI

    with ServerThread(FastAPI()) as bare:
        remote = remote_of(bare)
        with pytest.raises(BadRequest, match=r"no /update_lora_adapter_from_tensor endpoint(.|\n)*tether serve"):
            remote.update_adapter({"m.lora_A": torch.zeros(1, 2), "m.lora_B": torch.zeros(2, 1)}, 1.0, 1)
        assert remote.version == 0
        remote.close()


def test_model_lora_loads_with_engine_type_remote_and_refuses_weight_sync_dir():
    remote = ["engine.type=remote", "llm_client.base_url=http://127.0.0.1:8000/v1", "model.lora.rank=8"]
    assert load_config([], remote).model.lora.rank == 8
    with pytest.raises(ConfigError) as e:
        load_config([], [*remote, "engine.weight_sync_dir=/tmp/w"])
    assert "`model.lora.rank` = 8 (--set), `engine.weight_sync_dir` = '/tmp/w' (--set)" in str(e.value), str(e.value)


@pytest.mark.slow
def test_a_remote_lora_run_samples_the_policy_and_syncs_the_adapter(server, small_run):
    s = server()
    rows, _, run_dir = small_run("remote_lora", "model.lora.rank=8", "trainer.total_steps=2", "trainer.save_every=2",
                                 "engine.type=remote", f"llm_client.base_url={s.base_url}/v1", "llm_client.model=tiny")
    assert s.calls[TENSOR] == 1 and s.calls[PUSH] == 2 and s.engine.version == 2  # the base at start, then adapters
    print(f"\nremote LoRA run: rollout/logp_abs_diff_mean {rows[-1]['rollout/logp_abs_diff_mean']:.1e}")
    assert rows[-1]["rollout/logp_abs_diff_mean"] < 1e-5
    weights = load_file(run_dir / "checkpoints" / "step_2" / "adapter_model.safetensors")
    synced = [r["perf/weight_sync_mb"] for r in rows if "perf/weight_sync_mb" in r]
    assert synced and synced[-1] == pytest.approx(sum(v.nbytes for v in weights.values()) / 2**20)


@pytest.mark.parametrize("args, expected", [([], 4), (["--max-loras", "1"], 1)])
def test_the_max_loras_flag_reaches_the_server(tiny_model, monkeypatch, args, expected):
    from typer.testing import CliRunner

    from tether.cli import app
    from tether.serve import server as serve_module

    seen = {}
    monkeypatch.setattr(serve_module, "serve", lambda *a, **kw: seen.update(kw))
    result = CliRunner().invoke(app, ["serve", tiny_model, *args])
    assert result.exit_code == 0, result.output
    assert seen["max_loras"] == expected
