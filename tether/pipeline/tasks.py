"""Which train tasks each step draws: endless shuffled epochs, optionally skipping tasks that no longer teach.

Off (``policy_optimization.task_selection.enabled: false``): ``batch(step)`` is the step's slice of the endless
order — epoch e is a permutation of the tasks drawn from (seed, e) — a function of (seed, step) alone.

On: the same order, read from a cursor. A task whose last ``window`` groups (the first attempts of its own groups,
reported by ``observe``) were all degenerate is *decided* — always passed or always failed, nothing to learn from —
and is passed over until ``skip_steps`` steps after it was decided. A task not drawn before (with hundreds of
tasks, most of a run's draws) is judged by its kind's last ``window`` groups instead, as the rollout allocation
takes a kind's statistics for an unseen task; then it is drawn again where the order reaches
it (a re-probe: one more degenerate group decides it again, an informative one keeps it in). The passed-over
places go to the next tasks of the order (a task drawn once in a step is passed over, not drawn twice). When every
task is decided the order's next task is drawn anyway. Each
step's list is fixed the first time it is asked for (the source asks ahead in the async modes) and kept, with the
cursor and the history, in the checkpoint, so a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import random
import threading
from collections import Counter, deque
from typing import Any

from tether.config.policy import TaskSelectionConfig
from tether.metrics import record_metric
from tether.types import Task


class TaskSampler:
    def __init__(self, tasks: list[Task], per_step: int, seed: int,
                 selection: TaskSelectionConfig | None = None):
        selection = selection or TaskSelectionConfig()
        if not tasks:
            raise ValueError("the environment has no train tasks")
        self.tasks, self.per_step, self.seed, self.selection = tasks, per_step, seed, selection
        self._by_id = {t.id: t for t in tasks}
        self._lock = threading.Lock()
        self._batches: dict[int, list[str]] = {}  # step -> task ids, fixed when first asked for (selection on)
        self._cursor = 0  # the next position of the endless order (selection on)
        self._history: dict[str, deque[bool]] = {}  # task id -> its last `window` groups: degenerate?
        self._decided_at: dict[str, int] = {}  # task id -> the step whose groups decided it

    def _at(self, k: int) -> Task:
        n = len(self.tasks)
        epoch, i = divmod(k, n)
        return self.tasks[random.Random(self.seed * 1_000_003 + epoch).sample(range(n), n)[i]]

    def replacement(self, step: int, index: int, attempt: int) -> Task:
        """The train task that resample attempt ``attempt`` of group ``index`` of ``step`` generates instead of the
        group's own (``degenerate_group_filter.resample: new_task``): a function of (seed, step, index, attempt),
        never the group's own task."""
        own = self.batch(step)[index]
        pool = [t for t in self.tasks if t.id != own.id] or [own]
        return random.Random(f"{self.seed}:resample:{step}:{index}:{attempt}").choice(pool)

    def batch(self, step: int) -> list[Task]:
        if not self.selection.enabled:
            return [self._at(k) for k in range((step - 1) * self.per_step, step * self.per_step)]
        with self._lock:
            last = max(self._batches, default=0)
            for s in range(last + 1, step + 1):  # in order: each list moves the cursor
                self._batches[s] = self._draw(s)
            return [self._by_id[i] for i in self._batches[step]]

    def _key(self, task: Task) -> str:
        """Whose history judges ``task``: its own once it has one, else its kind's (``kind:<kind>``)."""
        return task.id if task.id in self._history else f"kind:{task.kind}"

    def _skipped(self, task: Task, step: int) -> bool:
        at = self._decided_at.get(self._key(task))
        return at is not None and step < at + self.selection.skip_steps

    def _draw(self, step: int) -> list[str]:
        out: list[str] = []
        passed_over = 0
        while len(out) < self.per_step:
            for _ in range(len(self.tasks)):  # the next task of the order that is neither skipped nor drawn already
                task = self._at(self._cursor)
                self._cursor += 1
                if self._skipped(task, step):
                    passed_over += 1
                elif task.id not in out or len(out) >= len(self.tasks):
                    break
            out.append(task.id)  # (every task skipped: the order's next one anyway)
        kinds = Counter(self._by_id[i].kind for i in out)
        record_metric("tasks/skipped", passed_over, "sum")
        record_metric("tasks/decided", sum(self._skipped(t, step) for t in self.tasks), "last")
        for kind, n in kinds.items():
            record_metric(f"tasks/draws/{kind}", n, "sum")
        # the share of this step's tasks whose last group was degenerate: what the history predicts
        last = [h[-1] for i in out if (h := self._history.get(self._key(self._by_id[i]))) is not None and h]
        record_metric("tasks/predicted_degenerate_ratio", sum(last) / len(out))
        return out

    def observe(self, produced: list[Any], step: int) -> None:
        """The groups the trainer took at ``step``: each one's first attempt, degenerate or not (``Produced``)."""
        if not self.selection.enabled:
            return
        with self._lock:
            for p in produced:
                if p.failed:
                    continue
                drawn = self._batches.get(p.step)  # the task it was drawn for (resample: new_task generates others)
                task_id = drawn[p.index] if drawn is not None and p.index < len(drawn) else p.group.task_id
                kind = self._by_id[task_id].kind if task_id in self._by_id else None
                for key in (task_id, *([f"kind:{kind}"] if kind is not None else [])):
                    history = self._history.setdefault(key, deque(maxlen=self.selection.window))
                    history.append(bool(p.first_degenerate))
                    if len(history) == self.selection.window and all(history):
                        self._decided_at[key] = step
                    else:
                        self._decided_at.pop(key, None)

    def state_dict(self) -> dict:
        with self._lock:
            return {"batches": {str(s): ids for s, ids in self._batches.items()}, "cursor": self._cursor,
                    "history": {t: list(h) for t, h in self._history.items()}, "decided_at": dict(self._decided_at)}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        with self._lock:
            self._batches = {int(s): list(ids) for s, ids in state["batches"].items()}
            self._cursor = int(state["cursor"])
            self._history = {t: deque(h, maxlen=self.selection.window) for t, h in state["history"].items()}
            self._decided_at = {t: int(s) for t, s in state["decided_at"].items()}
