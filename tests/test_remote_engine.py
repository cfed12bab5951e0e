"""The remote engine (``engine.type: remote``) against a real ``tether serve`` app on loopback.

Each test serves the tiny model with uvicorn in a thread (``tether.serve.ServerThread``) and counts the requests
the server receives, by route. What they pin:

- token-in/token-out: the server's tokens and behaviour logprobs are those of a teacher-forced forward pass of
  the same weights (float error only), and with a deterministic server exactly those of an in-process
  ``LocalEngine`` — bit for bit, JSON included;
- ``update_weights`` reaches the update endpoint (the body by default, a shared folder with
  ``engine.weight_sync_dir``), changes what is generated and the versions the tokens carry, also in the middle of
  a generation (partial rollout: the server's ``weight_versions`` and ``num_preempted`` come through);
- a training run with ``engine.type: remote`` pushes the weights at start and at every sync, and at
  ``trainer.deterministic`` is the local engine's run bit for bit (metrics, samples, weights).
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import SMALL_RUN, counted_server, read_rows
from tether.engine.base import SamplingParams
from tether.engine.local import LocalEngine
from tether.engine.remote import RemoteEngine, parse_choice
from tether.learner.model import load_model_and_tokenizer
from tether.llm import EndpointUnreachable, LLMClient, MalformedResponse
from tether.serve import ServerThread

TENSOR, DISK, COMPLETIONS = "/update_weights_from_tensor", "/update_weights_from_disk", "/v1/completions"


@dataclass
class Served:
    server: ServerThread
    engine: LocalEngine  # the server's engine
    model: torch.nn.Module  # a copy of the weights it started with
    tokenizer: object
    calls: Counter  # requests received, by path

    @property
    def url(self) -> str:
        return self.server.base_url + "/v1"

    def remote(self, **kwargs) -> RemoteEngine:
        client = LLMClient(self.url, model="tiny", max_retries=0)
        return RemoteEngine(client, max_model_len=self.model.config.max_position_embeddings, **kwargs)


@pytest.fixture
def serve(tiny_model, tmp_path_factory):
    """``serve(**engine_kwargs)``: the tiny model behind ``tether serve``'s app on a free loopback port, weight updates
    allowed (``tether serve --enable-weight-updates``) from the tests' temporary folders."""
    started: list[tuple[ServerThread, LocalEngine]] = []

    def start(**engine_kwargs) -> Served:
        model, tokenizer = load_model_and_tokenizer(tiny_model)
        engine = LocalEngine(copy.deepcopy(model).eval(), **engine_kwargs)
        server = counted_server(engine, tokenizer, weight_updates=True, weights_root=tmp_path_factory.getbasetemp())
        started.append((server, engine))
        return Served(server, engine, model, tokenizer, server.calls)

    yield start
    for server, engine in started:
        server.stop()
        engine.close()


def teacher_forced(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each of ``ids`` after ``prompt``, by one forward pass over the whole sequence."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(ids)[:, None])[:, 0]


def prompts(tokenizer) -> list[list[int]]:
    texts = ["where is my order", "I want a refund for the blue kettle", "hello", "cancel order 1234 please now"]
    return [tokenizer.encode(t) for t in texts]


async def generate_all(engine, requests):
    return await asyncio.gather(*(engine.generate(p, params) for p, params in requests))


def test_tokens_and_logprobs_match_a_teacher_forced_forward_pass(serve):
    """Concurrent requests (batched by the server) at T = 1, 0.7 and greedy: every behaviour logprob is the
    forward pass's within float error (max abs difference printed), greedy tokens are its argmax."""
    served = serve()
    remote = served.remote()
    requests = [(p, SamplingParams(temperature=t, max_tokens=24, seed=7 + i))
                for i, p in enumerate(prompts(served.tokenizer)) for t in (1.0, 0.7, 0.0)]
    results = asyncio.run(generate_all(remote, requests))
    worst = 0.0
    for (prompt, params), out in zip(requests, results):
        assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 24 and out.finish_reason == "length"
        expected = teacher_forced(served.model, prompt, out.token_ids, params.temperature)
        worst = max(worst, (torch.tensor(out.logprobs) - expected).abs().max().item())
        if params.temperature == 0:
            with torch.inference_mode():
                logits = served.model(input_ids=torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
            assert out.token_ids == logits.argmax(-1).tolist()
    print(f"\nremote engine: max |behaviour logprob - teacher-forced logprob| = {worst:.2e} over "
          f"{sum(len(r.token_ids) for r in results)} tokens")
    assert worst < 1e-4
    assert remote.stats["requests"] == len(requests) == served.calls[COMPLETIONS]
    assert remote.stats["generated_tokens"] == 24 * len(requests) and remote.stats["busy_s"] > 0
    remote.close()


def test_a_deterministic_server_returns_exactly_what_the_local_engine_does(serve):
    served = serve(deterministic=True)
    local = LocalEngine(copy.deepcopy(served.model).eval(), deterministic=True)
    remote = served.remote()
    eos = served.tokenizer.eos_token_id
    requests = [(p, SamplingParams(temperature=1.0, max_tokens=16, seed=3 + i, stop_token_ids=(eos,)))
                for i, p in enumerate(prompts(served.tokenizer))]
    assert asyncio.run(generate_all(remote, requests)) == asyncio.run(generate_all(local, requests))
    local.close()
    remote.close()


def test_update_weights_changes_generation_and_the_versions_on_tokens(serve, tmp_path):
    served = serve()
    prompt = prompts(served.tokenizer)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    remote = served.remote()
    before = asyncio.run(remote.generate(prompt, greedy))
    assert set(before.versions) == {0}

    torch.manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn_like(v) for k, v in served.model.state_dict().items()}
    remote.update_weights(noisy, 1)  # the request body: /update_weights_from_tensor
    assert served.calls[TENSOR] == 1 and remote.stats["weight_updates"] == 1 and remote.stats["weight_update_bytes"] > 0
    assert remote.version == served.engine.version == remote.server_version() == 1
    after = asyncio.run(remote.generate(prompt, greedy))
    assert set(after.versions) == {1} and after.token_ids != before.token_ids
    served.model.load_state_dict(noisy)  # the served weights are now these
    expected = teacher_forced(served.model, prompt, after.token_ids, 0.0)
    assert (torch.tensor(after.logprobs) - expected).abs().max() < 1e-4

    shared = tmp_path / "weights"  # a folder both sides see: /update_weights_from_disk
    by_disk = served.remote(weight_sync_dir=shared, model_config=served.model.config, version=1)
    by_disk.update_weights(copy.deepcopy(served.model).state_dict(), 2)
    torch.manual_seed(1)
    by_disk.update_weights({k: v + 0.5 * torch.randn_like(v) for k, v in served.model.state_dict().items()}, 3)
    assert served.calls[DISK] == 2 and served.engine.version == by_disk.version == 3
    assert sorted(p.name for p in shared.iterdir()) == ["v3"]  # the previous version's folder is gone
    assert {p.name for p in (shared / "v3").iterdir()} == {"model.safetensors", "config.json"}
    assert set(asyncio.run(by_disk.generate(prompt, greedy)).versions) == {3}
    remote.close()
    by_disk.close()


def test_an_update_in_the_middle_of_a_generation_shows_in_its_versions(serve):
    """Partial rollout on the server: the generation resumes under the new weights; the tokens before the update
    carry version 0, those after it version 1, and the interruption is counted."""
    served = serve(partial_rollout=True, segment_length=1)
    remote = served.remote()
    prompt = prompts(served.tokenizer)[1]
    state = copy.deepcopy(served.model).state_dict()

    def push_when_started():
        while served.engine.stats["generated_tokens"] < 20:
            time.sleep(0.005)
        remote.update_weights(state, 1)

    pusher = threading.Thread(target=push_when_started)
    pusher.start()
    out = asyncio.run(remote.generate(prompt, SamplingParams(temperature=1.0, max_tokens=2000, seed=1)))
    pusher.join()
    switch = out.versions.index(1)
    assert 20 <= switch < len(out.versions) and out.versions == [0] * switch + [1] * (len(out.versions) - switch)
    assert out.num_preempted == 1 and remote.stats["preemptions"] == 1
    remote.close()


def test_an_endpoint_failure_is_the_clients_diagnosis_filed_under_the_engine():
    from tether.pipeline.rollouter import failure_cause

    remote = RemoteEngine(LLMClient("http://127.0.0.1:9/v1", model="tiny", max_retries=0))
    with pytest.raises(EndpointUnreachable) as info:
        asyncio.run(remote.generate([1, 2, 3], SamplingParams(max_tokens=4)))
    assert "127.0.0.1:9" in str(info.value) and failure_cause(info.value) == "engine"
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        asyncio.run(remote.generate([], SamplingParams()))
    remote.close()


def test_a_server_without_the_update_endpoint_is_named_with_what_to_do():
    from fastapi import FastAPI

    from tether.llm import BadRequest

    with ServerThread(FastAPI()) as bare:  # answers 404 everywhere, as a server without weight updates does
        remote = RemoteEngine(LLMClient(bare.base_url + "/v1", model="tiny", max_retries=0))
        with pytest.raises(BadRequest, match=r"HTTP 404(.|\n)*no /update_weights_from_tensor endpoint(.|\n)*"
                                             r"engine.weight_sync_dir"):
            remote.update_weights({"w": torch.zeros(2)}, 1)
        assert remote.version == 0 and remote.stats["weight_updates"] == 0
        remote.close()


def test_parse_choice_reads_vllm_token_strings_and_names_what_is_missing():
    vllm = {"logprobs": {"tokens": ["token_id:5", "token_id:7"], "token_logprobs": [-0.5, -1.0]},
            "finish_reason": "stop"}
    out = parse_choice(vllm, 4, "http://h/v1/completions")
    assert (out.token_ids, out.logprobs, out.versions, out.num_preempted) == ([5, 7], [-0.5, -1.0], [4, 4], 0)
    spans = {**vllm, "token_ids": [5, 7, 9], "weight_versions": [2, 3, 3],
             "logprobs": {"token_logprobs": [-0.5, -1.0, -2.0]}, "finish_reason": "length"}
    assert parse_choice(spans, 0, "u").num_preempted == 1  # a server without num_preempted: version changes
    with pytest.raises(MalformedResponse, match="no `token_ids`.*return_token_ids"):
        parse_choice({"text": "hi", "logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}, "finish_reason": "stop"},
                     0, "u")
    with pytest.raises(MalformedResponse, match="token_logprobs` is not 2 numbers"):
        parse_choice({"token_ids": [1, 2], "logprobs": None, "finish_reason": "stop"}, 0, "u")
    with pytest.raises(MalformedResponse, match="finish_reason 'content_filter'"):
        parse_choice({**spans, "finish_reason": "content_filter"}, 0, "u")


def test_engine_type_remote_loads_and_names_the_keys_that_act_on_the_server_only():
    from tether.config import load_config

    base = ["engine.type=remote", "llm_client.base_url=http://127.0.0.1:8000/v1", "trainer.total_steps=100"]
    assert load_config([], base).engine.type == "remote"
    quiet = load_config([], base).warnings()
    for key, value in (("engine.max_batch_size", "8"), ("rollout.partial_rollout.segment_length", "2")):
        extra = [w for w in load_config([], [*base, f"{key}={value}"]).warnings() if w not in quiet]
        assert len(extra) == 1 and extra[0].startswith(f"{key} acts on the in-process engine only"), extra
    local = [w for w in load_config([], ["engine.weight_sync_dir=/tmp/w"]).warnings()
             if w.startswith("engine.weight_sync_dir")]
    assert local == ["engine.weight_sync_dir acts with engine.type remote only: the local engine takes the weights "
                     "in memory"]


# ----------------------------------------------------------------------------- training through the server

WALL_CLOCK = {"perf/step_time", "perf/samples_per_s", "perf/tokens_per_s", "perf/rollout_time", "perf/weight_sync_s",
              "perf/engine_busy_s", "perf/trainer_idle_ratio", "perf/rollouter_idle_ratio", "agent/generate_sequences",
              "perf/learner_overlap_s", "perf/learner_after_rollout_s", "rollout/group_time_s",
              "agent/tool_calls", "agent/compute_score"}


def _run(tiny_model: str, run_dir: Path, *overrides: str):
    from safetensors.torch import load_file

    from tether.config import load_config
    from tether.pipeline.trainer import train

    base = run_dir.parent / "small_run.yaml"
    base.write_text(SMALL_RUN)
    cfg = load_config([base], [f"model.path={tiny_model}", "trainer.deterministic=true", *overrides])
    train(cfg, run_dir, show_progress=False)
    rows = [{k: v for k, v in r.items() if k not in WALL_CLOCK and not k.startswith("llm/")}
            for r in read_rows(run_dir)]
    return rows, (run_dir / "samples.jsonl").read_text(), load_file(run_dir / "checkpoints/step_3/model.safetensors")


@pytest.mark.slow
def test_a_training_run_through_the_server_is_the_local_run_and_pushes_at_every_sync(serve, tiny_model, tmp_path):
    """SMALL_RUN (sync mode, 3 steps) with engine.type remote: one push at start (the server then holds the
    learner's weights whatever it was started with) and one per step, each tagged with the step's version; with a
    deterministic server and trainer.deterministic, metrics, samples and weights equal the local engine's run."""
    served = serve(deterministic=True)
    remote = _run(tiny_model, tmp_path / "remote", "engine.type=remote", f"llm_client.base_url={served.url}",
                  "llm_client.model=tiny")
    assert served.calls[TENSOR] == 1 + 3 and served.engine.version == 3
    assert served.calls[COMPLETIONS] > 0
    local = _run(tiny_model, tmp_path / "local")
    rows_r, samples_r, weights_r = remote
    rows_l, samples_l, weights_l = local
    assert [r["step"] for r in rows_r] == [0, 1, 2, 3]
    assert [r.get("rollout/current_param_version") for r in rows_r[1:]] == [1, 2, 3]
    for a, b in zip(rows_r, rows_l, strict=True):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert samples_r == samples_l
    assert all(torch.equal(weights_r[k], weights_l[k]) for k in weights_l)
    # the server now holds the trained weights (the step-3 checkpoint), which are not those it started with
    served_state, initial = served.engine.model.state_dict(), served.model.state_dict()
    assert all(torch.equal(served_state[k], weights_r[k]) for k in weights_r)
    assert not all(torch.equal(initial[k], weights_r[k]) for k in weights_r)


@pytest.mark.slow
def test_fully_async_through_the_server_syncs_every_step_and_the_trainer_validates_locally(serve, small_run):
    """fully_async, weights pushed after every step while the rollouter's requests are in flight (partial rollout
    on the server); use_trainer_do_validate evaluates the learner's weights on an in-process engine of the
    trainer's own, so pushing them never moves the rollout server off its sync schedule."""
    served = serve(partial_rollout=True, segment_length=1)
    rows, _, _ = small_run("async", "engine.type=remote", f"llm_client.base_url={served.url}",
                                 "llm_client.model=tiny", "rollout.mode=fully_async",
                                 "rollout.scheduler.max_staleness=1", "trainer.use_trainer_do_validate=true")
    assert served.calls[TENSOR] == 1 + 3 and served.engine.version == 3
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["eval/weights_step"] == 3
    # the tokens' versions came back from the server: the lag the staleness bound allows, never more
    assert all(0 <= r["rollout/policy_version_lag_max"] <= 1 for r in rows[1:])
