"""Checkpoints: HF folder + trainer state round trip, atomic saves, latest_checkpoint, RNG, no secrets."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_learner
from tether.config import RunConfig, Secret
from tether.learner import build_tiny, load_model_and_tokenizer
from tether.learner.checkpoint import (
    STATE_FILE,
    CorruptCheckpoint,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    resumable_checkpoint,
    save_checkpoint,
)
from tether.types import Trajectory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2, hidden_size=64,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    return load_model_and_tokenizer(path)


CFG = RunConfig.model_validate({
    "learner": {"batch_size": 4, "mini_batch_size": 2, "gradient_accumulation_steps": 1, "update_frequency": 1},
    "policy_optimization": {"advantage": {"group_size": 2}, "optimizer": {"lr": 1e-3, "warmup_steps": 3}},
})


def batch(seed: int) -> tuple[list[Trajectory], list[float]]:
    rng = random.Random(seed)
    trajs = []
    for i in range(4):
        n = rng.randint(2, 6)
        trajs.append(Trajectory(f"t{i}", prompt_ids=[rng.randrange(512) for _ in range(3)],
                                response_ids=[rng.randrange(512) for _ in range(n)], response_mask=[1] * n,
                                logprobs=[-6.0] * n, versions=[0] * n))
    return trajs, [1.0, -1.0, 0.5, -0.5]


def test_round_trip_resumes_exactly(tiny, tmp_path):
    model, tokenizer = tiny
    a = make_learner(copy.deepcopy(model), CFG)
    a.train_step(*batch(0))
    a.kl_coef = 0.02  # as an adaptive controller would leave it
    path = save_checkpoint(checkpoint_dir(tmp_path, 1), a, tokenizer, {"cursor": 4, "seen": ["t0", "t1"]})
    assert path == tmp_path / "checkpoints" / "step_1"

    b = make_learner(copy.deepcopy(model), CFG)  # fresh, from the initial model (also the KL reference)
    extra = load_checkpoint(path, b)
    assert extra == {"cursor": 4, "seen": ["t0", "t1"]}
    assert (b.version, b.kl_coef, b.optimizer.num_updates, b.optimizer.lr) == (1, 0.02, 2, a.optimizer.lr)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict()["optimizer"], b.optimizer.state_dict()["optimizer"]
    assert sa["param_groups"] == sb["param_groups"]
    for k, state in sa["state"].items():
        assert all(torch.equal(v, sb["state"][k][n]) for n, v in state.items())

    ma, mb = a.train_step(*batch(1)), b.train_step(*batch(1))  # the same next update
    assert ma["optim/loss"] == mb["optim/loss"] and ma["optim/lr"] == mb["optim/lr"]
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name


def test_folder_is_a_hugging_face_model(tiny, tmp_path):
    model, tokenizer = tiny
    learner = make_learner(copy.deepcopy(model), CFG)
    learner.train_step(*batch(0))
    path = save_checkpoint(tmp_path / "ckpt", learner, tokenizer, {})
    assert (path / "generation_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    for (name, p), q in zip(learner.model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tok("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]
    assert tok.chat_template == tokenizer.chat_template


def test_latest_checkpoint_ignores_incomplete_folders(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    learner = make_learner(copy.deepcopy(model), CFG)
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(checkpoint_dir(tmp_path, 1), learner, tokenizer, {})
    save_checkpoint(checkpoint_dir(tmp_path, 3), learner, tokenizer, {})
    root = tmp_path / "checkpoints"
    (root / ".tmp-step_9-deadbeef").mkdir()  # a save killed mid-way
    (root / ".tmp-step_9-deadbeef" / "config.json").write_text("{}")
    (root / "step_10").mkdir()  # not written by save_checkpoint: no trainer state
    (root / "step_10" / "config.json").write_text("{}")
    (root / "step_11.bak").mkdir()
    assert latest_checkpoint(tmp_path) == root / "step_3"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)  # the trainer state is written last
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(checkpoint_dir(tmp_path, 12), learner, tokenizer, {})
    assert not (root / "step_12").exists()
    assert sorted(p.name for p in root.glob(".tmp-step_12*")) == []  # cleaned up
    assert latest_checkpoint(tmp_path) == root / "step_3"


@pytest.mark.parametrize("damaged", [STATE_FILE, "model.safetensors"])
def test_a_truncated_checkpoint_is_refused_naming_the_complete_one_before_it(tiny, tmp_path, damaged):
    model, tokenizer = tiny
    learner = make_learner(copy.deepcopy(model), CFG)
    for step in (1, 2, 3):
        save_checkpoint(checkpoint_dir(tmp_path, step), learner, tokenizer, {})
    root = tmp_path / "checkpoints"
    for step in (2, 3):  # the latest and the one before it cut short: step_1 is the one to fall back to
        torn = root / f"step_{step}" / damaged
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    assert latest_checkpoint(tmp_path) == root / "step_3"  # complete by its files' names, not by their contents
    with pytest.raises(CorruptCheckpoint, match=rf"{root / 'step_3'} is corrupt: {root / 'step_3' / damaged} .*; "
                                                rf"the complete checkpoint before it is {root / 'step_1'}: "):
        resumable_checkpoint(tmp_path)  # the files' structure: no read of the data
    with pytest.raises(CorruptCheckpoint, match=rf"the complete checkpoint before it is {root / 'step_1'}: .*mv "):
        load_checkpoint(root / "step_3", learner)  # loading says the same
    assert resumable_checkpoint(tmp_path / "no-run") is None


def test_resave_replaces_and_rng_is_restored(tiny, tmp_path):
    model, tokenizer = tiny
    learner = make_learner(copy.deepcopy(model), CFG)
    path = checkpoint_dir(tmp_path, 2)
    save_checkpoint(path, learner, tokenizer, {"cursor": 1})
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    save_checkpoint(path, learner, tokenizer, {"cursor": 2})
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    assert load_checkpoint(path, learner) == {"cursor": 2}
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]


def test_refuses_secrets_and_objects_in_extra(tiny, tmp_path):
    model, tokenizer = tiny
    learner = make_learner(copy.deepcopy(model), CFG)
    with pytest.raises(TypeError, match=r"extra\['client'\]\['api_key'\] is a Secret"):
        save_checkpoint(tmp_path / "c", learner, tokenizer, {"client": {"api_key": Secret("sk-live")}})
    assert not (tmp_path / "c").exists()
    with pytest.raises(FileNotFoundError, match=STATE_FILE):
        load_checkpoint(tmp_path, learner)
