"""Which groups have left the pipeline for good, so that a resumed run neither repeats nor loses one.

A group is named by ``(task_step, index)``: the step whose task list it came from (``TaskSampler.batch``) and
its position in that list. The producer makes exactly these groups, in this order, in every mode. A group is
**settled** once it reached the trainer (trained, or dropped by the degenerate-group filter), or was removed as
stale, or evicted from the replay buffer: it is never produced again. Everything else — queued, held in the
replay buffer, or in flight when the run stopped — is not settled, and a resumed run produces it again, from
its deterministic seeds, under the weights of the moment (``rollout/regenerated_after_resume`` counts them).

In ``sync`` mode the groups of step s are settled by step s, so the frontier is simply the last step. In the
async modes the trainer may have taken groups of later task steps and left earlier ones behind; the ledger
keeps the frontier (every group of every task step up to it is settled) plus the settled indices beyond it, which
is small: the async bound keeps it within ``max_staleness + 1`` sync intervals.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any


class Ledger:
    def __init__(self, groups_per_step: int, state: dict[str, Any] | None = None):
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.groups_per_step = groups_per_step
        self.frontier = 0  # every group of task steps 1..frontier is settled
        self._beyond: dict[int, set[int]] = defaultdict(set)  # task step > frontier -> settled indices
        if state is not None:
            self.frontier = int(state["frontier"])
            for step, indices in state["beyond"].items():
                self._beyond[int(step)] = set(indices)

    def settle(self, step: int, index: int) -> None:
        if self.is_settled(step, index):
            raise ValueError(f"group (task step {step}, index {index}) settled twice")
        self._beyond[step].add(index)
        while len(self._beyond.get(self.frontier + 1, ())) == self.groups_per_step:
            del self._beyond[self.frontier + 1]
            self.frontier += 1

    def is_settled(self, step: int, index: int) -> bool:
        return step <= self.frontier or index in self._beyond.get(step, ())

    def open_before(self, step: int) -> int:
        """Groups of task steps up to ``step`` not settled (what a resume at ``step`` must make again)."""
        return sum(self.groups_per_step - len(self._beyond.get(s, ())) for s in range(self.frontier + 1, step + 1))

    def plan(self) -> Iterator[tuple[int, int]]:
        """The groups to produce, in order, from the first unsettled one on (endless)."""
        step = self.frontier
        while True:
            step += 1
            for index in range(self.groups_per_step):
                if not self.is_settled(step, index):
                    yield step, index

    def state_dict(self) -> dict[str, Any]:
        return {"frontier": self.frontier, "beyond": {str(s): sorted(ix) for s, ix in self._beyond.items() if ix}}
