"""The learner's objective from the config: off-policy correction against π_prox, adaptive KL, the max-KL guard."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import make_learner
from test_learner import advantages, base_model, make_cfg, make_trajectories  # noqa: F401 — fixture
from tether.algo import aggregate
from tether.config.plan import Plan
from tether.learner import loss as loss_module
from tether.learner.objective import Objective

torch.set_num_threads(1)


def own_logprobs(model, trajs, temperature=1.0):
    """Behaviour logprobs as the engine would record them for ``model`` (on-policy)."""
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1] / temperature, dim=-1)
            picked = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(t.prompt_ids) - 1:]
            t.logprobs = [float(lp) if m else 0.0 for lp, m in zip(picked, t.response_mask)]
    return trajs


def params_after_one_step(model, cfg, trajs):
    learner = make_learner(copy.deepcopy(model), cfg)
    metrics = learner.train_step(trajs, advantages(len(trajs)))
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}, metrics


@pytest.mark.parametrize("method", ["double_sided_importance_sampling", "truncated_importance_sampling",
                                    "decoupled_ppo"])
def test_correction_on_policy_is_plain_grpo(base_model, method):
    # behaviour = the learner's own policy: every weight is ρ = 1 (up to float noise), nothing masked, and the
    # update equals the uncorrected one
    trajs = own_logprobs(base_model, make_trajectories(8, seed=2))
    plain, _ = params_after_one_step(base_model, make_cfg(), copy.deepcopy(trajs))
    corrected, m = params_after_one_step(base_model, make_cfg(correction=method, tis=True), copy.deepcopy(trajs))
    assert abs(m["optim/is_ratio_mean"] - 1.0) < 1e-5 and m["optim/is_masked_fraction"] == 0.0
    # Adam's first step is ≈ lr·g/|g| per weight: float noise in tiny gradients moves a weight by a fraction of lr
    assert max((plain[n] - corrected[n]).abs().max().item() for n in plain) < 1e-2 * 1e-3


def test_double_sided_masks_exactly_the_tokens_outside_the_band(base_model):
    # stale behaviour: on every other model token log π_behav = log π_prox + 0.5, so ρ = e^-0.5 = 0.607 < 0.8
    trajs = own_logprobs(base_model, make_trajectories(8, seed=3))
    shifted = total = 0
    for t in trajs:
        k = 0
        for i, m in enumerate(t.response_mask):
            if m:
                total += 1
                if k % 2 == 0:
                    t.logprobs[i] += 0.5
                    shifted += 1
                k += 1
    learner = make_learner(copy.deepcopy(base_model), make_cfg(correction="double_sided_importance_sampling"))
    m = learner.train_step(trajs, advantages(8))
    assert m["optim/is_masked_fraction"] == pytest.approx(shifted / total, abs=1e-6)
    # ρ mean over the model tokens: (shifted · e^-0.5 + (total − shifted) · 1) / total
    assert m["optim/is_ratio_mean"] == pytest.approx((shifted * math.exp(-0.5) + total - shifted) / total, abs=1e-4)
    # nothing left when every token is outside the band: no gradient at all, loss 0
    for t in trajs:
        own = own_logprobs(base_model, [copy.deepcopy(t)])[0].logprobs
        t.logprobs = [lp + 0.5 if msk else 0.0 for lp, msk in zip(own, t.response_mask)]
    learner = make_learner(copy.deepcopy(base_model), make_cfg(correction="double_sided_importance_sampling",
                                                               entropy_coef=0.0, kl="none"))
    m = learner.train_step(trajs, advantages(8))
    assert m["optim/is_masked_fraction"] == pytest.approx(1.0) and m["optim/loss"] == 0.0


def test_adaptive_kl_coefficient_follows_the_proportional_rule(base_model):
    # horizon 8 = one batch: β ← β·(1 + clip(KL/target − 1, ±0.2)·8/8)
    learner = make_learner(copy.deepcopy(base_model), make_cfg(mini=4, adaptive=True, horizon=8, target_kl=1e-3,
                                                               lr=1e-2))
    m1 = learner.train_step(make_trajectories(8), advantages(8))
    assert m1["optim/kl_coef"] == 0.05  # the coefficient used in step 1
    err = min(max(m1["optim/kl_divergence"] / 1e-3 - 1.0, -0.2), 0.2)
    assert learner.kl_coef == pytest.approx(0.05 * (1 + err))
    m2 = learner.train_step(make_trajectories(8, seed=1), advantages(8, seed=1))
    assert m2["optim/kl_coef"] == pytest.approx(0.05 * (1 + err))


def test_max_kl_guard_stops_the_rest_of_the_step(base_model):
    # 3 epochs × 2 mini-batches = 6 updates; the first measures KL = 0 (policy = reference), the second measures
    # the drift of the first update, far above 1e-6: the remaining 4 updates are skipped
    learner = make_learner(copy.deepcopy(base_model), make_cfg(mini=4, epochs=3, lr=1e-2, max_kl=1e-6,
                                                               target_kl=1e-7))
    m = learner.train_step(make_trajectories(8), advantages(8))
    assert learner.optimizer.num_updates == 2 and m["optim/kl_guard_stops"] == 1.0
    unguarded = make_learner(copy.deepcopy(base_model), make_cfg(mini=4, epochs=3, lr=1e-2))
    m = unguarded.train_step(make_trajectories(8), advantages(8))
    assert unguarded.optimizer.num_updates == 6 and m["optim/kl_guard_stops"] == 0.0


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "gspo", "cispo", "grpo_variant"])
def test_every_algorithm_trains_one_step(base_model, algorithm):
    cfg = make_cfg(mini=4, kl="none", algorithm=algorithm)
    learner = make_learner(copy.deepcopy(base_model), cfg)
    assert learner.objective.agg_mode == {"grpo": "seq_mean_token_mean", "gspo": "seq_mean_token_mean",
                                     "dr_grpo": "seq_mean_token_sum_norm"}.get(algorithm, "token_mean")
    trajs = own_logprobs(base_model, make_trajectories(8, seed=4))
    before = [p.detach().clone() for p in learner.model.parameters()]
    m = learner.train_step(trajs, advantages(8))
    assert math.isfinite(m["optim/loss"]) and m["optim/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
    if algorithm == "cispo":
        assert m["optim/cispo_clip_ratio"] == 0.0  # on-policy first update: r = 1, nothing clipped


def test_correction_bounds_the_update_when_behaviour_is_stale(base_model):
    # the engine's logprobs are those of stale weights: 5 nats lower on every third model token (ρ = e^5 ≈ 148).
    # Uncorrected, PPO's ratio to the behaviour policy is 148 there, and negative-advantage tokens are not clipped
    # from above: the pre-clip gradient norm explodes. Double-sided IS masks those tokens instead.
    trajs = own_logprobs(base_model, make_trajectories(8, seed=5))
    for t in trajs:
        k = 0
        for i, m in enumerate(t.response_mask):
            if m:
                t.logprobs[i] -= 5.0 if k % 3 == 0 else 0.0
                k += 1
    adv = [-1.0, 1.0] * 4
    norms = {}
    for method in ("none", "double_sided_importance_sampling"):
        cfg = make_cfg(correction=method, tis=method != "none", kl="none", entropy_coef=0.0)
        cfg.policy_optimization.clip_ratio_c = None  # plain PPO clip: nothing bounds r·|A| when A < 0
        norms[method] = make_learner(copy.deepcopy(base_model), cfg).train_step(copy.deepcopy(trajs), adv)[
            "optim/grad_norm"]
    clean = make_learner(copy.deepcopy(base_model), make_cfg(kl="none", entropy_coef=0.0))
    on_policy = clean.train_step(own_logprobs(base_model, copy.deepcopy(trajs)), adv)["optim/grad_norm"]
    assert norms["none"] > 20 * on_policy  # the stale tokens dominate the uncorrected update
    assert norms["double_sided_importance_sampling"] < 1.5 * on_policy  # corrected: the size of an on-policy update
    # the default dual clip (c = 3) alone also cuts them: r = 148 > c with A < 0 (and A > 0 is clipped at 1 + ε_high)
    dual = make_learner(copy.deepcopy(base_model), make_cfg(kl="none", entropy_coef=0.0))
    m = dual.train_step(copy.deepcopy(trajs), adv)
    assert m["optim/grad_norm"] < 1.5 * on_policy and m["optim/dual_clip_ratio"] > 0.0


def objective_of(cfg) -> Objective:
    return Objective.from_config(cfg.policy_optimization, cfg.learner.off_policy_correction,
                                 Plan.of(cfg).max_response_tokens)


def dual_clip_batch():
    # four tokens, one sequence each: log r = log[4, 2, 1.1, 4], A = [-1, -1, -1, +1]; ε_low 0.2, ε_high 0.28
    old = torch.zeros(4, 1)
    logp = torch.tensor([[math.log(4.0)], [math.log(2.0)], [math.log(1.1)], [math.log(4.0)]], requires_grad=True)
    return logp, old, torch.tensor([-1.0, -1.0, -1.0, 1.0]), torch.ones(4, 1)


@pytest.mark.parametrize("c, token_loss, token_grad, active", [
    # ℓ = max(−A·r, −A·clip(r, 0.8, 1.28)) = [4, 2, 1.1, −1.28]; ∂ℓ/∂log π = −A·r unclipped, 0 when clipped
    (None, [4.0, 2.0, 1.1, -1.28], [4.0, 2.0, 1.1, 0.0], 0.0),
    # dual clip, A < 0: ℓ = min(ℓ, c·|A|) = [3, 2, 1.1]; the token at r = 4 > 3 loses its gradient
    (3.0, [3.0, 2.0, 1.1, -1.28], [0.0, 2.0, 1.1, 0.0], 1 / 4),
    # c = 1.5: r = 4 and r = 2 are both above c → ℓ = 1.5, gradient 0; r = 1.1 and the A > 0 token unchanged
    (1.5, [1.5, 1.5, 1.1, -1.28], [0.0, 0.0, 1.1, 0.0], 2 / 4),
])
def test_clip_ratio_c_reaches_the_loss(c, token_loss, token_grad, active):
    cfg = make_cfg(algorithm="dapo")  # clipped_surrogate, token_mean, ε = 0.2 / 0.28
    cfg.policy_optimization.clip_ratio_c = c
    objective = objective_of(cfg)
    logp, old, adv, mask = dual_clip_batch()
    loss, m = objective.policy_loss(logp, old, adv, mask)
    assert torch.allclose(loss[:, 0], torch.tensor(token_loss), atol=1e-5)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(grad[:, 0], torch.tensor(token_grad), atol=1e-5)
    assert m["dual_clip_ratio"].item() == pytest.approx(active)
    # token mean of the loss: None (4 + 2 + 1.1 − 1.28)/4 = 1.455; 3.0: 1.205; 1.5: 0.83
    assert aggregate(loss, mask, objective.agg_mode).item() == pytest.approx(sum(token_loss) / 4, abs=1e-5)


def test_clip_ratio_c_applies_to_gspo_and_not_to_cispo():
    logp, old, adv, mask = dual_clip_batch()  # one token per sequence: GSPO's s_i is the token ratio
    losses = {}
    for algorithm in ("gspo", "cispo"):
        for c in (None, 1.5):
            cfg = make_cfg(algorithm=algorithm)
            cfg.policy_optimization.clip_ratio_c = c
            losses[algorithm, c] = objective_of(cfg).policy_loss(logp, old, adv, mask)[0].detach()[:, 0]
    # GSPO, A < 0, ratios 4, 2, 1.1 above 1 + 0.28: unclipped −A·s = [4, 2, 1.1]; with c = 1.5: [1.5, 1.5, 1.1]
    assert torch.allclose(losses["gspo", None][:3], torch.tensor([4.0, 2.0, 1.1]), atol=1e-5)
    assert torch.allclose(losses["gspo", 1.5][:3], torch.tensor([1.5, 1.5, 1.1]), atol=1e-5)
    assert torch.equal(losses["cispo", None], losses["cispo", 1.5])


def test_dr_grpo_normaliser_is_the_configured_max_response_length(base_model, monkeypatch):
    # L = engine.max_tokens × agent_loop.max_assistant_turns = 8 × 3 = 24, whatever the batch's lengths
    cfg = make_cfg(algorithm="dr_grpo", kl="none", entropy_coef=0.0)
    cfg.engine.max_tokens, cfg.agent_loop.max_assistant_turns = 8, 3
    seen = []
    real = loss_module.aggregate

    def spy(*args, **kwargs):  # the normaliser of every policy-gradient aggregation
        seen.append(kwargs.get("norm_len"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loss_module, "aggregate", spy)
    short = own_logprobs(base_model, make_trajectories(8, seed=6))
    long = own_logprobs(base_model, make_trajectories(8, seed=7))
    for t in long:  # one more turn of 5 model tokens and 2 tool tokens on every trajectory: longer responses
        t.response_ids += [7] * 7
        t.response_mask += [1] * 5 + [0] * 2
        t.versions += [0] * 5 + [-1] * 2
    long = own_logprobs(base_model, long)
    assert max(len(t.response_ids) for t in long) > max(len(t.response_ids) for t in short)
    adv = advantages(8)
    for trajs in (short, long):
        seen.clear()
        learner = make_learner(copy.deepcopy(base_model), cfg)
        m = learner.train_step(trajs, adv)
        assert seen and set(seen) == {24}
        # on-policy (r = 1), one update: ℓ_t = −A_i, loss = Σ_i −A_i·n_i / (B · L), n_i = model tokens of i
        n = [sum(t.response_mask) for t in trajs]
        expected = -sum(a * k for a, k in zip(adv, n)) / (8 * 24)
        assert m["optim/loss"] == pytest.approx(expected, abs=1e-5)
