import math

import pytest
import torch

from tether.algo import AdaptiveKLController, FixedKLController, exceeds_max_kl, kl_controller


def test_adaptive_controller_hand_computed():
    c = AdaptiveKLController(init_coef=0.001, target_kl=0.01, horizon=10_000)
    c.update(0.02, n_steps=64)  # e = clip(0.02/0.01 − 1 = 1, ±0.2) = 0.2 → β·(1 + 0.2·64/10000) = β·1.00128
    assert c.value == pytest.approx(0.00100128, rel=1e-12)
    c.update(0.011, n_steps=64)  # e = 0.1 → ·1.00064 → 0.00100128 · 1.00064 = 0.0010019208192
    assert c.value == pytest.approx(0.0010019208192, rel=1e-12)
    c.update(0.01, n_steps=64)  # on target: e = 0, unchanged
    assert c.value == pytest.approx(0.0010019208192, rel=1e-12)
    c.update(0.0, n_steps=64)  # e = clip(−1) = −0.2 → ·(1 − 0.00128) = ·0.99872
    assert c.value == pytest.approx(0.0010019208192 * 0.99872, rel=1e-12)
    assert c.metrics() == {"kl_coef": c.value}


def test_adaptive_error_is_clipped():
    c = AdaptiveKLController(init_coef=0.1, target_kl=0.01, horizon=100)
    c.update(100.0, n_steps=100)  # KL 10⁴ × target: e still 0.2, and n_steps = horizon → β·1.2
    assert c.value == pytest.approx(0.12)


def test_fixed_controller_and_factory():
    c = FixedKLController(0.04)
    c.update(5.0, n_steps=64)
    assert c.value == 0.04 and c.metrics() == {"kl_coef": 0.04}
    assert type(kl_controller(adaptive=False, init_coef=0.04, target_kl=0.01)) is FixedKLController
    a = kl_controller(adaptive=True, init_coef=0.001, target_kl=0.01)
    assert isinstance(a, AdaptiveKLController) and a.horizon == 10_000


def test_validation():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.001, target_kl=0.0)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.001, target_kl=0.01, horizon=0)
    with pytest.raises(ValueError, match="init_coef"):
        FixedKLController(-1.0)
    c = AdaptiveKLController(0.001, target_kl=0.01)
    with pytest.raises(ValueError, match="current_kl must be finite"):
        c.update(math.nan, n_steps=8)
    with pytest.raises(ValueError, match="n_steps"):
        c.update(0.01, n_steps=0)
    assert c.value == 0.001  # a rejected update leaves β alone


def test_max_kl_guard():
    assert not exceeds_max_kl(0.05, 0.05)  # equal is not above
    assert exceeds_max_kl(0.0501, 0.05)
    assert exceeds_max_kl(torch.tensor(0.06), 0.05) and not exceeds_max_kl(torch.tensor(0.01), 0.05)
    assert exceeds_max_kl(math.nan, 0.05) and exceeds_max_kl(math.inf, 0.05)  # a broken estimate stops the step
    with pytest.raises(ValueError, match="max_kl"):
        exceeds_max_kl(0.01, 0.0)
