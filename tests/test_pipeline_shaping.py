"""The trainer's batch shaping: diversity bonus, degenerate-group resampling/dropping, adaptive allocation."""

from __future__ import annotations

import pytest

from tether.config import RunConfig
from tether.metrics import MetricsRecorder, set_recorder
from tether.pipeline.shaping import DegenerateFilter, RolloutAllocator, add_diversity_bonus
from tether.types import Group, Task, Trajectory


@pytest.fixture
def metrics():
    rec = MetricsRecorder([])
    prev = set_recorder(rec)
    yield rec
    set_recorder(prev)


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


def test_degenerate_groups_are_resampled_then_dropped(metrics):
    tasks = {k: Task(k, "train", "refund") for k in "ABC"}
    rollouter = ScriptedRollouter({"A": [[0, 0, 0, 0], [1, 0, 1, 1]],  # 2nd resample informative: kept
                                   "C": [[1, 1, 1, 1], [0, 0, 0, 0]]})  # still degenerate after 2: dropped
    shaped = []
    filt = DegenerateFilter(cfg(), rollouter, tasks, shaped.append)
    kept = filt([group("A", [1, 1, 1, 1]), group("B", [0, 1, 0, 1]), group("C", [0.5] * 4)], step=3)
    assert [g.task_id for g in kept] == ["A", "B"] and kept[0].rewards == [1, 0, 1, 1]
    # two rounds, each regenerating every group still degenerate, concurrently
    assert [c[:2] for c in rollouter.calls] == [("A", 4), ("C", 4), ("A", 4), ("C", 4)]
    assert len({c[2] for c in rollouter.calls}) == 4  # fresh seeds every attempt
    assert [len(r) for r in shaped] == [2, 2]  # each regenerated group got the diversity bonus too
    row = metrics.flush(3)
    assert row["optim/degenerate_group_ratio_before_filter"] == pytest.approx(2 / 3)
    assert (row["rollout/resampled_groups"], row["rollout/dropped_groups"]) == (4, 1)


def test_no_resample_attempts_drops_at_once(metrics):
    rollouter = ScriptedRollouter({})
    filt = DegenerateFilter(cfg(resample_attempts=0), rollouter, {}, lambda g: None)
    # std of [0, 0.1, 0, 0.1] = 0.0577 ≤ 0.1: degenerate; std of [0, 1] = 0.707: kept; singleton: degenerate
    kept = filt([group("A", [0, 0.1, 0, 0.1]), group("B", [0, 1]), group("C", [1])], step=1)
    assert [g.task_id for g in kept] == ["B"] and rollouter.calls == []


def test_diversity_bonus_rewards_distinct_successful_strategies(metrics):
    a = traj(1.0, calls=[("check_refund_policy", '{"order_id": "ORD-1", "reason_code": "DAMAGED"}')], answer="$38.00")
    b = traj(1.0, calls=[("check_refund_policy", '{"reason_code": "DAMAGED", "order_id": "ORD-1"}')], answer="$38")
    c = traj(1.0, calls=[("escalate_to_human", '{"summary": "refund", "priority": "high"}')], answer="$38.00")
    d = traj(0.0, calls=[("query_inventory", '{"sku_id": "SKU-1"}')])
    add_diversity_bonus([Group("t", [a, b, c, d])], coef=0.05)
    # a and b are one strategy (same call, arguments reordered, same amount): 0.05 / 2 each; c alone: 0.05; d failed
    assert [t.reward for t in (a, b, c, d)] == pytest.approx([1.025, 1.025, 1.05, 0.0])
    assert a.reward_components["diversity_bonus"] == pytest.approx(0.025)
    assert metrics.flush(1)["rollout/semantic_cluster_count"] == 3


def test_adaptive_allocation_moves_budget_to_tasks_whose_outcomes_vary(metrics):
    c = RunConfig.model_validate({"policy_optimization": {
        "advantage": {"group_size": 8},
        "rollout_allocation": {"strategy": "adaptive", "max_rollouts_per_prompt": 32, "reallocation_interval": 2}}})
    alloc = RolloutAllocator(c)
    tasks = [Task(k, "train", "refund") for k in ("solved", "mixed", "failed", "new")]
    assert alloc.sizes(tasks) == [8, 8, 8, 8]  # nothing known yet: the base
    groups = [group("solved", [1] * 8), group("mixed", [1, 0] * 4), group("failed", [0] * 8)]
    alloc.observe(groups, step=1)
    assert alloc.sizes(tasks) == [8, 8, 8, 8]  # statistics are re-read every 2 steps only
    alloc.observe([], step=2)
    # budget 32; "new" keeps the base 8; solved and failed (variance 0) get the minimum 2; mixed gets the rest, 20
    assert alloc.sizes(tasks) == [2, 20, 2, 8]
    again = RolloutAllocator(c)
    again.load_state_dict(alloc.state_dict())  # a resumed run allocates the same
    assert again.sizes(tasks) == [2, 20, 2, 8]
    fixed = RolloutAllocator(RunConfig.model_validate({"policy_optimization": {
        "rollout_allocation": {"strategy": "fixed"}}}))
    fixed.observe(groups, step=100)
    assert fixed.sizes(tasks) == [8, 8, 8, 8]


def test_unseen_tasks_take_their_kinds_statistics(metrics):
    c = RunConfig.model_validate({"policy_optimization": {
        "advantage": {"group_size": 8},
        "rollout_allocation": {"strategy": "adaptive", "max_rollouts_per_prompt": 32, "reallocation_interval": 1}}})
    kinds = {"r1": "refund", "r2": "refund", "i1": "inventory", "i2": "inventory", "e1": "escalate"}
    alloc = RolloutAllocator(c, kinds=kinds)
    alloc.observe([group("r1", [1, 0] * 4), group("i1", [1] * 8)], step=1)
    new = [Task(k, "train", kinds[k]) for k in ("r2", "i2", "e1")]
    # r2 is unseen but refunds vary (0.25): it gets the budget; i2's kind is always solved: the minimum 2;
    # e1's kind was never seen: the base 8; total 24 = 3 × 8
    assert alloc.sizes(new) == [14, 2, 8]
