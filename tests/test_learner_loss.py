"""loss_fn: a micro-batch's loss from LossInputs, by hand (undivided: denominator 1, Accumulation divides)."""

from __future__ import annotations

import math

import pytest
import torch

from tether.config.policy import PolicyOptimConfig
from tether.config.sections import OffPolicyCorrectionConfig
from tether.learner.loss import LossInputs, loss_fn
from tether.learner.objective import Objective


def inputs(**kw) -> LossInputs:
    # one row, three positions, the third masked out; on-policy: logp = behav_logp, so r = 1
    base = dict(logp=torch.tensor([[-1.0, -2.0, -7.0]]), prox_logp=None, behav_logp=torch.tensor([[-1.0, -2.0, -7.0]]),
                advantages=torch.tensor([2.0]), mask=torch.tensor([[1.0, 1.0, 0.0]]),
                entropy=torch.tensor([[1.0, 3.0, 9.0]]), ref_logp=torch.tensor([[-1.5, -2.0, 0.0]]))
    return LossInputs(**{**base, **kw})


def objective(algorithm: str = "dapo", correction: str = "none") -> Objective:  # dapo: token_mean
    po, opc = PolicyOptimConfig(algorithm=algorithm), OffPolicyCorrectionConfig(method=correction)
    return Objective.from_config(po, opc, max_response_tokens=8)


def test_loss_is_the_undivided_sum_of_its_terms():
    out = loss_fn(inputs(), objective(), entropy_coef=0.01, kl_coef=0.1, kl_estimator="k1")
    # pg: ℓ_t = −A·r = −2 on the two model tokens → Σ = −4 (denominator 1)
    # entropy bonus: −0.01 · (1 + 3) = −0.04; KL k1 = logp − ref = [0.5, 0] → 0.1 · 0.5 = 0.05
    assert out.loss.item() == pytest.approx(-4.0 - 0.04 + 0.05)
    assert out.metrics["optim/entropy"].item() == pytest.approx(2.0)  # per-token mean over the mask
    assert out.metrics["optim/kl_divergence"].item() == pytest.approx(0.25)
    assert out.metrics["optim/clip_ratio_low"].item() == 0.0 and out.metrics["optim/clip_ratio_high"].item() == 0.0
    assert "optim/is_ratio_mean" not in out.metrics  # π_prox = π_behav: no correction


def test_entropy_off_and_kl_off_leave_the_policy_gradient_term():
    out = loss_fn(inputs(ref_logp=None), objective(), entropy_coef=0.0, kl_coef=0.1, kl_estimator="k1")
    assert out.loss.item() == pytest.approx(-4.0)
    assert "optim/kl_divergence" not in out.metrics and out.metrics["optim/entropy"].item() == pytest.approx(2.0)


def test_a_scored_prox_applies_the_correction_around_it():
    # π_prox/π_behav = e^0.5 on the first token, 1 on the second; double-sided band ε = 0.2 (default clip_ratio)
    # masks the first (1.65 > 1.2); the ratio to π_prox is 1, so ℓ = −A·w = [0, −2] → Σ = −2
    prox = torch.tensor([[-0.5, -2.0, -7.0]])
    out = loss_fn(inputs(logp=prox.clone(), prox_logp=prox, ref_logp=None),
                  objective(correction="double_sided_importance_sampling"), entropy_coef=0.0, kl_coef=0.0,
                  kl_estimator="k1")
    assert out.loss.item() == pytest.approx(-2.0)
    assert out.metrics["optim/is_masked_fraction"].item() == pytest.approx(0.5)
    assert out.metrics["optim/is_ratio_mean"].item() == pytest.approx((math.exp(0.5) + 1) / 2)
    assert out.metrics["optim/is_log_ratio_abs"].item() == pytest.approx((0.5 + 0.0) / 2)
