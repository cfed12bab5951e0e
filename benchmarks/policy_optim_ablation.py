"""The policy-optimisation mechanisms on the demo, side by side, from one SFT warm start.

    python benchmarks/policy_optim_ablation.py [--sft runs/demo/seed0/sft] [--steps 16] [--only NAME ...]

Runs (each the demo's RL phase, config examples/customer_service/config.yaml plus the overrides below):
  async: fully_async, max_staleness 4, weights pushed every step —
    correction+filter   off-policy correction (double-sided IS + TIS) and the degenerate-group filter on
    no_correction       the same without correction (ratio to the behaviour policy, plain PPO clip)
    no_filter           the same without the filter
  sync, filter off, same number of generated trajectories per step:
    fixed_allocation    8 rollouts for every task
    adaptive_allocation 2..32 rollouts per task ∝ √(reward variance), reallocated every 2 steps
Prints held-out success (before, after, steps to reach --level), generated / trained trajectories, the fraction
of groups with a non-zero advantage (as generated, before any filter) and of trained trajectories with one, the
largest policy lag and KL.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from demo_rl import rl_run, steps_to_reach, warm_start_dir

ASYNC = ["rollout.mode=fully_async", "rollout.scheduler.max_staleness=4", "trainer.trigger_parameter_sync_step=1"]
CORRECTION_ON = ["learner.off_policy_correction.method=double_sided_importance_sampling",
                 "learner.off_policy_correction.tis_enabled=true"]
CORRECTION_OFF = ["learner.off_policy_correction.method=none", "learner.off_policy_correction.tis_enabled=false"]
FILTER = "policy_optimization.advantage.degenerate_group_filter.enabled="
VARIANTS = {
    "correction+filter": [*ASYNC, *CORRECTION_ON, FILTER + "true"],
    "no_correction": [*ASYNC, *CORRECTION_OFF, FILTER + "true"],
    "no_filter": [*ASYNC, *CORRECTION_ON, FILTER + "false"],
    "fixed_allocation": ["rollout.mode=sync", FILTER + "false",
                         "policy_optimization.rollout_allocation.strategy=fixed"],
    "adaptive_allocation": ["rollout.mode=sync", FILTER + "false",
                            "policy_optimization.rollout_allocation.strategy=adaptive",
                            "policy_optimization.rollout_allocation.reallocation_interval=2",
                            "policy_optimization.rollout_allocation.max_rollouts_per_prompt=32"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", type=Path, help="an SFT model folder (demo.py writes RUN/seedN/sft)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--level", type=float, default=0.75, help="held-out success for 'steps to reach'")
    ap.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path, help="keep the run directories here (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    common = [f"trainer.total_steps={args.steps}", f"trainer.eval_every={args.eval_every}", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        sft = warm_start_dir(args.sft, root)
        results = {name: rl_run(sft, root / name, [*VARIANTS[name], *common]) for name in args.only}
    print(f"{args.steps} trainer steps of 64 trajectories from one SFT warm start; eval every {args.eval_every} "
          f"steps on 64 held-out tasks; overrides {args.overrides or 'none'}")
    head = (f"{'variant':20s} {'before':>7s} {'after':>7s} {f'to {args.level:.0%}':>7s} {'generated':>9s} "
            f"{'trained':>8s} {'A≠0 groups':>10s} {'A≠0 trajs':>9s} {'max lag':>7s} {'max KL':>7s} {'wall s':>7s}")
    print(head)
    for name, r in results.items():
        reach = steps_to_reach(r["curve"], args.level)
        print(f"{name:20s} {r['before']:7.1%} {r['after']:7.1%} {str(reach or '-'):>7s} {r['generated']:9.0f} "
              f"{r['trained']:8.0f} {r['informative_groups']:10.1%} {r['informative_samples']:9.1%} "
              f"{r['max_lag']:7.0f} {r['kl_max']:7.3f} "
              f"{r['wall_s']:7.1f}")
    for name, r in results.items():
        print(f"{name}: held-out success by step {dict(sorted(r['curve'].items()))}")


if __name__ == "__main__":
    main()
