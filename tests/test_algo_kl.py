import pytest
import torch

from tether.algo import kl_estimate, kl_penalty


def close(t, expected, tol=1e-5):
    expected = torch.tensor(expected, dtype=torch.float64)
    return torch.allclose(torch.as_tensor(t, dtype=torch.float64), expected, atol=tol)


def two_tokens():
    # log r = ref − logp = [-0.5, 1.0]
    return torch.tensor([[-1.0, -2.0]], requires_grad=True), torch.tensor([[-1.5, -1.0]])


def test_k1_k2_k3_hand_computed_values_and_gradients():
    logp, ref = two_tokens()
    # k1 = -log r = [0.5, -1.0]
    assert close(kl_estimate(logp, ref, "k1"), [[0.5, -1.0]])
    # k2 = ½ (log r)² = [0.125, 0.5]
    assert close(kl_estimate(logp, ref, "k2"), [[0.125, 0.5]])
    # k3 = (r − 1) − log r, r = [e^-0.5, e^1] = [0.606531, 2.718282]
    #    = [0.606531 − 1 + 0.5, 2.718282 − 1 − 1] = [0.106531, 0.718282]
    k3 = kl_estimate(logp, ref, "k3")
    assert close(k3, [[0.106531, 0.718282]])
    # ∂k3/∂logp = 1 − r = [0.393469, -1.718282];  ∂k2/∂logp = -log r = [0.5, -1];  ∂k1/∂logp = 1
    (g3,) = torch.autograd.grad(k3.sum(), logp)
    assert close(g3, [[0.393469, -1.718282]])
    (g2,) = torch.autograd.grad(kl_estimate(logp, ref, "k2").sum(), logp)
    assert close(g2, [[0.5, -1.0]])
    (g1,) = torch.autograd.grad(kl_estimate(logp, ref, "k1").sum(), logp)
    assert close(g1, [[1.0, 1.0]])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "low_var_kl")


def test_k3_is_nonnegative_and_log_ratio_is_clamped():
    g = torch.Generator().manual_seed(0)
    logp = -10 * torch.rand(64, 256, generator=g)
    ref = logp + torch.randn(64, 256, generator=g) * torch.logspace(-8, 2, 256)  # tiny to huge differences
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all() and (k3 <= 10).all()
    assert (kl_estimate(logp, ref, "k2") >= 0).all()
    one = torch.zeros(1, 1)
    # log r = -100: k3 clamps log r to -20, e^-20 − 1 + 20 = 19.000000, then the estimate to 10 (verl)
    assert close(kl_estimate(one, torch.full((1, 1), -100.0), "k3"), [[10.0]])
    assert close(kl_estimate(one, torch.full((1, 1), -100.0), "k3", max_k3=None), [[19.0]])
    # log r = +100 clamps to +20: k3 = e^20 − 21 = 485165174.4 unclamped, 10 with verl's clamp
    assert close(kl_estimate(one, torch.full((1, 1), 100.0), "k3"), [[10.0]])
    assert close(kl_estimate(one, torch.full((1, 1), 100.0), "k3", max_k3=None), [[485165174.4]], tol=1.0)


def test_k1_and_k2_are_not_clamped():
    # log r = ref − logp = [-100, 30, 3]: verl clamps nothing for k1/k2 (kl_penalty_forward), neither do we
    logp = torch.tensor([[0.0, -30.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-100.0, 0.0, 0.0]])
    # k1 = −log r = [100, -30, -3]
    assert close(kl_estimate(logp, ref, "k1"), [[100.0, -30.0, -3.0]])
    # k2 = ½ (log r)² = [5000, 450, 4.5]
    k2 = kl_estimate(logp, ref, "k2")
    assert close(k2, [[5000.0, 450.0, 4.5]])
    # ∂k2/∂logp = −log r = [100, -30, -3]: the gradient is not cut either
    (g2,) = torch.autograd.grad(k2.sum(), logp)
    assert close(g2, [[100.0, -30.0, -3.0]])
    # k3 on the same tokens: log r = 30 → clamped to 20, e^20 − 21 → 10; log r = 3: e^3 − 4 = 16.085537 → 10;
    # log r = -100 → -20: 19 → 10. All three are at the clamp: no gradient (the price of verl's bound)
    k3 = kl_estimate(logp, ref, "k3")
    assert close(k3, [[10.0, 10.0, 10.0]])
    (g3,) = torch.autograd.grad(k3.sum(), logp)
    assert close(g3, [[0.0, 0.0, 0.0]])
    # just inside the bound, log r = 2.5: k3 = e^2.5 − 3.5 = 8.682494, ∂k3/∂logp = 1 − e^2.5 = -11.182494
    near = torch.tensor([[-2.5]], requires_grad=True)
    k3 = kl_estimate(near, torch.zeros(1, 1), "k3")
    assert close(k3, [[8.682494]])
    (g,) = torch.autograd.grad(k3.sum(), near)
    assert close(g, [[-11.182494]])


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    g = torch.Generator().manual_seed(0)
    q_logits, p_logits = torch.tensor([1.0, 0.0, -1.0, 0.5]), torch.tensor([0.0, 0.5, 0.0, -0.5])
    logq, logp_ref = q_logits.log_softmax(-1), p_logits.log_softmax(-1)
    exact = (logq.exp() * (logq - logp_ref)).sum()  # KL(q ‖ p)
    x = torch.multinomial(logq.exp(), 200_000, replacement=True, generator=g)  # samples from π_θ = q
    for kind in ("k1", "k3"):
        est = kl_estimate(logq[x][None], logp_ref[x][None], kind).mean()
        assert abs(est - exact) < 5e-3, (kind, est.item(), exact.item())


def test_kl_penalty_fixed_coefficient_and_mask():
    logp, ref = two_tokens()
    term, m = kl_penalty(logp, ref, torch.tensor([[1, 1]]), coef=0.1, kind="k3", mode="token_mean")
    # β · mean k3 = 0.1 · (0.106531 + 0.718282) / 2 = 0.1 · 0.412406
    assert close(term, 0.0412406)
    assert close(m["kl"], 0.412406) and close(m["kl_coef"], 0.1)
    term, _ = kl_penalty(logp, ref, torch.tensor([[1, 0]]), coef=0.1, kind="k3", mode="token_mean")
    assert close(term, 0.0106531)  # the masked token does not count
    mask = torch.tensor([[1, 1]])
    term, _ = kl_penalty(logp, ref, mask, coef=0.1, kind="k1", mode="seq_mean_token_sum_norm", norm_len=4)
    assert close(term, 0.1 * (0.5 - 1.0) / (1 * 4))  # Σ k1 / (B · norm_len) = -0.125 → -0.0125


def test_kl_penalty_ignores_nonfinite_logprobs_at_masked_positions():
    # unclamped k2 of an -inf log-prob would be inf, and its gradient NaN; at a masked position it must not matter
    logp = torch.tensor([[-1.0, -float("inf")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -float("inf")]])
    for kind in ("k1", "k2", "k3"):
        term, m = kl_penalty(logp, ref, torch.tensor([[1, 0]]), coef=1.0, kind=kind, mode="token_mean")
        (g,) = torch.autograd.grad(term, logp)
        assert torch.isfinite(term) and torch.isfinite(g).all() and g[0, 1] == 0.0
    # k2 of the first token alone: ½ · 0.5² = 0.125, gradient −log r = 0.5
    term, _ = kl_penalty(logp, ref, torch.tensor([[1, 0]]), coef=1.0, kind="k2", mode="token_mean")
    (g,) = torch.autograd.grad(term, logp)
    assert close(term, 0.125) and close(g, [[0.5, 0.0]])
