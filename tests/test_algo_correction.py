import math

import pytest
import torch

from tether.algo import aggregate, clipped_surrogate, decoupled_surrogate, is_weights, mismatch_metrics


def close(t, expected, tol=1e-5):
    expected = torch.tensor(expected, dtype=torch.float64)
    return torch.allclose(torch.as_tensor(t, dtype=torch.float64), expected, atol=tol)


def token_inputs():
    # Δ = log π_prox − log π_behav = [0.1, −0.5, 1, ln 3, ·]; the last token is masked (garbage behaviour logprob)
    prox = torch.full((1, 5), -1.0)
    behav = prox - torch.tensor([[0.1, -0.5, 1.0, math.log(3.0), 0.0]])
    behav[0, 4] = -float("inf")
    return prox, behav, torch.tensor([[1, 1, 1, 1, 0]])


# ρ_t = [e^0.1, e^−0.5, e, 3] = [1.105171, 0.606531, 2.718282, 3.0] on the unmasked tokens


def test_truncated_is_token_level():
    prox, behav, mask = token_inputs()
    w, keep, m = is_weights(prox, behav, mask, method="truncated", tis_cap=2.0)
    # min(ρ, 2) = [1.105171, 0.606531, 2, 2], masked 0; TIS rejects nothing
    assert close(w, [[1.105171, 0.606531, 2.0, 2.0, 0.0]])
    assert torch.equal(keep, mask)
    assert close(m["is_ratio_mean"], 1.857496)  # (1.105171 + 0.606531 + 2.718282 + 3) / 4 = 7.429984 / 4
    assert close(m["is_ratio_max"], 3.0) and close(m["is_ratio_min"], 0.606531)
    assert close(m["is_log_ratio_abs"], 0.674653)  # (0.1 + 0.5 + 1 + ln 3 = 1.098612) / 4 = 2.698612 / 4
    assert close(m["is_weight_mean"], 1.427925)  # (1.105171 + 0.606531 + 2 + 2) / 4 = 5.711702 / 4
    assert close(m["is_truncated_fraction"], 0.5) and close(m["is_masked_fraction"], 0.0)  # t2, t3 of 4


def test_double_sided_token_level_masks_outside_the_band():
    prox, behav, mask = token_inputs()
    w, keep, m = is_weights(prox, behav, mask, method="double_sided", clip_ratio_low=0.2, clip_ratio_high=0.2)
    # band [0.8, 1.2]: only t0 (1.105171) is inside and keeps its ratio as weight (IcePop M(ρ) = ρ)
    assert close(w, [[1.105171, 0.0, 0.0, 0.0, 0.0]])
    assert keep.tolist() == [[1, 0, 0, 0, 0]] and keep.dtype == mask.dtype
    assert close(m["is_masked_fraction"], 0.75) and close(m["is_truncated_fraction"], 0.0)  # 3 of 4 rejected


def test_double_sided_truncated_gives_in_band_tokens_the_capped_weight():
    prox, behav, mask = token_inputs()
    w, keep, m = is_weights(prox, behav, mask, method="double_sided_truncated", clip_ratio_low=0.5,
                            clip_ratio_high=1.8, tis_cap=1.5)
    # band [0.5, 2.8]: t0, t1, t2 in, t3 (3.0) out; in-band weights min(ρ, 1.5) = [1.105171, 0.606531, 1.5]
    assert close(w, [[1.105171, 0.606531, 1.5, 0.0, 0.0]])
    assert keep.tolist() == [[1, 1, 1, 0, 0]]
    assert close(m["is_masked_fraction"], 0.25) and close(m["is_truncated_fraction"], 0.25)
    w_none, keep_none, _ = is_weights(prox, behav, mask, method="none")
    assert close(w_none, [[1.0, 1.0, 1.0, 1.0, 0.0]]) and torch.equal(keep_none, mask)


def test_double_sided_mask_rejects_outside_the_band_without_reweighting():
    prox, behav, mask = token_inputs()
    w, keep, m = is_weights(prox, behav, mask, method="double_sided_mask", clip_ratio_low=0.5, clip_ratio_high=1.8)
    # band [0.5, 2.8]: t0, t1, t2 in with weight 1 (not their ratios 1.105171, 0.606531, 2.718282), t3 out
    assert close(w, [[1.0, 1.0, 1.0, 0.0, 0.0]])
    assert keep.tolist() == [[1, 1, 1, 0, 0]]
    assert close(m["is_weight_mean"], 0.75) and close(m["is_masked_fraction"], 0.25)


def test_ratio_exactly_on_a_band_bound_is_kept():
    prox = torch.zeros(1, 2)
    behav = prox - torch.tensor([[0.2, -0.2]])
    rho = torch.exp(prox - behav)[0]  # the very float32 ratios is_weights will see
    hi, lo = rho[0].item() - 1.0, 1.0 - rho[1].item()  # 1 + ε_high = ρ0 and 1 − ε_low = ρ1, exactly
    w, keep, m = is_weights(prox, behav, torch.ones(1, 2), method="double_sided", clip_ratio_low=lo, clip_ratio_high=hi)
    assert keep.tolist() == [[1.0, 1.0]] and m["is_masked_fraction"].item() == 0.0  # bounds are inclusive
    assert close(w, [[1.221403, 0.818731]])  # e^0.2, e^−0.2
    _, keep, _ = is_weights(prox, behav, torch.ones(1, 2), method="double_sided", clip_ratio_low=lo,
                            clip_ratio_high=hi - 1e-6)
    assert keep.tolist() == [[0.0, 1.0]]  # a hair inside the ratio: out


def sequence_inputs():
    # row 0: Δ = [0.1, 0.2, 0.3] → Σ 0.6: ρ_seq = e^0.6 = 1.822119, ρ̄ = e^0.2 = 1.221403
    # row 1: Δ = [−0.1, 0.4, ·] → Σ 0.3: ρ_seq = e^0.3 = 1.349859, ρ̄ = e^0.15 = 1.161834
    # row 2: fully masked, NaN behaviour logprobs
    prox = torch.zeros(3, 3)
    behav = -torch.tensor([[0.1, 0.2, 0.3], [-0.1, 0.4, 7.0], [0.0, 0.0, 0.0]])
    behav[2] = float("nan")
    return prox, behav, torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])


def test_sequence_level_truncation_uses_the_product_and_masking_the_geometric_mean():
    prox, behav, mask = sequence_inputs()
    w, keep, m = is_weights(prox, behav, mask, method="truncated", tis_cap=1.5, level="sequence")
    # min(ρ_seq, 1.5): row 0 → 1.5 (truncated, 3 tokens), row 1 → 1.349859
    assert close(w, [[1.5, 1.5, 1.5], [1.349859, 1.349859, 0.0], [0.0, 0.0, 0.0]])
    assert close(m["is_truncated_fraction"], 3 / 5)
    w, keep, m = is_weights(prox, behav, mask, method="double_sided", level="sequence")
    # band [0.8, 1.2] on ρ̄: row 0 (1.221403) out, row 1 (1.161834) in with weight ρ̄. The product test would have
    # rejected row 1 too (ρ_seq = 1.35): the band is a per-token tolerance.
    assert close(w, [[0.0, 0.0, 0.0], [1.161834, 1.161834, 0.0], [0.0, 0.0, 0.0]])
    assert keep.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert close(m["is_masked_fraction"], 3 / 5)
    w, _, _ = is_weights(prox, behav, mask, method="double_sided_truncated", tis_cap=1.3, level="sequence")
    assert close(w[1], [1.3, 1.3, 0.0])  # row 1 in band, weight min(1.349859, 1.3)
    for method in ("truncated", "double_sided", "double_sided_truncated", "none"):
        w, keep, m = is_weights(prox, behav, mask, method=method, level="sequence")
        assert torch.isfinite(w).all() and (w[2] == 0).all() and (keep[2] == 0).all()
        assert all(torch.isfinite(v) for v in m.values())


def test_is_weights_validation():
    prox, behav, mask = token_inputs()
    with pytest.raises(ValueError, match="unknown IS method"):
        is_weights(prox, behav, mask, method="icepop")
    with pytest.raises(ValueError, match="unknown IS level"):
        is_weights(prox, behav, mask, method="truncated", level="turn")
    with pytest.raises(ValueError, match="clip_ratio_low"):
        is_weights(prox, behav, mask, method="double_sided", clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        is_weights(prox, behav, mask, method="truncated", tis_cap=0.0)
    with pytest.raises(ValueError, match="must be equal"):
        is_weights(prox, behav[:, :3], mask, method="truncated")


def test_decoupled_surrogate_hand_computed():
    prox = torch.full((1, 2), -1.0)
    logp = (prox + torch.tensor([[0.1, 0.5]])).requires_grad_(True)
    behav = prox - torch.tensor([[math.log(2.0), math.log(4.0)]])  # w = π_prox/π_behav = [2, 4]
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    loss, m = decoupled_surrogate(logp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.28, behav_cap=3.0)
    # t0: r = e^0.1 = 1.105171 unclipped, ℓ = −1.105171 · w 2 = −2.210342
    # t1: r = e^0.5 > 1.28 → −1.28, · min(4, 3) = −3.84
    assert close(loss, [[-2.210342, -3.84]])
    assert close(m["behav_weight_mean"], 2.5) and close(m["behav_truncated_fraction"], 0.5)
    assert close(m["clip_ratio_high"], 0.5)
    loss.sum().backward()
    assert close(logp.grad, [[-2.210342, 0.0]])  # −A·r·w where unclipped
    untruncated, _ = decoupled_surrogate(logp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.28)
    assert close(untruncated, [[-2.210342, -5.12]])  # Hilton's w = 4 on t1
    # π_behav = π_prox: exactly PPO around π_prox
    same, _ = decoupled_surrogate(logp, prox, prox, adv, mask, clip_low=0.2, clip_high=0.28)
    ppo, _ = clipped_surrogate(logp, prox, adv, mask, clip_low=0.2, clip_high=0.28)
    assert torch.equal(same, ppo)


def test_stale_behaviour_logprobs_explode_uncorrected_but_stay_bounded_corrected():
    g = torch.Generator().manual_seed(0)
    B, L, C, eps_high = 4, 16, 2.0, 0.2
    prox = -1.0 - torch.rand(B, L, generator=g)  # log π_prox ∈ [−2, −1]
    noise = 0.02 * torch.randn(B, L, generator=g)  # engine/learner numerics
    noise[:, ::4] = -8.0 - 4.0 * torch.rand(B, 4, generator=g)  # stale weights: these tokens were e^8..e^12 less likely
    behav = prox + noise
    mask = torch.ones(B, L)
    mask[3, 10:] = 0
    adv = torch.tensor([1.5, -0.5, -2.0, 1.0])  # max|A| = 2
    n = int(mask.sum())  # 58 tokens

    def grad_and_loss(weights):
        logp = prox.clone().requires_grad_(True)  # first update of the step: π_θ = π_prox, r = 1
        tok, _ = clipped_surrogate(logp, prox, adv, mask, clip_low=0.2, clip_high=0.28, weights=weights)
        loss = aggregate(tok, mask, "token_mean")
        (grad,) = torch.autograd.grad(loss, logp)
        return grad.norm().item(), abs(loss.item())

    # At r = 1 no token is clipped: ∂L/∂logp_t = −w_t·A/N, so ‖g‖ ≤ w_max·max|A|·√N / N and |L| ≤ w_max·max|A|.
    raw = torch.exp(prox - behav)  # the uncorrected importance weight, up to e^12 ≈ 1.6e5
    g_raw, l_raw = grad_and_loss(raw)
    w_tis, _, m = is_weights(prox, behav, mask, method="truncated", tis_cap=C)
    g_tis, l_tis = grad_and_loss(w_tis)
    w_pop, _, _ = is_weights(prox, behav, mask, method="double_sided", clip_ratio_high=eps_high)
    g_pop, l_pop = grad_and_loss(w_pop)
    assert m["is_ratio_max"].item() > math.exp(8)
    bound_tis, bound_pop = C * 2.0 / math.sqrt(n), (1 + eps_high) * 2.0 / math.sqrt(n)  # 0.525, 0.315
    assert g_tis <= bound_tis and l_tis <= C * 2.0
    assert g_pop <= bound_pop and l_pop <= (1 + eps_high) * 2.0
    # the uncorrected objective explodes (here ‖g‖ ≈ 5.1e3, |L| ≈ 1.6e3; advantages of both signs partly cancel in L)
    assert g_raw > 1000 * bound_tis and l_raw > 100 * C * 2.0
    # the decoupled objective with a cap is the same bounded gradient
    logp = prox.clone().requires_grad_(True)
    tok, _ = decoupled_surrogate(logp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.28, behav_cap=C)
    (grad,) = torch.autograd.grad(aggregate(tok, mask, "token_mean"), logp)
    assert abs(grad.norm().item() - g_tis) < 1e-6


def test_mismatch_metrics_by_hand():
    # Δ = [0.1, −0.5, 1, ln 3] on the unmasked tokens (token_inputs); the masked one's −inf never leaks
    prox, behav, mask = token_inputs()
    m = mismatch_metrics(prox, behav, mask)
    assert close(m["logp_abs_diff_mean"], 0.674653)  # (0.1 + 0.5 + 1 + 1.098612) / 4
    # k3 = e^Δ − 1 − Δ: 0.005171, 0.106531, 0.718282, 3 − 1 − 1.098612 = 0.901388 → 1.731372 / 4
    assert close(m["mismatch_kl"], 0.432843)
    assert m["mismatch_tokens"].item() == 4.0
    same = mismatch_metrics(prox, prox.clone(), mask)  # the same weights and arithmetic: no gap
    assert same["logp_abs_diff_mean"].item() == 0.0 and same["mismatch_kl"].item() == 0.0
