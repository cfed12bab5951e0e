import dataclasses

import pytest
import torch

from tether.algo import ALGORITHMS, aggregate, algorithm_spec, cispo_surrogate, clipped_surrogate, gspo_surrogate
from tether.algo.aggregation import loss_denominator
from tether.config import AdvantageConfig, ExplorationConfig, KLControlConfig, OffPolicyCorrectionConfig


def close(t, expected, tol=1e-5):
    expected = torch.tensor(expected, dtype=torch.float64)
    return torch.allclose(torch.as_tensor(t, dtype=torch.float64), expected, atol=tol)


# -------------------------------------------------------------------------------------------------------- GSPO


def gspo_inputs():
    old = torch.full((4, 3), -1.0)
    deltas = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.7, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]])
    logp = (old + deltas).detach()
    logp[1, 2] = float("inf")  # garbage at masked positions
    logp[3] = -float("inf")
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]])  # row 3 fully masked
    adv = torch.tensor([1.0, 1.0, -1.0, 5.0])
    return logp.requires_grad_(True), old, adv, mask


def test_gspo_token_hand_computed():
    logp, old, adv, mask = gspo_inputs()
    loss, m = gspo_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # row 0: log s = mean(0.1, 0.2, 0.3) = 0.2, s = 1.221403 < 1.28, A = 1  → −1.221403 on every token
    # row 1: log s = mean(0.5, 0.7) = 0.6, s = 1.822119 > 1.28, A = 1       → −1.28 (clipped, whole sequence)
    # row 2: log s = −0.5, s = 0.606531 < 0.8, A = −1                        → max(0.606531, 0.8) = 0.8 (clipped)
    # row 3: fully masked                                                    → 0, no NaN from the ±inf logp
    assert close(loss, [[-1.221403] * 3, [-1.28, -1.28, 0.0], [0.8] * 3, [0.0] * 3])
    assert close(m["clip_ratio_high"], 2 / 8) and close(m["clip_ratio_low"], 3 / 8)
    # token-weighted mean of s: (3·1.221403 + 2·1.822119 + 3·0.606531) / 8 = 9.128038 / 8
    assert close(m["ratio_mean"], 1.141005)
    assert close(m["ppo_kl"], -(0.6 + 1.2 - 1.5) / 8)  # = mean of the *token* log-ratios, −0.0375
    loss.sum().backward()
    # ∂ℓ_{i,t}/∂logp_{i,t} = −A·s_i where the sequence is not clipped: row 0 only
    assert close(logp.grad, [[-1.221403] * 3, [0.0] * 3, [0.0] * 3, [0.0] * 3])


def test_gspo_token_gradient_equals_the_sequence_level_gradient():
    # With A_{i,t} = A_i and seq_mean_token_mean, GSPO-token's gradient is GSPO's: ∇(−1/B Σ_i A_i·s_i(θ))
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    logp = (old + 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    tok, m = gspo_surrogate(logp, old, adv, mask, clip_low=0.9, clip_high=10.0)  # wide: nothing clipped
    assert m["clip_ratio_low"] == 0 and m["clip_ratio_high"] == 0
    (g_token,) = torch.autograd.grad(aggregate(tok, mask, "seq_mean_token_mean"), logp)
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))  # [B] sequence ratio, with grad
    (g_seq,) = torch.autograd.grad(-(adv * s).mean(), logp)
    assert torch.allclose(g_token, g_seq, atol=1e-12)


def test_gspo_paper_epsilons_clip_a_sequence_just_off_policy():
    old = torch.zeros(2, 2)
    logp = torch.tensor([[1e-4, 1e-4], [1e-3, 1e-3]], dtype=torch.float64).requires_grad_(True)
    fn = algorithm_spec("gspo").policy_loss_fn()  # ε = 3e-4 / 4e-4
    loss, m = fn(logp, old, torch.tensor([1.0, 1.0]), torch.ones(2, 2))
    # row 0: s = e^1e-4 = 1.0001 inside [0.9997, 1.0004]; row 1: s = e^1e-3 = 1.0010005 > 1.0004 → −1.0004
    assert close(loss, [[-1.000100005, -1.000100005], [-1.0004, -1.0004]], tol=1e-9)
    assert close(m["clip_ratio_high"], 0.5)


# ------------------------------------------------------------------------------------------------------- CISPO


def cispo_inputs():
    old = torch.full((2, 4), -1.0)
    logp = (old + torch.tensor([[0.1, 0.5, -0.5, -3.0], [0.0, 0.0, 0.0, 0.0]])).detach()
    logp[1] = -float("inf")  # fully masked row with garbage
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    return logp.requires_grad_(True), old, adv, mask


def test_cispo_hand_computed_no_lower_bound():
    logp, old, adv, mask = cispo_inputs()
    loss, m = cispo_surrogate(logp, old, adv, mask, clip_high=0.28)
    # logp = [−0.9, −0.5, −1.5, −4]; r = [e^0.1, e^0.5, e^−0.5, e^−3] = [1.105171, 1.648721, 0.606531, 0.049787]
    # w = clip(r, −∞, 1.28) = [1.105171, 1.28, 0.606531, 0.049787];  ℓ = −w·A·logp:
    # t0: −1.105171·1·(−0.9) = 0.994654   t1: −1.28·(−0.5) = 0.64
    # t2: −0.606531·(−1)·(−1.5) = −0.909796   t3: −0.049787·(−4) = 0.199148
    assert close(loss, [[0.994654, 0.64, -0.909796, 0.199148], [0.0] * 4])
    assert close(m["cispo_clip_ratio"], 0.25) and close(m["clip_ratio_high"], 0.25) and close(m["clip_ratio_low"], 0)
    loss.sum().backward()
    # ∇ = −clip(r)·A: t1 keeps its gradient (−1.28), where PPO's clip would zero it
    assert close(logp.grad, [[-1.105171, -1.28, 0.606531, -0.049787], [0.0] * 4])
    ppo, _ = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    assert g_ppo[0, 1] == 0


def test_cispo_lower_bound_and_weights():
    logp, old, adv, mask = cispo_inputs()
    loss, m = cispo_surrogate(logp, old, adv, mask, clip_high=0.28, clip_low=0.2)
    # w = clip(r, 0.8, 1.28) = [1.105171, 1.28, 0.8, 0.8]; t2: −0.8·(−1)·(−1.5) = −1.2; t3: −0.8·(−4) = 3.2
    assert close(loss[0], [0.994654, 0.64, -1.2, 3.2])
    assert close(m["cispo_clip_ratio"], 0.75)  # t1, t2, t3 have their weight clipped
    assert close(m["clip_ratio_low"], 0.25)  # t2 only: r < 0.8 with A < 0 (t3 has A > 0)
    weights = torch.tensor([[2.0, 1.0, 1.0, 0.0], [1.0] * 4], requires_grad=True)
    weighted, _ = cispo_surrogate(logp, old, adv, mask, clip_high=0.28, clip_low=0.2, weights=weights)
    weighted.sum().backward()
    assert close(logp.grad[0], [-2 * 1.105171, -1.28, 0.8, 0.0]) and weights.grad is None
    with pytest.raises(ValueError, match="clip_high"):
        cispo_surrogate(logp, old, adv, mask, clip_high=-0.1)


# ---------------------------------------------------------------------------------------------------- registry


def test_registry_names_defaults_and_errors():
    assert set(ALGORITHMS) == {"grpo", "dapo", "dr_grpo", "gspo", "cispo", "grpo_variant"}
    grpo, dapo, dr = algorithm_spec("grpo"), algorithm_spec("dapo"), algorithm_spec("dr_grpo")
    assert (grpo.agg_mode, grpo.normalization, grpo.clip_high) == ("seq_mean_token_mean", "group", 0.2)
    assert (dapo.agg_mode, dapo.clip_low, dapo.clip_high, dapo.filter_degenerate_groups, dapo.kl_coef) == (
        "token_mean", 0.2, 0.28, True, 0.0)
    assert (dr.agg_mode, dr.normalization) == ("seq_mean_token_sum_norm", "none")
    assert algorithm_spec("gspo").loss_fn is gspo_surrogate and algorithm_spec("cispo").clip_low is None
    with pytest.raises(ValueError, match="'cispo', 'dapo', 'dr_grpo', 'grpo', 'grpo_variant', 'gspo'"):
        algorithm_spec("ppo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        grpo.clip_high = 0.3


def test_grpo_variant_matches_the_seed_config_defaults():
    spec = algorithm_spec("grpo_variant")
    adv, exp, kl = AdvantageConfig(), ExplorationConfig(), KLControlConfig()
    assert spec.normalization == adv.normalization == "batch"
    assert spec.filter_degenerate_groups == adv.degenerate_group_filter.enabled
    assert spec.clip_high == exp.clip_higher and spec.entropy_coef == exp.entropy_coef
    assert spec.clip_low == OffPolicyCorrectionConfig().clip_ratio and spec.kl_coef == kl.init_coef
    assert spec.is_method == "double_sided_truncated"


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_loss_runs_and_aggregates(name):
    spec = algorithm_spec(name)
    old = torch.full((2, 3), -1.0)
    logp = (old + torch.tensor([[0.0, 1e-4, -1e-4], [0.05, 0.0, 0.0]])).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    tok, metrics = spec.policy_loss_fn()(logp, old, torch.tensor([1.0, -1.0]), mask, weights=torch.ones(2, 3))
    loss = aggregate(tok, mask, spec.agg_mode, denom=loss_denominator(mask, spec.agg_mode))
    loss.backward()
    assert tok.shape == (2, 3) and torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (tok[1, 1:] == 0).all() and all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
