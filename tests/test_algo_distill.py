"""Distillation losses (tether.algo.distill): values by hand, and what their gradients optimise in expectation."""

from __future__ import annotations

import math

import pytest
import torch

from tether.algo.distill import gather_logprobs, reverse_kl_loss, topk_forward_kl

LN2 = math.log(2.0)


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float64, requires_grad=True)


def _t(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float64)


def test_reverse_kl_k1_value_and_gradient_by_hand():
    # q = 0.5, p = 0.25 on the sampled token, on-policy (μ = q): k1 = log q − log p = ln 2 = 0.693147,
    # ρ = 1, loss = sg(k1)·ρ = ln 2 and d loss / d log q = k1·ρ = ln 2.
    # Off-policy μ = 0.25: ρ = 2, loss = 2 ln 2 = 1.386294, gradient 2 ln 2.
    logp = _leaf(math.log(0.5), math.log(0.5))
    loss, m = reverse_kl_loss(logp, _t(math.log(0.25), math.log(0.25)), _t(math.log(0.5), math.log(0.25)),
                              _t(1.0, 1.0), estimator="k1")
    assert loss.detach().tolist()[0] == pytest.approx([LN2, 2 * LN2], abs=1e-12)
    loss.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([LN2, 2 * LN2], abs=1e-12)
    assert float(m["kl"]) == pytest.approx(LN2, abs=1e-12)  # the estimate: ln 2 on both tokens


def test_reverse_kl_k3_value_and_gradient_by_hand():
    # r = p/q = 0.25/0.5 = 0.5: k3 = (r − 1) − ln r = −0.5 + ln 2 = 0.193147; d k3 / d log q = 1 − r = 0.5.
    # Off-policy μ = 0.25 (ρ = 2, detached): loss = 2·k3 = 0.386294, gradient 2·0.5 = 1.
    logp = _leaf(math.log(0.5), math.log(0.5))
    loss, m = reverse_kl_loss(logp, _t(math.log(0.25), math.log(0.25)), _t(math.log(0.5), math.log(0.25)),
                              _t(1.0, 1.0), estimator="k3")
    k3 = LN2 - 0.5
    assert loss.detach().tolist()[0] == pytest.approx([k3, 2 * k3], abs=1e-12)
    loss.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.5, 1.0], abs=1e-12)
    assert float(m["kl"]) == pytest.approx(k3, abs=1e-12)


def test_sampling_temperature_enters_the_ratio_and_the_score_function_only():
    # The student sampled at τ: log q_τ(x) = ln 0.8 (sample_logp), log q_1(x) = ln 0.5 (logp), teacher ln 0.25,
    # behaviour μ = 0.4. k1: value log q_1 − log p = ln 2 (not ln 3.2), ρ = q_τ/μ = 2, loss = ρ·ln 2 = 1.386294;
    # the gradient goes to log q_τ only (the score function): 2 ln 2, none to log q_1.
    logp, sample = _leaf(math.log(0.5)), _leaf(math.log(0.8))
    loss, m = reverse_kl_loss(logp, _t(math.log(0.25)), _t(math.log(0.4)), _t(1.0), estimator="k1",
                              sample_logp=sample)
    assert _f(loss) == pytest.approx(2 * LN2, abs=1e-12) and float(m["kl"]) == pytest.approx(LN2, abs=1e-12)
    loss.sum().backward()
    assert float(sample.grad) == pytest.approx(2 * LN2, abs=1e-12) and (logp.grad is None or logp.grad == 0)
    # k3: k3(log q_1, log p) = ln 2 − 0.5 weighted by sg(ρ) = 2; its gradient goes to log q_1: 2·(1 − 0.5) = 1.
    logp, sample = _leaf(math.log(0.5)), _leaf(math.log(0.8))
    loss, _ = reverse_kl_loss(logp, _t(math.log(0.25)), _t(math.log(0.4)), _t(1.0), estimator="k3",
                              sample_logp=sample)
    assert _f(loss) == pytest.approx(2 * (LN2 - 0.5), abs=1e-12)
    loss.sum().backward()
    assert float(logp.grad) == pytest.approx(1.0, abs=1e-12) and (sample.grad is None or sample.grad == 0)


def test_masked_tokens_give_zero_loss_and_no_nan_gradient():
    logp = _leaf(math.log(0.5), -math.inf)
    teacher = _t(math.log(0.25), -math.inf)
    for est in ("k1", "k3"):
        loss, m = reverse_kl_loss(logp, teacher, _t(math.log(0.5), 0.0), _t(1.0, 0.0), estimator=est)
        assert loss.detach().tolist()[0][1] == 0.0
        logp.grad = None
        loss.sum().backward()
        assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0
    with pytest.raises(ValueError, match="k2"):
        reverse_kl_loss(logp, teacher, teacher, _t(1.0, 1.0), estimator="k2")  # type: ignore[arg-type]


def _expected_gradient(estimator: str, theta: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """E_{x~q}[∇ℓ(x)] computed exactly by enumerating the V outcomes of one position (weights q(x), detached)."""
    theta = theta.clone().requires_grad_(True)
    log_q = torch.log_softmax(theta, -1)  # [V]
    v = theta.shape[0]
    logp = log_q.unsqueeze(0)  # [1, V]: one "sampled token" per outcome x, as a batch of V tokens
    loss, _ = reverse_kl_loss(logp, log_p.unsqueeze(0), log_q.detach().unsqueeze(0), torch.ones(1, v),
                              estimator=estimator)  # type: ignore[arg-type]
    (loss * log_q.detach().exp()).sum().backward()  # Σ_x q(x) ℓ(x): the expectation over the student's sample
    return theta.grad


def _true_gradient(kl: str, theta: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    theta = theta.clone().requires_grad_(True)
    log_q = torch.log_softmax(theta, -1)
    q, p = log_q.exp(), log_p.exp()
    value = (q * (log_q - log_p)).sum() if kl == "reverse" else (p * (log_p - log_q)).sum()
    value.backward()
    return theta.grad


def test_k1_expected_gradient_is_the_reverse_kl_gradient_and_k3_the_forward_kl_gradient():
    # Tang & Munos (arXiv 2506.09477): back-propagating k3 optimises KL(p ‖ q); the score-function form of k1
    # optimises KL(q ‖ p). Exact expectations over a 5-token vocabulary; logits within ±1 keep every k3 below its
    # clamp (10, above which a token passes no gradient).
    g = torch.Generator().manual_seed(0)
    theta = torch.rand(5, generator=g, dtype=torch.float64) * 2 - 1
    log_p = torch.log_softmax(torch.rand(5, generator=g, dtype=torch.float64) * 2 - 1, -1)
    torch.testing.assert_close(_expected_gradient("k1", theta, log_p), _true_gradient("reverse", theta, log_p))
    torch.testing.assert_close(_expected_gradient("k3", theta, log_p), _true_gradient("forward", theta, log_p))
    assert not torch.allclose(_true_gradient("reverse", theta, log_p), _true_gradient("forward", theta, log_p))


def _topk(p: list[float], q: list[float], ids: list[int], valid: list[bool] | None = None):
    log_q = torch.log(torch.tensor([[q]], dtype=torch.float64)).requires_grad_(True)  # [1, 1, V]
    s_top = log_q[..., ids]  # [1, 1, K]
    t_top = torch.log(torch.tensor([[[p[i] for i in ids]]], dtype=torch.float64))
    ok = torch.tensor([[valid if valid is not None else [True] * len(ids)]])
    loss, m = topk_forward_kl(s_top, t_top, ok, torch.ones(1, 1))
    return loss, m, log_q


def _f(x: torch.Tensor) -> float:
    return float(x.detach())


def test_topk_forward_kl_by_hand():
    p, q = [0.5, 0.3, 0.2], [0.4, 0.4, 0.2]
    # K = 2 of V = 3: the rest is the third token alone, so KL_K is the full KL:
    # 0.5 ln(0.5/0.4) + 0.3 ln(0.3/0.4) + 0.2 ln(0.2/0.2) = 0.111572 − 0.086305 + 0 = 0.025267
    loss, m, _ = _topk(p, q, [0, 1])
    full = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert _f(loss) == pytest.approx(full, abs=1e-12) and full == pytest.approx(0.025267, abs=1e-6)
    assert float(m["teacher_mass"]) == pytest.approx(0.8) and float(m["student_mass"]) == pytest.approx(0.8)
    # K = 1: 0.5 ln(0.5/0.4) + rest 0.5 ln(0.5/0.6) = 0.111572 − 0.091161 = 0.020411 (≤ the full KL); verl's
    # rest-less sum would be 0.111572.
    loss, _, _ = _topk(p, q, [0])
    assert _f(loss) == pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6), abs=1e-12)
    # An entry the teacher did not return (valid False) is ignored: K = 2 with one invalid equals K = 1.
    loss2, _, _ = _topk(p, q, [0, 1], valid=[True, False])
    assert _f(loss2) == pytest.approx(_f(loss), abs=1e-12)


def test_topk_forward_kl_is_zero_with_zero_gradient_at_the_teacher_and_positive_elsewhere():
    p = [0.6, 0.25, 0.1, 0.05]
    loss, _, log_q = _topk(p, p, [0, 1])
    loss.sum().backward()
    assert _f(loss) == pytest.approx(0.0, abs=1e-12)
    assert log_q.grad.abs().max() < 1e-12
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        q = torch.softmax(torch.randn(4, generator=g, dtype=torch.float64), -1).tolist()
        assert _f(_topk(p, q, [0, 1])[0]) > 0


def test_gather_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 7, generator=g)
    ids = torch.randint(0, 7, (2, 3, 4), generator=g)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids)
    torch.testing.assert_close(gather_logprobs(logits, ids, 0.7, chunk_tokens=2), expected)
    with pytest.raises(ValueError, match="ids"):
        gather_logprobs(logits, ids[:, :2], 1.0)
