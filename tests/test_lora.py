"""model.lora: the learner trains a low-rank adapter on the frozen tiny model (tether.learner.lora).

What is checked, with numbers: only the adapter is trained and held by AdamW; the KL reference (the adapter off) is the
base model's logits exactly; what a sync sends (the adapter, or the merged weights) reproduces the policy's logits; a
checkpoint is peft's format (``PeftModel.from_pretrained`` gives the trained logits) and resumes; ``tether export
--merge`` writes a plain model with the same logits; every key of the section changes the update; the combinations not
built are refused at load, naming the key.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from conftest import learner_args, random_trajectories
from tether.config import ConfigError, RunConfig, load_config
from tether.learner import load_model_and_tokenizer, lora
from tether.learner.checkpoint import load_checkpoint, save_checkpoint
from tether.learner.learner import Learner
from tether.learner.pool import LearnerSpec
from tether.learner.sft import sft
from tether.pipeline.weights import WeightSync

torch.set_num_threads(1)

TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the default
TARGETS = len(TARGET_NAMES)  # adapted layers of the tiny model's one layer


def learner_cfg(*lora_sets: str) -> RunConfig:
    """Every term on (a correction, entropy, KL k3), and ``model.lora`` with ``lora_sets`` (``key=value``)."""
    return load_config([], [
        "model.lora.rank=4", *lora_sets, "learner.batch_size=8", "learner.mini_batch_size=4",
        "learner.gradient_accumulation_steps=2", "policy_optimization.advantage.group_size=4",
        "policy_optimization.exploration.entropy_coef=0.01", "policy_optimization.kl_control.type=relative_entropy",
        "policy_optimization.kl_control.init_coef=0.05", "policy_optimization.kl_control.estimator=k3",
        "policy_optimization.optimizer.lr=1e-2", "policy_optimization.optimizer.warmup_steps=0"])


def build(tiny_model: str, cfg: RunConfig) -> Learner:
    """The run's learner as ``Run.build`` builds it (``LearnerSpec.build``: the model wrapped with the adapter)."""
    model, _ = load_model_and_tokenizer(tiny_model)
    args = learner_args(cfg)
    spec = LearnerSpec(cfg.learner, cfg.policy_optimization, cfg.actor_worker, temperature=args["temperature"],
                       max_response_tokens=args["max_response_tokens"], lora=cfg.model.lora)
    learner = spec.build(model)
    assert isinstance(learner, Learner)
    return learner


def trained(tiny_model: str, *lora_sets: str, seed: int = 0) -> Learner:
    torch.manual_seed(seed)
    learner = build(tiny_model, learner_cfg(*lora_sets))
    trajs = random_trajectories(learner.model.config.vocab_size, 8, 0, prompt_len=5, head=6, gap=3, min_logp=5.0)
    learner.train_step(trajs, [1.0, -1.0, 0.5, -0.5, 0.8, -0.2, -0.3, 0.1])
    return learner


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.arange(3, 40).reshape(1, -1)  # [1, 37] token ids, any


def test_only_the_adapter_trains_and_adamw_holds_it_alone(tiny_model):
    base, _ = load_model_and_tokenizer(tiny_model)
    learner = trained(tiny_model)
    names = {id(p): n for n, p in learner.model.named_parameters()}
    held = [names[id(p)] for p in learner.optimizer.params]
    assert len(held) == 2 * TARGETS and all(".lora_A." in n or ".lora_B." in n for n in held), held
    assert len(learner.optimizer.optimizer.state) == 2 * TARGETS  # AdamW moments for the adapter only
    assert learner.ref_model is None  # no second model: the reference is the adapter switched off
    # the base is bit for bit the loaded model after an update; B moved off its zero start
    merged = learner.state_dict_for_engine()
    for key, value in base.state_dict().items():
        peft_key = next(k for k in learner.model.state_dict() if k.removeprefix("base_model.model.")
                        .replace(".base_layer.", ".") == key)
        assert torch.equal(learner.model.state_dict()[peft_key], value), key
        adapted = key.endswith(".weight") and any(f".{t}." in key for t in TARGET_NAMES)
        assert torch.equal(merged[key], value) != adapted, key
    adapter = learner.adapter_for_engine()
    assert len(adapter) == 2 * TARGETS
    assert all(adapter[k].abs().max() > 0 for k in adapter if k.endswith("lora_B"))


def test_the_reference_is_the_base_models_logits_exactly(tiny_model):
    base, _ = load_model_and_tokenizer(tiny_model)
    learner = trained(tiny_model)
    learner.model.train()
    with learner.reference() as ref:
        assert ref is learner.model and not ref.training  # the same model, in eval mode, for the block
        assert torch.equal(logits(ref, IDS), logits(base, IDS))
    assert learner.model.training  # restored
    assert (logits(learner.model, IDS) - logits(base, IDS)).abs().max() > 1e-4  # the adapter is on again


def test_what_a_sync_sends_reproduces_the_policy(tiny_model):
    """The adapter (A, B, alpha / rank), applied as an engine does, and the merged weights give the policy's logits."""
    base, _ = load_model_and_tokenizer(tiny_model)
    learner = trained(tiny_model, "model.lora.alpha=12")
    s = learner.lora_scaling
    assert s == 12 / 4
    adapter = learner.adapter_for_engine()
    a = adapter["model.layers.0.self_attn.q_proj.lora_A"]
    b = adapter["model.layers.0.self_attn.q_proj.lora_B"]
    assert a.shape == (4, 32) and b.shape == (32, 4)  # [r, in], [out, r]: the tiny model is 32 wide
    by_hand = copy.deepcopy(base)
    state = by_hand.state_dict()
    with torch.no_grad():
        for name in {k.rsplit(".", 1)[0] for k in adapter}:
            state[f"{name}.weight"] += s * adapter[f"{name}.lora_B"] @ adapter[f"{name}.lora_A"]
    policy = logits(learner.model.eval(), IDS)
    assert (logits(by_hand, IDS) - policy).abs().max() <= 1e-5
    merged = copy.deepcopy(base)
    merged.load_state_dict(learner.state_dict_for_engine())
    assert (logits(merged, IDS) - policy).abs().max() <= 1e-5
    # in bfloat16 a sync is half the bytes
    assert sum(t.numel() * 2 for t in adapter.values()) == sum(
        t.nbytes for t in learner.adapter_for_engine(torch.bfloat16).values())


class AdapterEngine:
    def __init__(self):
        self.calls = []

    def update_adapter(self, adapter, scaling, version):
        self.calls.append((adapter, scaling, version))


def test_weight_sync_pushes_the_adapter_alone_and_records_its_bytes(tiny_model, metrics):
    learner = trained(tiny_model)
    engine = AdapterEngine()
    WeightSync(engine, learner, 1, start_step=3).push()
    (adapter, scaling, version), = engine.calls
    assert version == 3 and scaling == learner.lora_scaling == 32 / 4  # alpha (default) / rank
    assert adapter.keys() == learner.adapter_for_engine().keys()
    mb = metrics.flush(0)["perf/weight_sync_mb"]
    full = sum(t.nbytes for t in learner.state_dict_for_engine().values()) / 2**20
    assert mb == pytest.approx(sum(t.nbytes for t in adapter.values()) / 2**20)
    assert mb < full / 5, (mb, full)


def test_a_checkpoint_is_peft_format_and_resumes(tiny_model, tmp_path):
    learner = trained(tiny_model)
    path = save_checkpoint(tmp_path / "step_1", learner, None, {"step": 1})
    assert (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()
    assert not (path / "config.json").exists()  # no whole model: from_pretrained(path) is not taken for one
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(path)).eval()
    assert (logits(peft, IDS) - logits(learner.model.eval(), IDS)).abs().max() <= 1e-6
    # resume: a fresh learner on the base gets the adapter, the AdamW moments and the version back
    fresh = build(tiny_model, learner_cfg())
    assert load_checkpoint(path, fresh) == {"step": 1}
    assert fresh.version == learner.version == 1
    for (k, v), (k2, v2) in zip(learner.adapter_for_engine().items(), fresh.adapter_for_engine().items()):
        assert k == k2 and torch.equal(v, v2)
    s1, s2 = learner.optimizer.optimizer.state_dict(), fresh.optimizer.optimizer.state_dict()
    assert all(torch.equal(s1["state"][i]["exp_avg"], s2["state"][i]["exp_avg"]) for i in s1["state"])


def test_export_merge_writes_a_plain_model_with_the_peft_logits(tiny_model, tmp_path):
    from tether.cli import app

    learner = trained(tiny_model)
    _, tokenizer = load_model_and_tokenizer(tiny_model)
    ckpt = save_checkpoint(tmp_path / "step_1", learner, tokenizer, {"step": 1})
    result = CliRunner().invoke(app, ["export", str(ckpt), "--merge", "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not hasattr(plain, "peft_config") and not (tmp_path / "merged" / "adapter_config.json").exists()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(ckpt)).eval()
    assert (logits(plain, IDS) - logits(peft, IDS)).abs().max() <= 1e-5
    # tether eval / serve's loader reads the checkpoint itself as the same merged model
    loaded, _ = load_model_and_tokenizer(ckpt)
    assert (logits(loaded, IDS) - logits(plain, IDS)).abs().max() <= 1e-6
    refused = CliRunner().invoke(app, ["export", tiny_model, "--merge", "--out", str(tmp_path / "x")])
    assert refused.exit_code == 2 and "not a LoRA checkpoint" in refused.output


@pytest.mark.parametrize("key,a,b", [
    ("rank", "4", "8"),
    ("alpha", "16", "64"),
    ("dropout", "0.0", "0.3"),
    ("target_modules", "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]", "[q_proj,v_proj]"),
])
def test_every_key_of_model_lora_changes_the_update(tiny_model, key, a, b):
    """One step from the same seed and batch: the weights the engine gets after it differ when the key does."""
    base, _ = load_model_and_tokenizer(tiny_model)
    wa = trained(tiny_model, f"model.lora.{key}={a}").state_dict_for_engine()
    wb = trained(tiny_model, f"model.lora.{key}={b}").state_dict_for_engine()
    moved_a = max((wa[k] - base.state_dict()[k]).abs().max().item() for k in wa)
    moved_b = max((wb[k] - base.state_dict()[k]).abs().max().item() for k in wb)
    assert moved_a > 1e-6 and moved_b > 1e-6  # both trained
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert diff > 1e-6, (key, diff)


@pytest.mark.parametrize("other", ["engine.weight_sync_dir=/tmp/w"])
def test_the_combinations_not_built_are_refused_naming_the_key(other):
    key, value = other.split("=")
    with pytest.raises(ConfigError) as e:
        load_config([], ["model.lora.rank=8", other])
    assert f"`model.lora.rank` = 8 (--set), `{key}` = '{value}' (--set)" in str(e.value), str(e.value)
    load_config([], [other])  # without model.lora it loads


def test_off_by_default_and_a_run_with_it_trains_the_adapter(small_run):
    assert RunConfig().model.lora is None
    rows, _, run_dir = small_run("lora", "model.lora.rank=8", "trainer.total_steps=2", "trainer.save_every=2")
    assert len(rows) >= 2 and all(r["optim/grad_norm"] > 0 for r in rows[1:] if "optim/grad_norm" in r)
    ckpt = run_dir / "checkpoints" / "step_2"
    assert (ckpt / "adapter_model.safetensors").is_file()
    synced = [r["perf/weight_sync_mb"] for r in rows if "perf/weight_sync_mb" in r]
    assert synced, "no weight sync recorded"
    # the engine serves the policy the learner trains: the tokens of the last sync scored by the learner agree
    assert rows[-1]["rollout/logp_abs_diff_mean"] < 1e-5  # measured: 1.6e-7 (fp32 rounding)
    from safetensors.torch import load_file

    weights = load_file(ckpt / "adapter_model.safetensors")
    b = [v for k, v in weights.items() if "lora_B" in k]
    assert len(b) == TARGETS and all(v.abs().max() > 0 for v in b)  # B left its zero start: the adapter trained
    # a sync moves the adapter alone (what the checkpoint holds: 16 KiB here), not the merged weights (0.54 MiB)
    assert synced[-1] == pytest.approx(sum(v.nbytes for v in weights.values()) / 2**20)


def test_sft_with_lora_trains_the_adapter_and_leaves_the_base(tiny_model):
    """``tether sft`` with model.lora: the adapter alone is trained (then merged into the weights it writes)."""
    model, _ = load_model_and_tokenizer(tiny_model)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft = lora.wrap(model, learner_cfg().model.lora)
    trajs = random_trajectories(model.config.vocab_size, 8, 0, prompt_len=5, head=6, gap=3)
    losses = sft(peft, trajs, pad_id=0, epochs=2, lr=1e-2, batch_size=4, warmup=1)
    assert losses[1] < losses[0]
    merged = peft.merge_and_unload()
    moved = {k for k, v in merged.state_dict().items() if not torch.equal(v, base[k])}
    assert moved and all(k.endswith(".weight") and any(f".{t}." in k for t in TARGET_NAMES) for k in moved), moved


def test_a_lora_run_resumes_to_the_same_adapter(small_run, tiny_model, tmp_path):
    """Step 2 again from step 1's checkpoint (adapter, AdamW moments, RNG): the same adapter as straight on."""
    import shutil

    from safetensors.torch import load_file

    from tether.config import load_config
    from tether.pipeline.trainer import train

    sets = ("model.lora.rank=8", "trainer.total_steps=2", "trainer.save_every=1", "trainer.deterministic=true")
    _, _, run_dir = small_run("straight", *sets)
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_2")
    assert lora.base_of(run_dir / "checkpoints" / "step_1") == tiny_model  # the adapter names its base
    cfg = load_config([tmp_path / "small_run.yaml"], [f"model.path={tiny_model}", *sets])
    train(cfg, resumed, resume=True, show_progress=False)
    a = load_file(run_dir / "checkpoints" / "step_2" / "adapter_model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_2" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert max((a[k] - load_file(run_dir / "checkpoints" / "step_1" / "adapter_model.safetensors")[k]).abs().max()
               .item() for k in a) > 1e-6  # step 2 moved the adapter
