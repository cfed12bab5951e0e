"""``tether verify optim``: is the optimisation getting a signal, and is it stable? Checked step by step.

The first source document's criteria (section 4, step 3), measured where they can fail:

- **learning signal**: ``optim/raw_reward_std_within_group`` > 0.1 — the mean within-group reward std of every
  group the step generated, before the degenerate-group filter (``tether.pipeline.shaping``). The document's
  ``advantage_std > 0.1`` taken on ``optim/advantage_std`` cannot fail here: that one is measured after the
  filter and after group normalisation, so it reads ≈ √((n−1)/n) (0.94 for n = 8) whenever one group is
  informative. ``optim/advantage_std_before_filter`` is printed beside it for reference. Up to a quarter of the
  steps may fail (``SIGNAL_TOLERANCE``): on a step whose first attempts happen to agree (late in a run that
  solves most tasks) the filter resamples, and the demo has 2 such steps of 16; a collapse persists.
- **gradient norm**: ``optim/grad_norm`` in [0.1, 10] (the norm before clipping; NaN — every update of the
  step skipped, e.g. by the max-KL guard — fails).
- **KL**: ``optim/kl_divergence`` < ``policy_optimization.kl_control.max_kl`` of the run's ``config.yaml`` (not
  checked with ``kl_control.type: none``, which has no bound).
"""

from __future__ import annotations

import math
from pathlib import Path

from tether.config import ConfigError, KLControlConfig, RunConfig, load_config
from tether.verify.criteria import Criterion, Report, Rows, VerifyInputError, read_rows

MIN_REWARD_STD = 0.1
GRAD_NORM_RANGE = (0.1, 10.0)
SIGNAL_TOLERANCE = 0.25  # the fraction of steps whose raw reward std may be at most MIN_REWARD_STD


def criteria(kl: KLControlConfig) -> list[Criterion]:
    """The three criteria, with the run's KL bound (``policy_optimization.kl_control``; values not filled)."""
    lo, hi = GRAD_NORM_RANGE
    signal = Criterion(
        f"optim/raw_reward_std_within_group > {MIN_REWARD_STD} (on ≥ {1 - SIGNAL_TOLERANCE:.0%} of steps)",
        lambda v: v > MIN_REWARD_STD,
        tolerance=SIGNAL_TOLERANCE,
        diagnosis="signal collapse: the rewards within a group barely differ, so group-relative advantages are "
                  "≈ 0 and the policy gets no gradient from most groups (every rollout fails, or every one "
                  "succeeds, or the reward does not separate them)",
        remedy="raise policy_optimization.advantage.degenerate_group_filter.min_reward_std and "
               ".resample_attempts (degenerate groups regenerated, not trained); warm-start the policy "
               "(`tether sft`, or model.preset: tiny-sft) when nothing succeeds; more rollouts per task "
               "(policy_optimization.advantage.group_size) or a higher engine.temperature for diversity")
    grad = Criterion(
        f"optim/grad_norm in [{lo:g}, {hi:g}]", lambda v: lo <= v <= hi,
        diagnosis="gradient norm out of range: below it the updates do not move the policy (vanishing signal or "
                  "every advantage 0); above it (or NaN: every update skipped) the updates are unstable",
        remedy="policy_optimization.optimizer.lr (lower when too large, raise when too small), "
               "policy_optimization.optimizer.max_grad_norm (clips the update), "
               "policy_optimization.optimizer.warmup_steps")
    max_kl = kl.max_kl
    kl_c = Criterion(
        f"optim/kl_divergence < max_kl = {max_kl:g}", lambda v: v < max_kl,
        diagnosis="the policy drifts from the reference faster than the KL bound allows (distribution shift): "
                  "steps past max_kl skip their remaining updates",
        remedy="lower policy_optimization.optimizer.lr, or decay it (.lr_scheduler: cosine); tighten the clip "
               "(learner.off_policy_correction.clip_ratio, "
               "policy_optimization.clip_ratio_low / clip_ratio_high); stronger KL control "
               "(policy_optimization.kl_control.init_coef, .target_kl, adaptive: true with a shorter .horizon)")
    if kl.type == "none":
        kl_c.note = "policy_optimization.kl_control.type is none: no KL bound"
    return [signal, grad, kl_c]


def check_rows(rows: Rows, kl_control: KLControlConfig) -> Report:
    """The report of ``rows`` (step → metrics row) against the criteria, with the run's ``kl_control``."""
    signal, grad, kl = criteria(kl_control)
    signal.fill(rows, "optim/raw_reward_std_within_group")
    if not signal.values:
        signal.note = ("no row has optim/raw_reward_std_within_group (a run from before it was recorded; "
                       "optim/advantage_std cannot fail, see `tether verify optim --help`)")
    grad.fill(rows, "optim/grad_norm")
    if kl_control.type != "none":
        kl.fill(rows, "optim/kl_divergence")
    notes = []
    means = {k: _mean(rows, k) for k in ("optim/advantage_std", "optim/advantage_std_before_filter",
                                         "optim/degenerate_group_ratio_before_filter")}
    if any(not math.isnan(v) for v in means.values()):
        notes.append("for reference, means over the steps: " + ", ".join(
            f"{k} {v:.3g}" for k, v in means.items() if not math.isnan(v))
            + " (optim/advantage_std is after the filter and normalisation: ≈ 0.94 whenever a group is informative)")
    steps = sorted(rows)
    return Report(f"verify optim: steps {steps[0]}–{steps[-1]}", [signal, grad, kl], notes)


def _mean(rows: Rows, key: str) -> float:
    values = [float(r[key]) for r in rows.values() if key in r]
    return math.fsum(values) / len(values) if values else math.nan


def run_config(run_dir: Path) -> RunConfig:
    """The run's recorded ``config.yaml``."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise VerifyInputError(f"{path} does not exist: a run directory holds the config.yaml tether train wrote")
    try:
        return load_config([path])
    except ConfigError as e:
        raise VerifyInputError(f"{path}: {e}") from None


def verify_run(run_dir: Path, steps: int | None = None) -> Report:
    """``verify optim RUN_DIR``: the first ``steps`` training steps of the run (all when None)."""
    if not run_dir.is_dir():
        raise VerifyInputError(f"{run_dir} is not a directory")
    return check_rows(read_rows(run_dir, steps), run_config(run_dir).policy_optimization.kl_control)
