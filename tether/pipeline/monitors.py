"""Monitors: is the run learning, checked on every step while it trains (issue 14, item 5).

One check per failure pattern of the first source document's section 5, each on numbers the step already
measures:

- **exploration**: ``optim/entropy`` below ``min_entropy_ratio`` × its first value, or fewer than
  ``min_distinct_strategies`` strategies per group. Remedy: exploration.entropy_coef, clip_higher, diversity_bonus,
  engine.temperature.
- **signal**: no tool call parsed in the step (``agent/num_tool_calls`` = 0: parser and model disagree; remedy:
  tool_parser.*), ``optim/raw_reward_std_within_group`` below ``min_reward_std``, or
  ``optim/degenerate_group_ratio_before_filter`` above ``max_degenerate_ratio``. Remedy: degenerate_group_filter
  .min_reward_std and .resample_attempts; base_rollouts_per_prompt 8 → 4 with max_rollouts_per_prompt 48.
- **shift**: staleness above ``max_staleness`` (fails at once), KL above ``max_kl``, ``optim/is_masked_fraction``
  above ``max_is_masked_fraction``, or the train–inference mismatch (``rollout/logp_abs_diff_mean`` above
  ``max_logp_abs_diff``, ``rollout/mismatch_kl`` above ``max_mismatch_kl``: the engine not running the trainer's
  weights). Remedy: clip_ratio 0.2 → 0.1, token_level_clipping, tis_enabled, target_kl; update_frequency,
  batch_size; for the mismatch, the weight-sync lines of train.log and model.dtype.
- **hacking**: the flagged fraction rising by ``hacking_rate_rise`` over ``trend_window`` steps while the reward does
  not fall, or reward up
  while success is flat (and the flags not falling) over ``trend_window`` steps. Remedy: anti_hacking.detect_patterns,
  a model rubric (verifier.model_based).

Each fails when its condition holds for ``monitors.patience`` steps in a row (the thresholds are ``monitors.*``).
Each check records ``monitor/<check>`` (1 while failing, else 0) every step, plus the two numbers the monitors
compute themselves (``monitor/distinct_strategies``, ``monitor/hacking_flag_rate``) and ``monitor/failing`` (how
many checks fail). A failing check warns once per run with its diagnosis and remedy; with ``monitors.on_fail:
stop`` the trainer then saves a checkpoint of the step and stops (``MonitorStop``, exit code 3).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tether.algo.diversity import strategy_signature
from tether.config import MonitorsConfig, PolicyOptimConfig
from tether.metrics import record_metric
from tether.types import Group

Row = dict[str, float]


class MonitorStop(Exception):
    """A monitor failed with ``monitors.on_fail: stop``; the step's checkpoint is saved."""

    exit_code = 3

    def __init__(self, findings: list[Finding], step: int, checkpoint: str):
        names = ", ".join(f.check for f in findings)
        super().__init__(f"stopped by the monitors after step {step} ({names}); checkpoint: {checkpoint}")
        self.findings, self.step, self.checkpoint = findings, step, checkpoint


@dataclass(frozen=True)
class Finding:
    check: str  # e.g. "signal/reward_std"
    step: int
    value: float
    message: str  # the measurement, the diagnosis and the remedy, one paragraph

    def __str__(self) -> str:
        return self.message


@dataclass
class Check:
    """``fails(row, history)`` → the offending value, or None when the check holds (or cannot be measured)."""

    name: str
    what: str  # the measurement, with {value:.3g} and the threshold
    diagnosis: str
    remedy: str
    fails: Callable[[Row, deque[Row]], float | None]
    patience: int
    streak: int = 0
    warned: bool = False


def _below(metric: str, bound: float) -> Callable[[Row, deque[Row]], float | None]:
    return lambda row, _: row[metric] if metric in row and row[metric] < bound else None


def _above(metric: str, bound: float) -> Callable[[Row, deque[Row]], float | None]:
    return lambda row, _: row[metric] if metric in row and row[metric] > bound else None


def _entropy_collapse(ratio: float) -> Callable[[Row, deque[Row]], float | None]:
    """``optim/entropy`` below ``ratio`` × the first value seen (kept in the closure: the history is a window)."""
    first: list[float] = []

    def fails(row: Row, _: deque[Row]) -> float | None:
        value = row.get("optim/entropy")
        if value is None or value != value:  # absent or NaN
            return None
        if not first:
            first.append(value)
        return value if value < ratio * first[0] else None
    return fails


def _trend(rows: list[Row], key: str) -> float | None:
    """The mean of ``key`` over the second half of ``rows`` minus its mean over the first (None: not in every row)."""
    if not all(key in r for r in rows):
        return None
    half = len(rows) // 2
    return sum(r[key] for r in rows[-half:]) / half - sum(r[key] for r in rows[:half]) / half


def _window(history: deque[Row], window: int) -> list[Row] | None:
    rows = list(history)[-window:]
    return rows if len(rows) == window else None


def _flags_rising(window: int, rise: float) -> Callable[[Row, deque[Row]], float | None]:
    """The rise of the flagged fraction over the last ``window`` rows, when it is at least ``rise`` and reward/mean did
    not fall over them (flags that rise while the reward falls are the penalties doing their job on a policy that got
    worse, not a pattern that pays)."""
    def fails(_: Row, history: deque[Row]) -> float | None:
        rows = _window(history, window)
        d = None if rows is None else _trend(rows, "monitor/hacking_flag_rate")
        d_reward = None if rows is None else _trend(rows, "reward/mean")
        if d_reward is not None and d_reward < 0:
            return None
        return d if d is not None and d >= rise else None
    return fails


def _reward_without_success(window: int, rise: float) -> Callable[[Row, deque[Row]], float | None]:
    """The rise of reward/mean over the last ``window`` rows when it is at least ``rise``, success rose by less than a
    quarter of it, and the flagged fraction did not fall (a reward that rises because the hacking penalties shrink is
    the policy unlearning a hack, not learning one)."""
    def fails(_: Row, history: deque[Row]) -> float | None:
        rows = _window(history, window)
        if rows is None:
            return None
        d_reward, d_success = _trend(rows, "reward/mean"), _trend(rows, "rollout/success_rate")
        if d_reward is None or d_success is None:
            return None
        d_flags = _trend(rows, "monitor/hacking_flag_rate")
        if d_flags is not None and d_flags < 0:
            return None
        return d_reward if d_reward >= rise and d_success < d_reward / 4 else None
    return fails


def checks(m: MonitorsConfig, po: PolicyOptimConfig, *, parser: str, max_staleness: int) -> list[Check]:
    """The checks with ``monitors.*``'s thresholds; ``po``'s settings are quoted in the remedies, ``parser`` is
    ``tool_parser.name``, ``max_staleness`` the run's staleness bound (``Plan.max_staleness``: in
    ``one_step_off_policy`` it is min(1, rollout.scheduler.max_staleness), not the configured value)."""
    adv = po.advantage.degenerate_group_filter
    p = m.patience
    raise_signal = (f"raise policy_optimization.advantage.degenerate_group_filter.min_reward_std (now "
                    f"{adv.min_reward_std:g}) and .resample_attempts (now {adv.resample_attempts}); check that "
                    "rollout_allocation does not spend the budget on easy tasks: lower "
                    "rollout_allocation.base_rollouts_per_prompt (8 → 4) and give max_rollouts_per_prompt the "
                    "savings (e.g. 48) so hard tasks get more samples")
    shift = ("tighten learner.off_policy_correction.clip_ratio (0.2 → 0.1), check token_level_clipping is on and "
             "tis_enabled: true; loosen kl_control.target_kl (0.01 → 0.02) only if KL settles")
    hacking = ("turn on each pattern of environment.verifier.anti_hacking.detect_patterns and see which fires; "
               "add a model rubric (environment.verifier.model_based) that scores how the task was done, not "
               "only the outcome")
    mismatch = ("check `parameter sync: param_version=N` lines in RUN/train.log (every sync must reach the engine), "
                "that engine and trainer load the same model.dtype, and turn on learner.off_policy_correction "
                "(e.g. token-level truncated importance sampling) so the gap is corrected")
    explore = ("raise policy_optimization.exploration.entropy_coef or clip_higher (e.g. 0.28), enable "
               "exploration.diversity_bonus, or raise engine.temperature")
    return [
        Check("exploration/entropy", "policy entropy {value:.3g} nats < monitors.min_entropy_ratio "
              f"{m.min_entropy_ratio:g} × its value at the first step",
              "exploration collapse: the policy puts almost all mass on one token at each position, so the "
              "rollouts of a group stop differing and the group-relative signal goes with them", explore,
              _entropy_collapse(m.min_entropy_ratio), p),
        Check("exploration/strategies", "{value:.3g} distinct strategies per group < monitors.min_distinct_strategies "
              f"{m.min_distinct_strategies:g}",
              "exploration collapse: the rollouts of a task repeat one tool-call path", explore,
              _below("monitor/distinct_strategies", m.min_distinct_strategies), p),
        Check("signal/no_tool_calls", "{value:.3g} tool calls per trajectory",
              "signal loss: no tool call was parsed from the policy's text, so no episode can do the task — the "
              "model writes calls in a format the parser does not read, or generation stops before the call closes",
              f"tool_parser.name (now {parser}) must match the model's tool-call format, "
              "tool_parser.stop_token_ids must not end a turn inside a call; check with `tether verify env CONFIG "
              "--policy`; an untrained model never calls a tool (warm-start it: model.preset: tiny-sft, tether sft)",
              lambda row, _: row["agent/num_tool_calls"] if row.get("agent/num_tool_calls", 1.0) == 0 else None, p),
        Check("signal/reward_std", "within-group reward std {value:.3g} (before the filter) < monitors.min_reward_std "
              f"{m.min_reward_std:g}",
              "signal loss: the rewards of a group barely differ, advantages are ≈ 0 and the gradient is noise — "
              "most tasks are saturated (always solved) or hopeless (never solved)", raise_signal,
              _below("optim/raw_reward_std_within_group", m.min_reward_std), p),
        Check("signal/degenerate_groups", "{value:.0%} of groups degenerate before the filter > "
              f"monitors.max_degenerate_ratio {m.max_degenerate_ratio:g}",
              "signal loss: nearly every group has equal rewards, the step learns from the few others",
              raise_signal, _above("optim/degenerate_group_ratio_before_filter", m.max_degenerate_ratio), p),
        Check("shift/staleness", "policy version lag {value:.0f} > the staleness bound "
              f"{max_staleness} (rollout.scheduler.max_staleness; at most 1 in one_step_off_policy, 0 in sync)",
              "distribution shift: samples older than the staleness bound reached the learner; the rollouters and "
              "the learner run at mismatched speeds",
              "when tasks hit rollout.worker.task_timeout_s, tune rollout.partial_rollout.segment_length so long "
              "tasks are split; when the learner consumes too fast, lower learner.update_frequency or raise "
              "learner.batch_size",
              _above("rollout/policy_version_lag_max", max_staleness), 1),
        Check("shift/kl", "KL {value:.3g} > policy_optimization.kl_control.max_kl " f"{po.kl_control.max_kl:g}",
              "distribution shift: each update moves the policy too far (long trajectories and stale samples mixed)",
              shift, _above("optim/kl_divergence", po.kl_control.max_kl), p),  # NaN (updates skipped) compares False
        Check("shift/importance_ratio", "{value:.0%} of tokens outside the correction band > "
              f"monitors.max_is_masked_fraction {m.max_is_masked_fraction:g}",
              "distribution shift: the policy that sampled the tokens and the one being trained disagree on many "
              "of them; the off-policy correction discards their gradient", shift,
              _above("optim/is_masked_fraction", m.max_is_masked_fraction), p),
        Check("shift/mismatch", "train–inference mismatch: mean |Δ log π| {value:.3g} > monitors.max_logp_abs_diff "
              f"{m.max_logp_abs_diff:g}",
              "distribution shift: the trainer and the rollout engine give the same tokens different probabilities "
              "under the same weights — the engine is not running the trainer's weights (a weight sync that did not "
              "arrive) or computes too differently (dtype, kernels)", mismatch,
              _above("rollout/logp_abs_diff_mean", m.max_logp_abs_diff), p),
        Check("shift/mismatch_kl", "train–inference mismatch KL {value:.3g} > monitors.max_mismatch_kl "
              f"{m.max_mismatch_kl:g}",
              "distribution shift: the trainer and the rollout engine disagree on the sampled tokens under the same "
              "weights", mismatch, _above("rollout/mismatch_kl", m.max_mismatch_kl), p),
        Check("hacking/flags", "the fraction of trajectories flagged by the anti-hacking detectors rose by {value:.0%} "
              f"over {m.trend_window} steps (monitors.hacking_rate_rise {m.hacking_rate_rise:g})",
              "reward hacking: the policy is learning a pattern the verifier flags (repeated calls, stuffing)",
              hacking, _flags_rising(m.trend_window, m.hacking_rate_rise), 1),
        Check("hacking/reward_without_success", "reward/mean up {value:.3g} over " f"{m.trend_window} steps while "
              "rollout/success_rate stayed flat",
              "reward hacking: the reward rises without the task being solved more often — the policy found "
              "reward the verifier gives for something other than success", hacking,
              _reward_without_success(m.trend_window, m.reward_rise), 1),
    ]


@dataclass
class Monitors:
    """``observe(step, row, groups)`` after each step's metrics are recorded, before its row is written."""

    config: MonitorsConfig
    checks: list[Check]
    history: deque[Row] = field(init=False)  # the last trend_window rows

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.config.trend_window)

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def observe(self, step: int, row: Row, groups: Iterable[Group] = ()) -> list[Finding]:
        """Record the step's ``monitor/*`` metrics; returns the checks that start failing at this step (each
        check once per run). ``groups``: every group delivered for the step, those the degenerate-group filter
        dropped included (their strategies and flags count)."""
        if not self.enabled:
            return []
        row = dict(row)
        delivered = [g for g in groups if g.trajectories]
        if delivered:
            row["monitor/distinct_strategies"] = sum(
                len({strategy_signature(t.messages) for t in g.trajectories}) for g in delivered) / len(delivered)
            trajs = [t for g in delivered for t in g.trajectories]
            row["monitor/hacking_flag_rate"] = sum(any(t.hacking_flags.values()) for t in trajs) / len(trajs)
            for k in ("monitor/distinct_strategies", "monitor/hacking_flag_rate"):
                record_metric(k, row[k], "last")
        self.history.append(row)
        new, failing = [], 0
        for c in self.checks:
            value = c.fails(row, self.history)
            c.streak = c.streak + 1 if value is not None else 0
            on = c.streak >= c.patience
            failing += on
            record_metric(f"monitor/{c.name}", float(on), "last")
            if on and not c.warned:
                c.warned = True
                assert value is not None
                new.append(Finding(c.name, step, value, self._message(c, step, value)))
        record_metric("monitor/failing", failing, "last")
        return new

    def _message(self, c: Check, step: int, value: float) -> str:
        since = f"for {c.streak} steps" if c.patience > 1 else "at"
        return (f"monitor {c.name} failing {since} step {step}: {c.what.format(value=value)}. "
                f"Diagnosis: {c.diagnosis}. Remedy: {c.remedy}.")

    @property
    def stop(self) -> bool:
        return self.enabled and self.config.on_fail == "stop"
