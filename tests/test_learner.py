"""Learner: batch layout by hand, micro-batch invariance, on-policy ratios, the non-finite guard, warm-up, clipping."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import pytest
import torch

from conftest import make_learner
from tether.config import RunConfig
from tether.learner import build_tiny, load_model_and_tokenizer
from tether.learner.batch import TrainBatch
from tether.learner.learner import Learner
from tether.learner.optim import PolicyOptimizer
from tether.types import Trajectory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2, hidden_size=64,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model, _ = load_model_and_tokenizer(path)
    return model


def make_cfg(batch=8, mini=8, accum=1, epochs=1, lr=1e-3, warmup=0, max_grad_norm=1.0, kl="relative_entropy",
             temperature=1.0, entropy_coef=0.01, correction="none", tis=False, adaptive=False,
             max_kl=10.0, target_kl=0.01, horizon=10_000, algorithm="grpo_variant") -> RunConfig:
    return RunConfig.model_validate({
        "engine": {"temperature": temperature},
        "learner": {"batch_size": batch, "mini_batch_size": mini, "gradient_accumulation_steps": accum,
                    "update_frequency": epochs,
                    "off_policy_correction": {"method": correction, "tis_enabled": tis}},
        "policy_optimization": {
            "algorithm": algorithm,
            "advantage": {"group_size": 4},
            "exploration": {"entropy_coef": entropy_coef},
            "kl_control": {"type": kl, "init_coef": 0.05, "adaptive": adaptive, "max_kl": max_kl,
                           "target_kl": target_kl, "horizon": horizon},
            "optimizer": {"lr": lr, "warmup_steps": warmup, "max_grad_norm": max_grad_norm, "weight_decay": 0.01},
        },
    })


def make_trajectories(n: int, seed: int = 0, vocab: int = 512) -> list[Trajectory]:
    """Varied lengths, tool tokens (mask 0) in the middle of the response, one trajectory fully masked."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
        mask: list[int] = []
        for _ in range(rng.randint(1, 3)):  # turns: model tokens, then a tool response
            mask += [1] * rng.randint(1, 4) + [0] * rng.randint(0, 3)
        if i == 3:
            mask = [0] * len(mask)  # e.g. dropped by an overlong filter
        response = [rng.randrange(vocab) for _ in mask]
        logprobs = [-rng.uniform(4.0, 8.0) if m else 0.0 for m in mask]
        out.append(Trajectory(task_id=f"t{i}", prompt_ids=prompt, response_ids=response, response_mask=mask,
                              logprobs=logprobs, versions=[0 if m else -1 for m in mask]))
    return out


def advantages(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed + 100)
    return [rng.gauss(0.0, 1.0) for _ in range(n)]


def spy_grads(learner: Learner) -> list[dict[str, torch.Tensor]]:
    """Record every parameter's gradient just before each optimizer update (pre-clip)."""
    seen: list[dict[str, torch.Tensor]] = []
    update = learner.optimizer.update

    def spy(**kwargs):
        seen.append({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})
        return update(**kwargs)

    learner.optimizer.update = spy
    return seen


# ---------------------------------------------------------------------------------------------- batch


def test_train_batch_aligns_mask_and_logprobs_with_tokens():
    a = Trajectory("a", prompt_ids=[5, 6, 7], response_ids=[10, 11, 20, 21, 12], response_mask=[1, 1, 0, 0, 1],
                   logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3], versions=[0, 0, -1, -1, 1])
    b = Trajectory("b", prompt_ids=[8, 9], response_ids=[13, 22, 14], response_mask=[1, 0, 1],
                   logprobs=[-0.5, 0.0, -0.6], versions=[0, -1, 0])
    batch = TrainBatch.from_trajectories([a, b], [1.5, -0.5], pad_id=0)
    # position:       0  1  2   3   4   5   6   7
    # a: prompt 5 6 7 | model 10 11 | tool 20 21 | model 12
    # b: prompt 8 9   | model 13 | tool 22 | model 14 | pad pad pad
    assert batch.input_ids.tolist() == [[5, 6, 7, 10, 11, 20, 21, 12], [8, 9, 13, 22, 14, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1], [0, 0, 1, 0, 1, 0, 0, 0]]
    assert torch.allclose(batch.old_logp, torch.tensor([[0, 0, 0, -0.1, -0.2, 0, 0, -0.3],
                                                        [0, 0, -0.5, 0, -0.6, 0, 0, 0]]))
    assert batch.advantages.tolist() == [1.5, -0.5]
    assert (batch.num_tokens, batch.num_loss_tokens) == (13, 5)

    first, second = batch.split(2)  # each padded only to its own longest row
    assert first.input_ids.shape == (1, 8) and second.input_ids.shape == (1, 5)
    assert second.loss_mask.tolist() == [[0, 0, 1, 0, 1]] and second.advantages.tolist() == [-0.5]
    with pytest.raises(ValueError, match="non-empty parts"):
        batch.split(3)
    with pytest.raises(ValueError, match="advantages"):
        TrainBatch.from_trajectories([a, b], [1.0], pad_id=0)


# ---------------------------------------------------------------------------------------------- totals


def test_describe_and_batch_size_contract(base_model):
    cfg = RunConfig.model_validate({"learner": {"batch_size": 64, "mini_batch_size": 8,
                                                "gradient_accumulation_steps": 2, "update_frequency": 1}})
    learner = make_learner(copy.deepcopy(base_model), cfg)
    # micro = 8 / 2 = 4 trajectories; 64 / 8 = 8 optimizer updates per pass
    assert learner.describe() == "batch 64 traj/step = 8 updates × (2 micro × 4 traj), 1 epoch"
    # fewer trajectories than batch_size (groups dropped by the filter): ceil(8 / 8) = 1 update
    seen = spy_grads(learner)
    learner.train_step(make_trajectories(8), advantages(8))
    assert len(seen) == 1 and learner.optimizer.num_updates == 1
    with pytest.raises(ValueError, match="no trajectories"):
        learner.train_step([], [])

    two = make_learner(copy.deepcopy(base_model), make_cfg(batch=8, mini=4, accum=2, epochs=2, kl="none"))
    assert two.describe() == ("batch 8 traj/step = 2 updates × (2 micro × 2 traj), 2 epochs "
                              "→ 4 optimizer updates/step")
    seen = spy_grads(two)
    two.train_step(make_trajectories(8), advantages(8))
    assert len(seen) == 4 and two.optimizer.num_updates == 4 and two.version == 1


# ---------------------------------------------------------------------------------------------- invariance


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gradient_accumulation_is_invariant(base_model, mode):
    trajs, adv = make_trajectories(8), advantages(8)
    results = {}
    for accum in (1, 2, 4):
        # A small lr keeps Adam's near-sign update of a ~1e-9 gradient from amplifying rounding differences.
        learner = make_learner(copy.deepcopy(base_model), make_cfg(accum=accum, lr=1e-5))
        learner.objective = dataclasses.replace(learner.objective, agg_mode=mode)
        seen = spy_grads(learner)
        metrics = learner.train_step(trajs, adv)
        results[accum] = (seen[0], dict(learner.model.named_parameters()), metrics)
    grads1, params1, m1 = results[1]
    assert any(g.abs().sum() > 0 for g in grads1.values())
    for accum in (2, 4):
        grads, params, m = results[accum]
        assert grads.keys() == grads1.keys()
        for name in grads1:
            torch.testing.assert_close(grads[name], grads1[name], atol=1e-6, rtol=0, msg=f"{mode} {accum} {name}")
        for name in params1:
            torch.testing.assert_close(params[name], params1[name], atol=1e-6, rtol=0)
        assert m["optim/loss"] == pytest.approx(m1["optim/loss"], abs=1e-6)
        assert m["optim/grad_norm"] == pytest.approx(m1["optim/grad_norm"], rel=1e-5)
        assert m["optim/entropy"] == pytest.approx(m1["optim/entropy"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- on-policy


def test_on_policy_first_update_has_unit_ratio_and_zero_kl(base_model):
    temperature = 0.7
    trajs = make_trajectories(8, seed=1)
    model = copy.deepcopy(base_model)
    with torch.no_grad():  # behaviour logprobs as the engine defines them: log_softmax(logits / T), one row at a time
        for t in trajs:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1] / temperature, dim=-1)  # [n-1, V]
            picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(t.prompt_ids) - 1:]  # [R]
            t.logprobs = [float(lp) if m else 0.0 for lp, m in zip(picked, t.response_mask)]
    learner = make_learner(model, make_cfg(accum=2, temperature=temperature))
    gaps = []
    loss_fn = learner.objective.policy_loss

    def spy(logp, old_logp, adv, mask, **kw):
        gaps.append(((logp - old_logp).abs() * mask).max().item())
        return loss_fn(logp, old_logp, adv, mask, **kw)

    learner.objective = dataclasses.replace(learner.objective, policy_loss=spy)
    m = learner.train_step(trajs, advantages(8))
    assert max(gaps) < 1e-5  # ratio = 1 up to float rounding of a differently padded batch
    assert m["optim/clip_ratio_low"] == 0.0 and m["optim/clip_ratio_high"] == 0.0
    assert m["optim/kl_divergence"] == 0.0  # policy == reference before the first update (k3 of log r = 0)
    assert m["optim/kl_coef"] == 0.05


def test_kl_off_has_no_reference(base_model):
    learner = make_learner(copy.deepcopy(base_model), make_cfg(kl="none"))
    assert learner.ref_model is None and learner.kl_coef == 0.0
    m = learner.train_step(make_trajectories(8), advantages(8))
    assert "optim/kl_divergence" not in m and m["optim/kl_coef"] == 0.0


# ---------------------------------------------------------------------------------------------- updates


def test_step_changes_parameters_and_non_finite_is_skipped(base_model):
    learner = make_learner(copy.deepcopy(base_model), make_cfg(mini=4))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    pushed = learner.state_dict_for_engine()
    m = learner.train_step(make_trajectories(8), advantages(8))
    assert m["optim/skipped_steps"] == 0 and learner.optimizer.num_updates == 2 and learner.version == 1
    assert any(not torch.equal(p, before[n]) for n, p in learner.model.named_parameters())
    assert all(torch.equal(pushed[n], before[n]) for n in before)  # the pushed copy did not move with training
    assert all(math.isfinite(v) for v in m.values())

    def snapshot():
        return ({n: p.detach().clone() for n, p in learner.model.named_parameters()},
                copy.deepcopy(learner.optimizer.state_dict()))

    # A NaN advantage makes the first mini-batch's loss NaN: that update is skipped, the second one applies.
    bad = advantages(8)
    bad[0] = math.nan
    m = learner.train_step(make_trajectories(8), bad)
    assert m["optim/skipped_steps"] == 1 and learner.optimizer.num_updates == 3
    assert math.isnan(m["optim/loss"]) and math.isfinite(m["optim/grad_norm"])

    # Every update non-finite (inf logits injected): parameters and optimizer state stay bit-identical.
    params, opt_state = snapshot()
    hook = learner.model.get_output_embeddings().register_forward_hook(
        lambda mod, inp, out: out.index_fill(-1, torch.tensor([0]), math.inf))
    try:
        m = learner.train_step(make_trajectories(8), advantages(8))
    finally:
        hook.remove()
    assert m["optim/skipped_steps"] == 3 and learner.optimizer.num_updates == 3
    assert math.isnan(m["optim/grad_norm"])
    assert all(torch.equal(p, params[n]) for n, p in learner.model.named_parameters())
    new_state = learner.optimizer.state_dict()
    assert new_state["scheduler"] == opt_state["scheduler"]
    for k, s in opt_state["optimizer"]["state"].items():
        assert all(torch.equal(v, new_state["optimizer"]["state"][k][name]) for name, v in s.items())
    assert all(p.grad is None for p in learner.model.parameters())


def test_linear_warmup_hand_values():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = PolicyOptimizer([p], lr=0.1, warmup_steps=4, max_grad_norm=10.0)
    lrs = []
    for k in range(7):
        p.grad = torch.tensor([1.0, -1.0])
        finite = k != 2  # the third call is skipped: it does not advance the schedule
        r = opt.update(loss_is_finite=finite)
        assert r.applied == finite
        lrs.append(round(r.lr, 10))
    # update k uses 0.1 · min(1, k / 4): 1 → 0.025, 2 → 0.05, (skip) , 3 → 0.075, 4 → 0.1, then constant
    assert lrs == [0.025, 0.05, 0.075, 0.075, 0.1, 0.1, 0.1]
    assert (opt.num_updates, opt.skipped_steps) == (6, 1)

    const = PolicyOptimizer([torch.nn.Parameter(torch.zeros(1))], lr=0.1, warmup_steps=0)
    assert const.lr == 0.1


@pytest.mark.parametrize("scheduler,expected", [
    # W = 2, D = 6, m = 0.2: p = (k - 3) / 3 for updates 3..6, then flat at 0.1 · 0.2
    ("cosine", [0.05, 0.1, 0.1, 0.1, 0.08, 0.04, 0.02, 0.02]),   # 0.1 · (0.2 + 0.8 · ½(1 + cos πp)): 1, 0.75, 0.25, 0
    ("linear", [0.05, 0.1, 0.1, 0.1, 0.07333333333, 0.04666666667, 0.02, 0.02]),  # 0.1 · (0.2 + 0.8 (1 - p))
])
def test_decay_hand_values(scheduler, expected):
    p = torch.nn.Parameter(torch.zeros(2))
    opt = PolicyOptimizer([p], lr=0.1, warmup_steps=2, max_grad_norm=10.0, lr_scheduler=scheduler, decay_steps=6,
                          min_lr_ratio=0.2)
    lrs = []
    for k in range(8):
        p.grad = torch.tensor([1.0, -1.0])
        r = opt.update(loss_is_finite=k != 2)  # the third call is skipped: the schedule waits for it
        lrs.append(round(r.lr, 11))
    assert lrs == pytest.approx(expected, abs=1e-10)
    with pytest.raises(ValueError, match="decay_steps"):
        PolicyOptimizer([p], lr=0.1, lr_scheduler=scheduler)


def test_learner_reports_warmup_lr(base_model):
    learner = make_learner(copy.deepcopy(base_model), make_cfg(mini=2, lr=1e-3, warmup=8, kl="none"))
    m = learner.train_step(make_trajectories(8), advantages(8))
    assert m["optim/lr"] == pytest.approx(1e-3 * 4 / 8)  # 4 updates; the 4th used lr · 4/8
    m = learner.train_step(make_trajectories(8, seed=2), advantages(8, seed=2))
    assert m["optim/lr"] == pytest.approx(1e-3)


def test_grad_clipping_reports_pre_clip_norm():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = PolicyOptimizer([p], lr=0.1, max_grad_norm=1.0)
    clipped = []
    opt.optimizer.register_step_pre_hook(lambda *_: clipped.append(p.grad.clone()))
    p.grad = torch.tensor([3.0, 4.0])
    r = opt.update()
    assert r.grad_norm == pytest.approx(5.0)  # ‖(3, 4)‖ before clipping
    torch.testing.assert_close(clipped[0], torch.tensor([0.6, 0.8]), atol=1e-6, rtol=0)  # scaled by 1/5
    assert clipped[0].norm() <= 1.0


def test_learner_grad_norm_is_pre_clip(base_model):
    learner = make_learner(copy.deepcopy(base_model), make_cfg(max_grad_norm=1e-3))
    seen = spy_grads(learner)
    post = []
    learner.optimizer.optimizer.register_step_pre_hook(lambda *_: post.append(torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in learner.optimizer.params if p.grad is not None]))))
    m = learner.train_step(make_trajectories(8), advantages(8))
    pre = torch.linalg.vector_norm(torch.stack([g.norm() for g in seen[0].values()]))
    assert m["optim/grad_norm"] == pytest.approx(float(pre), rel=1e-5) and float(pre) > 1e-3
    assert float(post[0]) <= 1e-3 * (1 + 1e-5)
