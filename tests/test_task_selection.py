"""policy_optimization.task_selection: tasks whose groups stopped teaching are skipped for a while, then re-probed."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import read_rows
from tether.config.policy import TaskSelectionConfig
from tether.metrics import MetricsRecorder, set_recorder
from tether.pipeline.tasks import TaskSampler
from tether.types import Group, Task


def produced(sampler: TaskSampler, step: int, degenerate: set[str]) -> list:
    """The step's groups as the trainer takes them: degenerate when their task is in ``degenerate``."""
    return [SimpleNamespace(group=Group(t.id, []), step=step, index=i, first_degenerate=t.id in degenerate,
                            failed=False) for i, t in enumerate(sampler.batch(step))]


def ids(tasks: list[Task]) -> list[str]:
    return [t.id for t in tasks]


def test_off_is_the_shuffled_epochs():
    tasks = [Task(f"t{i}", "train", "k") for i in range(6)]
    sampler = TaskSampler(tasks, 4, seed=1)
    first_two = ids(sampler.batch(1)) + ids(sampler.batch(2))
    assert sorted(first_two[:6]) == [f"t{i}" for i in range(6)]  # epoch 0 is a permutation
    assert ids(sampler.batch(2)) == ids(TaskSampler(tasks, 4, seed=1).batch(2))  # a function of (seed, step)
    sampler.observe(produced(sampler, 1, {"t0", "t1", "t2", "t3", "t4", "t5"}), 1)  # off: ignored
    assert ids(sampler.batch(3)) == ids(TaskSampler(tasks, 4, seed=1).batch(3))


def test_decided_tasks_are_skipped_then_re_probed_and_resume_draws_the_same():
    set_recorder(recorder := MetricsRecorder())
    tasks = [Task(f"t{i}", "train", "k") for i in range(4)]
    sel = TaskSelectionConfig(enabled=True, window=2, skip_steps=3)
    sampler = TaskSampler(tasks, 2, seed=0, selection=sel)
    plain = TaskSampler(tasks, 2, seed=0)
    always = {"t0", "t1"}  # always degenerate: decided at their second group
    seen, decided = [], []
    for step in range(1, 9):
        decided.append(dict(sampler._decided_at))
        seen.append(ids(sampler.batch(step)))
        if step == 4:
            saved = sampler.state_dict()
        sampler.observe(produced(sampler, step, always), step)
    # the plain order until something is decided: t3 t1 | t0 t2 | t1 t2 | t0 t3
    assert seen[:4] == [ids(plain.batch(s)) for s in range(1, 5)] == [["t3", "t1"], ["t0", "t2"], ["t1", "t2"],
                                                                      ["t0", "t3"]]
    assert decided[3] == {"t1": 3} and decided[4] == {"t1": 3, "t0": 4}  # each at its second degenerate group
    for step, (batch, at) in enumerate(zip(seen, decided), start=1):
        assert not [t for t in batch if t in at and step < at[t] + 3], step  # a skipped task is never drawn
        assert len(set(batch)) == 2  # no task twice in a step while others can be drawn
    assert seen[4] == ["t3", "t2"]  # step 5: t0 and t1 passed over, their places to the next in the order
    assert "t1" in seen[5] and "t0" in seen[6]  # re-probed at decided + skip_steps (steps 6 and 7) ...
    assert decided[6]["t1"] == 6 and decided[7]["t0"] == 7  # ... and decided again by one more degenerate group
    assert recorder.flush(8)["tasks/decided"] == 2  # at step 8: t1 (decided again at 6) and t0 (at 7) skipped
    # a resumed sampler (state after drawing step 4) draws steps 5-8 as this one did
    resumed = TaskSampler(tasks, 2, seed=0, selection=sel)
    resumed.load_state_dict(saved)
    for step in range(4, 9):
        if step > 4:
            assert ids(resumed.batch(step)) == seen[step - 1]
        resumed.observe(produced(resumed, step, always), step)


def test_every_task_decided_still_fills_the_step():
    tasks = [Task(f"t{i}", "train", "k") for i in range(3)]
    sampler = TaskSampler(tasks, 2, seed=0, selection=TaskSelectionConfig(enabled=True, window=1, skip_steps=50))
    for step in range(1, 4):
        sampler.observe(produced(sampler, step, {"t0", "t1", "t2"}), step)
    assert len(sampler.batch(4)) == 2 and len(sampler.batch(5)) == 2


def test_the_key_changes_which_tasks_a_run_trains(small_run):
    """The tiny untrained model's groups are mostly degenerate: with selection on, later steps skip their tasks."""
    overrides = ("trainer.total_steps=6", "trainer.save_every=6", "environment.num_train_tasks=6")
    _, off_samples, off_dir = small_run("off", *overrides)
    _, on_samples, on_dir = small_run("on", *overrides, "policy_optimization.task_selection.enabled=true",
                                      "policy_optimization.task_selection.window=1")
    off_tasks = [r["task_ids"] for r in off_samples]
    on_tasks = [r["task_ids"] for r in on_samples]
    assert off_tasks[0] == on_tasks[0] and off_tasks != on_tasks
    rows = [r for r in read_rows(on_dir) if "tasks/skipped" in r]
    assert sum(r["tasks/skipped"] for r in rows) > 0
    assert not any("tasks/skipped" in r for r in read_rows(off_dir))


def test_a_task_not_drawn_yet_is_judged_by_its_kind():
    """Eight tasks drawn once each in the first epoch: after two degenerate groups of kind "easy", the unseen "easy"
    tasks are passed over; "hard" ones (informative groups) are not."""
    tasks = [Task(f"e{i}", "train", "easy") for i in range(4)] + [Task(f"h{i}", "train", "hard") for i in range(4)]
    sampler = TaskSampler(tasks, 1, seed=0, selection=TaskSelectionConfig(enabled=True, window=2, skip_steps=50))
    plain = [ids(TaskSampler(tasks, 1, seed=0).batch(s))[0] for s in range(1, 17)]
    drawn = []
    for step in range(1, 9):
        drawn += ids(sampler.batch(step))
        sampler.observe(produced(sampler, step, {t.id for t in tasks if t.kind == "easy"}), step)
    first_two_easy = [i for i, t in enumerate(plain) if t.startswith("e")][:2]
    decided = first_two_easy[1] + 1  # the step whose group decided the kind
    assert drawn[:decided] == plain[:decided]
    later_easy = [t for t in drawn[decided:] if t.startswith("e")]
    assert later_easy and set(later_easy) <= set(drawn[:decided])  # no unseen easy task: only those with a history
    # the order with the unseen easy tasks taken out (a seen one is judged by its own single group: drawn)
    expected = [t for t in plain[decided:] if not (t.startswith("e") and t not in drawn[:decided])]
    assert drawn[decided:decided + 4] == expected[:4]
