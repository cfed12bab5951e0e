"""Anti-hacking flags on every tau2 gold trajectory (mock, retail, airline: 173), per domain and pattern.

    python benchmarks/tau2_gold_flags.py [--set environment.verifier.anti_hacking.repeat_window=4 ...]

Each gold trajectory (the task's gold actions, then the message to the user) is played through the adapter under
the default config of ``tau2:<domain>`` plus the ``--set`` overrides (``tether.env.tau2.gold``, unscored: the call
patterns are judged per step). tau2 scores every one 1, so each flag is a false positive; ``ended_early`` counts the
ones the limits cut. Prints one line per domain: the table, the flagged tasks and the cut ones.
"""

from __future__ import annotations

import argparse
import time

from tether.config import load_config
from tether.env.tau2.gold import flag_table, replay_gold


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--domains", nargs="+", default=["mock", "retail", "airline"])
    args = ap.parse_args()
    for domain in args.domains:
        t0 = time.perf_counter()
        environment = load_config([], [f"environment.name=tau2:{domain}", *args.overrides]).environment
        replays = replay_gold(domain, environment, score=False)
        flagged = {r.task_id: r.flags for r in replays if r.false_positive}
        cut = [(r.task_id, r.steps, r.script_steps) for r in replays if r.steps < r.script_steps]
        print(f"{domain}: {flag_table(replays)[domain]} flagged {flagged} cut {cut} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
