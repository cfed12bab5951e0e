"""The trainer's batch shaping: diversity bonus, degenerate-group resampling/dropping, adaptive allocation."""

from __future__ import annotations

import asyncio

import pytest

from conftest import batch_source, group_producer, rollout_allocator
from tether.config import RunConfig
from tether.pipeline.shaping import (
    Produced,
    add_diversity_bonus,
    no_signal_warning,
    record_production_metrics,
)
from tether.types import Group, Task, Trajectory


def traj(reward, success=None, calls=(), answer="done"):
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]},
        {"role": "assistant", "content": answer}]
    return Trajectory("t", [1], reward=reward, success=bool(reward) if success is None else success, messages=messages)


def group(task_id, rewards):
    return Group(task_id, [traj(r) for r in rewards])


class ScriptedRollouter:
    """Returns the next scripted group of rewards for a task, and records each call."""

    def __init__(self, script):
        self.script, self.calls = {k: list(v) for k, v in script.items()}, []

    async def group(self, task, n, seed):
        self.calls.append((task.id, n, seed))
        return group(task.id, self.script[task.id].pop(0))


def cfg(**filter_cfg):
    return RunConfig.model_validate({"policy_optimization": {"advantage": {
        "group_size": 4, "degenerate_group_filter": {"min_reward_std": 0.1, "resample_attempts": 2, **filter_cfg}}}})


def produce_all(producer, tasks, step):
    async def run():
        return await asyncio.gather(*(producer.produce(t, 4, step, k) for k, t in enumerate(tasks)))
    return asyncio.run(run())


def test_degenerate_groups_are_resampled_then_dropped(metrics):
    tasks = [Task(k, "train", "refund") for k in "ABC"]
    rollouter = ScriptedRollouter({"A": [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 1]],  # 2nd resample informative
                                   "B": [[0, 1, 0, 1]],
                                   "C": [[0.5] * 4, [1, 1, 1, 1], [0, 0, 0, 0]]})  # degenerate after 2: dropped
    out = produce_all(group_producer(cfg(), rollouter), tasks, step=3)
    assert [p.dropped for p in out] == [False, False, True]
    # the bonus is added to the kept attempt: three successes of one strategy share 0.05 → 1 + 0.05/3 each
    assert out[0].group.rewards == pytest.approx([1 + 0.05 / 3, 0, 1 + 0.05 / 3, 1 + 0.05 / 3])
    assert [(p.resampled, p.resampled_trajectories, p.first_degenerate) for p in out] == [
        (2, 8, True), (0, 0, False), (2, 8, True)]
    seeds = [c[2] for c in rollouter.calls]
    assert len(seeds) == 7 and len(set(seeds) - {seeds[0]}) == 4  # first attempts share the step seed
    record_production_metrics(out)
    row = metrics.flush(3)
    assert row["optim/degenerate_group_ratio_before_filter"] == pytest.approx(2 / 3)
    assert (row["rollout/resampled_groups"], row["rollout/dropped_groups"]) == (4, 1)
    assert (row["rollout/generated_trajectories"], row["rollout/resampled_trajectories"]) == (12, 16)


class SlowRollouter(ScriptedRollouter):
    """Each call sleeps its scripted seconds before returning its group."""

    def __init__(self, script, delays):
        super().__init__(script)
        self.delays = {k: list(v) for k, v in delays.items()}

    async def group(self, task, n, seed):
        await asyncio.sleep(self.delays[task.id].pop(0))
        return await super().group(task, n, seed)


def test_group_time_is_the_first_attempts_wall_time(metrics):
    # A's first attempt (0.05 s) is degenerate and resampled (0.6 s, not counted); B's takes 0.15 s: mean 0.1 s
    rollouter = SlowRollouter({"A": [[1, 1, 1, 1], [1, 0, 1, 0]], "B": [[0, 1, 0, 1]]},
                              {"A": [0.05, 0.6], "B": [0.15]})
    produce_all(group_producer(cfg(), rollouter), [Task(k, "train", "refund") for k in "AB"], step=1)
    assert 0.1 <= metrics.flush(1)["rollout/group_time_s"] < 0.3


def test_no_resample_attempts_drops_at_once_and_filter_off_keeps(metrics):
    # std of [0, 0.1, 0, 0.1] = 0.0577 <= 0.1: degenerate; std of [0, 1, 0, 1] = 0.577: kept
    script = {"A": [[0, 0.1, 0, 0.1]], "B": [[0, 1, 0, 1]]}
    tasks = [Task("A", "train", "refund"), Task("B", "train", "refund")]
    rollouter = ScriptedRollouter(script)
    out = produce_all(group_producer(cfg(resample_attempts=0), rollouter), tasks, step=1)
    assert [p.dropped for p in out] == [True, False] and len(rollouter.calls) == 2
    off = produce_all(group_producer(cfg(enabled=False), ScriptedRollouter(script)), tasks, step=1)
    assert [p.dropped for p in off] == [False, False] and off[0].first_degenerate


def test_new_task_resamples_generate_the_replacement_tasks(metrics):
    """resample: new_task — each attempt generates the task replacement(step, index, attempt) names."""
    tasks = [Task("A", "train", "refund"), Task("B", "train", "refund")]
    others = {("A", 1): Task("X", "train", "refund"), ("A", 2): Task("Y", "train", "refund")}
    rollouter = ScriptedRollouter({"A": [[1, 1, 1, 1]], "B": [[0, 1, 0, 1]], "X": [[0, 0, 0, 0]], "Y": [[1, 0, 0, 1]]})
    replacement = lambda step, index, attempt: others[(tasks[index].id, attempt)]  # noqa: E731
    out = produce_all(group_producer(cfg(), rollouter, replacement=replacement), tasks, step=2)
    assert [p.group.task_id for p in out] == ["Y", "B"] and not any(p.dropped for p in out)
    assert sorted(c[0] for c in rollouter.calls) == ["A", "B", "X", "Y"]
    assert out[0].resampled == 2 and out[0].first_rewards == pytest.approx([1 + 0.05 / 4] * 4)  # A's, with its bonus


class StragglerRollouter:
    """Episodes finish one by one (the first attempt's last one late); reports them as the Rollouter does."""

    reports_episodes = True

    def __init__(self, script):
        self.script, self.log = {k: list(v) for k, v in script.items()}, []

    async def group(self, task, n, seed, on_episode=None):
        rewards = self.script[task.id].pop(0)
        self.log.append(("start", seed))
        done = []
        for i, r in enumerate(rewards):
            await asyncio.sleep(0.05 if i == len(rewards) - 1 else 0.001)  # a straggler at the end
            done.append(r)
            if on_episode is not None:
                on_episode(list(done))
        self.log.append(("end", seed))
        return group(task.id, rewards)


def test_resample_attempts_start_before_a_likely_degenerate_first_attempt_ends(metrics):
    """sync mode: three of four first episodes agree → attempt 1 starts before the straggler, and attempt 2 before
    attempt 1's straggler when attempt 1's first three agree too. A's attempt 1 differs early, so its attempt 2 never
    starts; B's first attempt turns out informative (its straggler differs), so both of its early attempts are
    cancelled and counted speculative."""
    sync = RunConfig.model_validate({"rollout": {"mode": "sync"}, "policy_optimization": {"advantage": {
        "group_size": 4, "degenerate_group_filter": {"min_reward_std": 0.1, "resample_attempts": 2}}}})
    rollouter = StragglerRollouter({"A": [[1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]],
                                    "B": [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]})
    producer = group_producer(sync, rollouter)
    assert producer.concurrent_resamples
    out = produce_all(producer, [Task("A", "train", "refund"), Task("B", "train", "refund")], step=1)
    first_a = rollouter.log[0][1]
    starts = [i for i, (kind, seed) in enumerate(rollouter.log) if kind == "start" and seed != first_a]
    first_end = rollouter.log.index(("end", first_a))
    assert any(i < first_end for i in starts)  # an attempt started while A's first attempt was still running
    assert not out[0].dropped and out[0].resampled == 1 and out[0].speculative_trajectories == 0  # 2 never started
    assert len([e for e in rollouter.log if e[0] == "start"]) == 2 + 3  # A: first + attempt 1; B: all three
    assert not out[1].dropped and out[1].resampled == 0 and out[1].speculative_trajectories == 8  # both unused


def test_task_sampler_replacements_are_fixed_by_seed_and_never_the_groups_own():
    from tether.pipeline.tasks import TaskSampler

    pool = [Task(f"T{i}", "train", "refund") for i in range(12)]
    a, b = TaskSampler(pool, 4, seed=5), TaskSampler(pool, 4, seed=5)
    picks = [a.replacement(3, i, k) for i in range(4) for k in (1, 2)]
    assert picks == [b.replacement(3, i, k) for i in range(4) for k in (1, 2)]  # a resumed run draws the same
    assert all(p.id != a.batch(3)[i].id for p, i in zip(picks, [i for i in range(4) for _ in (1, 2)]))
    assert len({p.id for p in picks}) > 1
    assert TaskSampler(pool, 4, seed=6).replacement(3, 0, 1) is not None


def test_resample_key_flipped_wires_the_replacement(tiny_model, tmp_path):
    """degenerate_group_filter.resample flipped: the run's producer draws its attempts' tasks from the task sampler
    (new_task) or generates the group's own task again (same_task)."""
    from conftest import SMALL_RUN
    from tether.config import load_config
    from tether.pipeline.build import Run

    (tmp_path / "cfg.yaml").write_text(SMALL_RUN)
    for value in ("same_task", "new_task"):
        cfg = load_config([tmp_path / "cfg.yaml"], [f"model.path={tiny_model}",
                                                    f"policy_optimization.advantage.degenerate_group_filter.resample={value}"])
        with Run.build(cfg, tmp_path / value, show_progress=False) as run:
            producer = run.source.producer
            assert producer.replacement == (run.sampler.replacement if value == "new_task" else None)
            if value == "new_task":
                assert producer._attempt_task(run.sampler.batch(1)[0], 1, 0, 1).id != run.sampler.batch(1)[0].id


def test_no_signal_warning_only_when_nothing_ever_succeeds():
    none = [Produced(group("A", [0, 0]), 1, 0, first_degenerate=True, dropped=True)]
    assert "warm-start" in no_signal_warning(none, 5) and "step 5" in no_signal_warning(none, 5)
    solved = [Produced(group("A", [1, 1]), 1, 0, first_degenerate=True, any_success=True)]
    assert no_signal_warning(solved, 5) is None
    # what it says fits the run: "resampled" only when the filter resampled, the preset only where it applies
    assert "resampled" not in no_signal_warning(none, 5) and "tiny-sft" in no_signal_warning(none, 5)
    again = [Produced(group("A", [0, 0]), 1, 0, first_degenerate=True, dropped=True, resampled=2)]
    assert "(resampled too)" in no_signal_warning(again, 5)
    assert "tiny-sft" not in no_signal_warning(none, 5, preset_hint=False)


def test_diversity_bonus_rewards_distinct_successful_strategies(metrics):
    a = traj(1.0, calls=[("check_refund_policy", '{"order_id": "ORD-1", "reason_code": "DAMAGED"}')], answer="$38.00")
    b = traj(1.0, calls=[("check_refund_policy", '{"reason_code": "DAMAGED", "order_id": "ORD-1"}')], answer="$38")
    c = traj(1.0, calls=[("escalate_to_human", '{"summary": "refund", "priority": "high"}')], answer="$38.00")
    d = traj(0.0, calls=[("query_inventory", '{"sku_id": "SKU-1"}')])
    m = add_diversity_bonus([Group("t", [a, b, c, d])], coef=0.05)
    # a and b are one strategy (same call, arguments reordered, same amount): 0.05 / 2 each; c alone: 0.05; d failed
    assert [t.reward for t in (a, b, c, d)] == pytest.approx([1.025, 1.025, 1.05, 0.0])
    assert a.reward_components["diversity_bonus"] == pytest.approx(0.025)
    assert m["semantic_cluster_count"] == 3


def test_adaptive_allocation_moves_budget_to_tasks_whose_outcomes_vary(metrics):
    c = RunConfig.model_validate({"policy_optimization": {
        "advantage": {"group_size": 8},
        "rollout_allocation": {"strategy": "adaptive", "max_rollouts_per_prompt": 32, "reallocation_interval": 2}}})
    alloc = rollout_allocator(c)
    tasks = [Task(k, "train", "refund") for k in ("solved", "mixed", "failed", "new")]
    assert alloc.sizes(tasks) == [8, 8, 8, 8]  # nothing known yet: the base
    groups = [group("solved", [1] * 8), group("mixed", [1, 0] * 4), group("failed", [0] * 8)]
    alloc.observe(groups, step=1)
    assert alloc.sizes(tasks) == [8, 8, 8, 8]  # statistics are re-read every 2 steps only
    alloc.observe([], step=2)
    # budget 32; "new" keeps the base 8; solved and failed (variance 0) get the minimum 2; mixed gets the rest, 20
    assert alloc.sizes(tasks) == [2, 20, 2, 8]
    again = rollout_allocator(c)
    again.load_state_dict(alloc.state_dict())  # a resumed run allocates the same
    assert again.sizes(tasks) == [2, 20, 2, 8]
    fixed = rollout_allocator(RunConfig.model_validate({"policy_optimization": {
        "rollout_allocation": {"strategy": "fixed"}}}))
    fixed.observe(groups, step=100)
    assert fixed.sizes(tasks) == [8, 8, 8, 8]


def test_unseen_tasks_take_their_kinds_statistics(metrics):
    c = RunConfig.model_validate({"policy_optimization": {
        "advantage": {"group_size": 8},
        "rollout_allocation": {"strategy": "adaptive", "max_rollouts_per_prompt": 32, "reallocation_interval": 1}}})
    kinds = {"r1": "refund", "r2": "refund", "i1": "inventory", "i2": "inventory", "e1": "escalate"}
    alloc = rollout_allocator(c, kinds=kinds)
    alloc.observe([group("r1", [1, 0] * 4), group("i1", [1] * 8)], step=1)
    new = [Task(k, "train", kinds[k]) for k in ("r2", "i2", "e1")]
    # r2 is unseen but refunds vary (0.25): it gets the budget; i2's kind is always solved: the minimum 2;
    # e1's kind was never seen: the base 8; total 24 = 3 × 8
    assert alloc.sizes(new) == [14, 2, 8]


def test_a_group_whose_every_episode_failed_is_dropped_and_counted_not_fatal_in_sync(metrics):
    from tether.pipeline.rollouter import RolloutError
    from tether.pipeline.weights import WeightSync

    class Failing:
        async def produce(self, task, size, step, index):
            if task.id == "bad":
                raise RolloutError("task bad: all 3 attempts failed: env: sqlite3.OperationalError")
            return Produced(group(task.id, [0, 1, 0, 1]), step, index)

    c = RunConfig.model_validate({"learner": {"batch_size": 8, "mini_batch_size": 8, "gradient_accumulation_steps": 1},
                                  "policy_optimization": {"advantage": {"group_size": 4}},
                                  "rollout": {"worker": {"max_concurrent_tasks": 8}}})
    tasks = [Task("bad", "train", "k"), Task("good", "train", "k")]
    source = batch_source(c, Failing(), lambda step: tasks, WeightSync(None, None, 1), start_step=0,
                          sizes=lambda ts: [4] * len(ts))
    batch = source.next_batch(1)
    assert [g.task_id for g in batch.groups] == ["good"] and [p.failed for p in batch.produced] == [True, False]
    assert metrics.flush(1)["rollout/failed_groups"] == 1
    assert source.state_dict()["ledger"]["frontier"] == 1  # settled: a resume does not make it again


def test_decided_informative_by_hand():
    from tether.algo.filters import decided_informative

    # six 0s and a 1 of a group of 8: SS = 6/49 + 36/49 = 6/7, the lowest std sqrt(6/7 / 7) = 0.350 whatever the 8th
    assert decided_informative([0] * 6 + [1], 8, min_reward_std=0.34) and not decided_informative(
        [0] * 6 + [1], 8, min_reward_std=0.36)
    assert not decided_informative([0] * 7, 8, min_reward_std=0.0)  # all equal so far: the 8th could still differ
    assert not decided_informative([0.5], 8, min_reward_std=0.0)
    # -0.2 and -0.1 among 8: SS = 0.005, sqrt(0.005 / 7) = 0.0267 <= 0.1 — the stragglers could still even it out
    assert not decided_informative([-0.2, -0.1], 8, min_reward_std=0.1)


class TwoStragglers(StragglerRollouter):
    """The last two episodes of an attempt are late, the last one very late; cancellations are logged."""

    async def group(self, task, n, seed, on_episode=None):
        rewards = self.script[task.id].pop(0)
        self.log.append(("start", seed))
        done = []
        try:
            for i, r in enumerate(rewards):
                await asyncio.sleep({len(rewards) - 2: 0.05, len(rewards) - 1: 0.3}.get(i, 0.001))
                done.append(r)
                if on_episode is not None:
                    on_episode(list(done))
        except asyncio.CancelledError:
            self.log.append(("cancelled", seed))
            raise
        self.log.append(("end", seed))
        return group(task.id, rewards)


def test_a_speculative_attempt_is_cancelled_once_the_first_is_decided_informative(metrics):
    """Six of eight first rewards agree → attempt 1 starts; the seventh differs, which makes the group informative
    whatever the eighth scores → attempt 1 is cancelled then, before the eighth (the straggler) finishes."""
    sync = RunConfig.model_validate({"rollout": {"mode": "sync"}, "policy_optimization": {"advantage": {
        "group_size": 8, "degenerate_group_filter": {"min_reward_std": 0.1, "resample_attempts": 2}}}})
    rollouter = TwoStragglers({"A": [[0, 0, 0, 0, 0, 0, 1, 0], [0] * 8, [0] * 8]})
    (out,) = produce_all(group_producer(sync, rollouter), [Task("A", "train", "refund")], step=1)
    first, second = rollouter.log[0][1], rollouter.log[1][1]
    assert rollouter.log[1][0] == "start" and first != second
    assert rollouter.log.index(("cancelled", second)) < rollouter.log.index(("end", first))
    assert not out.dropped and out.resampled == 0
    assert out.speculative_trajectories == 8 and out.speculative_cancelled_early == 8
