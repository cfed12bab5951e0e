"""``tether verify async``: does a short run of the real async pipeline keep its promises? Checked on every row.

The second source document's checks of an async trainer, each on the metrics the pipeline records per step:

- **staleness bound**: ``rollout/policy_version_lag_max`` ≤ ``rollout.scheduler.max_staleness`` (min(1, it) in
  ``one_step_off_policy``): no model token the learner trains on is older than the bound allows.
- **no degenerate group reaches the learner** with ``degenerate_group_filter.enabled``:
  ``optim/degenerate_group_ratio`` (of the groups trained) = 0.
- **queue accounting balances**: ``queue/total_produced`` = ``total_consumed`` + ``dropped_samples`` +
  ``stale_samples`` + ``queued_samples`` (the value checked is the difference).
- **weight sync at the configured interval**: ``rollout/current_param_version`` = ⌊step / trigger_parameter_sync_step⌋
  after each step (``tether.pipeline.weights``; the value checked is the difference).
- **both sides busy**: ``perf/trainer_idle_ratio`` and ``perf/rollouter_idle_ratio`` < 0.95 on average over the
  steps (one side idle almost all the time means the pipeline runs as slowly as a sync one, or slower).
"""

from __future__ import annotations

from pathlib import Path

from tether.config.plan import Plan
from tether.verify.criteria import Criterion, Report, Rows, VerifyInputError, read_rows
from tether.verify.optim import run_config

MAX_IDLE = 0.95
ACCOUNTING = ("queue/total_consumed", "queue/dropped_samples", "queue/stale_samples", "queue/queued_samples")


def check_mode(mode: str) -> None:
    """``rollout.mode`` must be an async one."""
    if mode == "sync":
        raise VerifyInputError("verify async checks an async pipeline, and rollout.mode is sync (the rollouter and "
                               "the trainer take turns; nothing here could fail): give a config with rollout.mode "
                               "fully_async or one_step_off_policy, or add --set rollout.mode=fully_async")


def check_rows(rows: Rows, plan: Plan, *, degenerate_filter: bool) -> Report:
    """The report of ``rows`` (step → metrics row) against the async pipeline's promises under the run's ``plan``;
    ``degenerate_filter``: ``degenerate_group_filter.enabled``."""
    bound, every = plan.max_staleness, plan.sync_every

    lag = Criterion(
        f"rollout/policy_version_lag_max ≤ max_staleness = {bound}", lambda v: v <= bound,
        diagnosis="the learner trained on tokens sampled by weights older than the staleness bound: admission "
                  "control did not hold the rollouter back (or partial rollouts carried old segments over syncs)",
        remedy="rollout.scheduler.max_staleness (the bound), trainer.trigger_parameter_sync_step (how long a version "
               "lives), buffer.stale_filter.enabled / .max_policy_lag (drop what is too old at consumption), "
               "learner.reuse_policy: on_policy_segment_only with rollout.partial_rollout")
    lag.fill(rows, "rollout/policy_version_lag_max")

    degenerate = Criterion(
        "optim/degenerate_group_ratio = 0 (filter on)", lambda v: v == 0,
        diagnosis="a group whose rewards do not differ reached the learner although the degenerate-group filter is "
                  "on: a group got past the producer's filter (a bug; the step trains on zero advantages)",
        remedy="policy_optimization.advantage.degenerate_group_filter.min_reward_std must equal the threshold the "
               "advantages count with; report the run's metrics.jsonl")
    if degenerate_filter:
        degenerate.fill(rows, "optim/degenerate_group_ratio")
        if not degenerate.values:
            degenerate.note = "no group was trained (every group dropped as degenerate)"
    else:
        degenerate.note = "policy_optimization.advantage.degenerate_group_filter.enabled is false"

    accounting = Criterion(
        "queue/total_produced − (consumed + dropped + stale + queued) = 0", lambda v: v == 0,
        diagnosis="samples were lost or counted twice between the rollouter and the trainer (queue accounting)",
        remedy="a pipeline bug, not a setting: report the run's metrics.jsonl (queue/* columns); "
               "message_queue.max_queue_size and buffer.* only move samples between the counted terms")
    accounting.values = {s: r["queue/total_produced"] - sum(r[k] for k in ACCOUNTING)
                         for s, r in rows.items() if all(k in r for k in ("queue/total_produced", *ACCOUNTING))}
    if not accounting.values:
        accounting.note = "no row has the queue/* counters"

    version = Criterion(
        f"rollout/current_param_version − ⌊step / {every}⌋ = 0", lambda v: v == 0,
        diagnosis=f"the parameter version does not advance by one every trigger_parameter_sync_step = {every} steps: "
                  "the rollouter does not get the weights at the configured interval",
        remedy="trainer.trigger_parameter_sync_step; a version that never advances means the weight sync does not "
               "run (check engine.weight_sync_dir / the engine's update endpoint)")
    version.values = {s: r["rollout/current_param_version"] - s // every
                      for s, r in rows.items() if "rollout/current_param_version" in r}
    if not version.values:
        version.note = "no row has rollout/current_param_version"

    trainer_idle = Criterion(
        f"perf/trainer_idle_ratio < {MAX_IDLE} (mean)", lambda v: v < MAX_IDLE, on_mean=True,
        diagnosis="the trainer waits for rollouts almost all the time: generation is the bottleneck",
        remedy="rollout.worker.max_concurrent_tasks (more rollouts in flight), rollout.scheduler.max_staleness (let "
               "the rollouter run further ahead), fewer rollouts per step (policy_optimization.advantage.group_size)")
    trainer_idle.fill(rows, "perf/trainer_idle_ratio")
    rollouter_idle = Criterion(
        f"perf/rollouter_idle_ratio < {MAX_IDLE} (mean)", lambda v: v < MAX_IDLE, on_mean=True,
        diagnosis="the rollouter waits almost all the time: admission control (max_staleness) or a full queue holds "
                  "it back while the trainer works, so the run is as slow as a sync one",
        remedy="rollout.scheduler.max_staleness (raise), message_queue.max_queue_size, "
               "trainer.trigger_parameter_sync_step (shorter: new versions admit new rollouts sooner)")
    rollouter_idle.fill(rows, "perf/rollouter_idle_ratio")

    steps = sorted(rows)
    title = f"verify async ({plan.mode}): steps {steps[0]}–{steps[-1]}"
    return Report(title, [lag, degenerate, accounting, version, trainer_idle, rollouter_idle])


def verify_run(run_dir: Path, steps: int | None = None) -> Report:
    """The first ``steps`` training steps of an async run (all when None)."""
    if not run_dir.is_dir():
        raise VerifyInputError(f"{run_dir} is not a directory")
    cfg = run_config(run_dir)
    check_mode(cfg.rollout.mode)
    return check_rows(read_rows(run_dir, steps), Plan.of(cfg),
                      degenerate_filter=cfg.policy_optimization.advantage.degenerate_group_filter.enabled)
