"""KL-coefficient control and the max-KL guard.

The coefficient β of the KL-to-reference term (``kl.kl_penalty``) is either fixed or steered towards a target:

    e = clip(KL / KL_target − 1, −0.2, 0.2)          proportional error, clipped
    β ← β · (1 + e · n_steps / horizon)              Ziegler et al. 2019 (arXiv 1909.08593), §2.2

the same update as verl's ``AdaptiveKLController`` (``algorithm.kl_ctrl``: horizon 10000; n_steps = the batch's
sample count). Where it is used differs: verl steers only the KL penalty *in the reward* (``use_kl_in_reward``,
KL = mean over sequences of each sequence's token-mean k1 by default) and keeps the actor's KL *loss* coefficient
``kl_loss_coef`` fixed; here the controller steers β of the KL loss term (there is no in-reward KL), with KL =
the step's token-mean of the configured estimator.
The clip bounds one update's change of β to ±20 % · n_steps / horizon, so one noisy KL estimate cannot swing it.

``exceeds_max_kl`` is a hard guard, not a controller: the learner stops the remaining optimizer updates of a
step once the measured KL passes ``max_kl``, like PPO's early stopping on approximate KL (OpenAI Spinning Up and
stable-baselines3 stop a step's epochs at KL > 1.5 × target_kl). A non-finite KL counts as exceeding.

Controllers are small stateful objects; the step's coefficient is ``.value`` and its metric ``kl_coef``.
"""

from __future__ import annotations

import math

import torch


class FixedKLController:
    """β stays ``init_coef``."""

    def __init__(self, init_coef: float):
        if not init_coef >= 0.0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        self.value = float(init_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (same signature as the adaptive controller)."""

    def metrics(self) -> dict[str, float]:
        return {"kl_coef": self.value}


class AdaptiveKLController(FixedKLController):
    """Proportional controller of β towards ``target_kl`` (formula in the module docstring)."""

    def __init__(self, init_coef: float, target_kl: float, horizon: int = 10_000):
        super().__init__(init_coef)
        if not target_kl > 0.0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.target_kl, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """β ← β·(1 + clip(KL/target − 1, ±0.2)·n_steps/horizon), with KL the step's mean per-token estimate."""
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}; skip the update for this step instead")
        if n_steps <= 0:
            raise ValueError(f"n_steps must be > 0, got {n_steps}")
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def kl_controller(
    *, adaptive: bool, init_coef: float, target_kl: float, horizon: int = 10_000
) -> FixedKLController | AdaptiveKLController:
    """The controller the ``kl_control`` config section asks for."""
    if adaptive:
        return AdaptiveKLController(init_coef, target_kl, horizon)
    return FixedKLController(init_coef)


def exceeds_max_kl(kl: float | torch.Tensor, max_kl: float) -> bool:
    """True when the measured KL is above ``max_kl`` (or is NaN/inf): stop this step's remaining updates."""
    if not max_kl > 0.0:
        raise ValueError(f"max_kl must be > 0, got {max_kl}")
    value = float(kl)
    return not math.isfinite(value) or value > max_kl
