"""Every key of the six seed files acts: flipping its value changes what runs (or loading refuses it, naming the
key). ``KEY_TESTS`` maps each key to the test that flips it; ``test_every_seed_key_has_a_flip_test`` fails when
a seed key has no entry or its test does not exist.

The flips of this file: learner / objective keys through one real ``Learner`` (two steps on the same
trajectories, whose behaviour logprobs differ from the model's so that clipping and correction bite), advantage
and shaping keys through the trainer's own functions, and a few run-level flips through ``tether.pipeline``.
"""

from __future__ import annotations

import asyncio
import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import REPO, SEEDS
from tether.config import ConfigError, RunConfig, load_config
from tether.learner import load_model_and_tokenizer
from tether.learner.learner import Learner
from tether.pipeline.shaping import GroupProducer
from tether.pipeline.trainer import advantages
from tether.types import Group, Task, Trajectory

torch.set_num_threads(1)


def seed_keys() -> list[str]:
    """Every leaf key of the six seed files (a list of objects counts as one key)."""
    def leaves(d: Any, path: tuple[str, ...] = ()):
        if isinstance(d, dict):
            for k, v in d.items():
                yield from leaves(v, (*path, k))
        else:
            yield ".".join(path)

    return sorted({k for f in SEEDS.glob("*.yaml") for k in leaves(yaml.safe_load(f.read_text()))})


def nested(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ----------------------------------------------------------------------------- learner-level flips

LEARNER_BASE = {
    "learner": {"batch_size": 8, "mini_batch_size": 4, "gradient_accumulation_steps": 1, "update_frequency": 2,
                "off_policy_correction": {"method": "double_sided_importance_sampling", "clip_ratio": 0.2,
                                          "token_level_clipping": True, "tis_enabled": True}},
    "policy_optimization": {
        "algorithm": "grpo_variant", "advantage": {"group_size": 4},
        "exploration": {"entropy_coef": 0.01, "clip_higher": 0.28},
        "kl_control": {"type": "relative_entropy", "target_kl": 0.01, "adaptive": True, "max_kl": 10.0,
                       "init_coef": 0.05, "horizon": 16},
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01, "warmup_steps": 0, "max_grad_norm": 1.0}},
}


@pytest.fixture(scope="module")
def base_model(tiny_model):
    model, _ = load_model_and_tokenizer(tiny_model)
    return model


def trajectories(vocab: int, n: int = 8, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        mask = [1] * rng.randint(2, 5) + [0] * rng.randint(0, 2) + [1] * rng.randint(1, 4)
        out.append(Trajectory(
            task_id=f"t{i // 4}", prompt_ids=[rng.randrange(vocab) for _ in range(4)],
            response_ids=[rng.randrange(vocab) for _ in mask], response_mask=mask,
            logprobs=[-rng.uniform(2.0, 9.0) if m else 0.0 for m in mask], versions=[0 if m else -1 for m in mask]))
    return out


def learner_run(base_model, overrides: dict) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    cfg = RunConfig.model_validate(merge(LEARNER_BASE, overrides))
    torch.manual_seed(0)
    learner = Learner(copy.deepcopy(base_model), None, cfg)
    trajs = trajectories(base_model.config.vocab_size)
    adv = [1.5, -1.0, 0.5, -1.0, 2.0, -0.5, -0.5, -1.0]
    metrics = [learner.train_step(trajs, adv) for _ in range(2)]
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}, metrics


# (key, value a, value b[, other keys the flip needs: e.g. the PPO ratio taken to the behaviour policy, whose
# logprobs differ from the model's, so that the clip range decides which tokens move])
LEARNER_FLIPS = [
    ("learner.mini_batch_size", 4, 8),
    ("learner.update_frequency", 2, 1),
    ("learner.off_policy_correction.method", "double_sided_importance_sampling", "none"),
    ("learner.off_policy_correction.clip_ratio", 0.2, 0.05),
    ("learner.off_policy_correction.token_level_clipping", True, False),
    ("learner.off_policy_correction.tis_enabled", True, False),  # with double-sided IS: weight vs mask only
    ("policy_optimization.algorithm", "grpo_variant", "gspo"),
    ("policy_optimization.exploration.entropy_coef", 0.01, 0.0),
    ("policy_optimization.exploration.clip_higher", 0.28, 0.05, {"learner.off_policy_correction.method": "none",
                                                                  "learner.off_policy_correction.tis_enabled": False}),
    ("policy_optimization.kl_control.type", "relative_entropy", "none"),
    ("policy_optimization.optimizer.lr", 3e-3, 1e-3),
    ("policy_optimization.optimizer.weight_decay", 0.01, 0.5),
    ("policy_optimization.optimizer.warmup_steps", 0, 5),
    ("policy_optimization.optimizer.max_grad_norm", 1.0, 0.01),
]


@pytest.mark.parametrize("flip", LEARNER_FLIPS, ids=[f[0] for f in LEARNER_FLIPS])
def test_learner_key_flip_changes_the_update(base_model, flip):
    key, a, b = flip[:3]
    context: dict = {}
    for k, v in (flip[3] if len(flip) > 3 else {}).items():
        context = merge(context, nested(k, v))
    wa, _ = learner_run(base_model, merge(context, nested(key, a)))
    wb, _ = learner_run(base_model, merge(context, nested(key, b)))
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert diff > 1e-7, f"{key}: {a!r} and {b!r} gave the same weights"


def test_gradient_accumulation_is_invariant_but_splits_the_work(base_model):
    """gradient_accumulation_steps must NOT change the update (same mini-batch, summed in pieces)."""
    wa, _ = learner_run(base_model, nested("learner.gradient_accumulation_steps", 1))
    wb, _ = learner_run(base_model, nested("learner.gradient_accumulation_steps", 2))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
    cfg = RunConfig.model_validate(merge(LEARNER_BASE, nested("learner.gradient_accumulation_steps", 2)))
    assert cfg.derived()["micro_batch_size"] == 2  # 4 trajectories per update in 2 micro-batches


@pytest.mark.parametrize("key,a,b", [("policy_optimization.kl_control.adaptive", True, False),
                                     ("policy_optimization.kl_control.target_kl", 1e-6, 1.0)])
def test_kl_controller_keys_move_beta(base_model, key, a, b):
    _, ma = learner_run(base_model, nested(key, a))
    _, mb = learner_run(base_model, nested(key, b))
    assert ma[-1]["optim/kl_coef"] != pytest.approx(mb[-1]["optim/kl_coef"], rel=1e-6), key


def test_max_kl_guard_stops_updates(base_model):
    _, loose = learner_run(base_model, nested("policy_optimization.kl_control.max_kl", 10.0))
    _, tight = learner_run(base_model, merge(nested("policy_optimization.kl_control.max_kl", 1e-9),
                                             nested("policy_optimization.kl_control.target_kl", 1e-9)))
    assert loose[-1]["optim/kl_guard_stops"] == 0 and tight[-1]["optim/kl_guard_stops"] > 0


# ----------------------------------------------------------------------------- advantage and shaping flips

def test_advantage_normalization_changes_the_advantages():
    groups = [Group("a", [Trajectory("a", [1], reward=r) for r in (1.0, 0.0, 1.0, 0.0)]),
              Group("b", [Trajectory("b", [1], reward=r) for r in (0.2, 0.0, 0.0, 0.0)])]
    out = {}
    for norm in ("group", "batch", "none"):
        cfg = RunConfig.model_validate(nested("policy_optimization.advantage.normalization", norm))
        out[norm] = advantages(cfg, groups)[1]
    # group b: mean 0.05; raw advantages (0.15, -0.05, -0.05, -0.05); its own std (n-1) = 0.1
    assert out["none"][4:].tolist() == pytest.approx([0.15, -0.05, -0.05, -0.05])
    assert out["group"][4:].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-4)
    assert not torch.allclose(out["group"], out["batch"])


class Scripted:
    def __init__(self, script: dict[str, list[list[float]]]):
        self.script = {k: list(v) for k, v in script.items()}

    async def group(self, task, n, seed):
        def traj(r):
            return Trajectory(task.id, [1], reward=r, success=r >= 1.0,
                              messages=[{"role": "assistant", "content": f"answer {r}"}])
        return Group(task.id, [traj(r) for r in self.script[task.id].pop(0)])


def produce(overrides: dict, script: dict) -> list:
    cfg = RunConfig.model_validate(merge({"policy_optimization": {"advantage": {"group_size": 4}}}, overrides))
    producer = GroupProducer(cfg, Scripted(script))
    tasks = [Task(k, "train", "refund") for k in script]
    return [asyncio.run(producer.produce(t, 4, 1, k)) for k, t in enumerate(tasks)]


def test_min_reward_std_decides_which_groups_are_degenerate():
    script = {"A": [[0.0, 0.3, 0.0, 0.3]] * 3}  # std 0.173
    low = produce(nested("policy_optimization.advantage.degenerate_group_filter.min_reward_std", 0.1), script)
    high = produce(nested("policy_optimization.advantage.degenerate_group_filter.min_reward_std", 0.2), script)
    assert (low[0].first_degenerate, high[0].first_degenerate) == (False, True)
    assert (low[0].resampled, high[0].resampled) == (0, 2)


def test_diversity_bonus_keys_change_rewards():
    script = {"A": [[1.0, 0.0, 0.0, 0.0]]}
    base = {"policy_optimization": {"exploration": {"diversity_bonus": {"enabled": True, "coef": 0.05}}}}
    on = produce(base, script)[0].group.rewards
    off = produce(merge(base, nested("policy_optimization.exploration.diversity_bonus.enabled", False)),
                  script)[0].group.rewards
    big = produce(merge(base, nested("policy_optimization.exploration.diversity_bonus.coef", 0.5)),
                  script)[0].group.rewards
    assert (on[0], off[0], big[0]) == pytest.approx((1.05, 1.0, 1.5))  # one success, its own strategy


# ----------------------------------------------------------------------------- run-level flips

def test_batch_size_and_group_size_change_what_a_step_trains(small_run):
    _, base, _ = small_run("base", "trainer.total_steps=1", "trainer.save_every=0")
    _, half, _ = small_run("half", "trainer.total_steps=1", "trainer.save_every=0", "learner.batch_size=4",
                           "learner.mini_batch_size=4")
    _, pairs, _ = small_run("pairs", "trainer.total_steps=1", "trainer.save_every=0",
                            "policy_optimization.advantage.group_size=2")
    assert [s["group_sizes"] for s in (base[0], half[0], pairs[0])] == [[4, 4], [4], [2, 2, 2, 2]]


# ----------------------------------------------------------------------------- single-value labels

LABELS = ["environment.type", "environment.termination.success_criteria",
          "policy_optimization.exploration.diversity_bonus.metric", "policy_optimization.advantage.estimator",
          "policy_optimization.rollout_allocation.allocation_metric", "policy_optimization.optimizer.type"]


@pytest.mark.parametrize("key", LABELS)
def test_single_value_label_refuses_any_other_value(tmp_path, key):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(nested(key, "something_else")))
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config([f])


# ----------------------------------------------------------------------------- the table

KEY_TESTS: dict[str, str] = {}  # filled below; key -> "tests/file.py::test_name"


def _parametrized(key: str, name: str) -> None:
    KEY_TESTS[key] = f"tests/test_seed_keys.py::{name}"


for _flip in LEARNER_FLIPS:
    _parametrized(_flip[0], "test_learner_key_flip_changes_the_update")
for _key in LABELS:
    _parametrized(_key, "test_single_value_label_refuses_any_other_value")
_parametrized("learner.gradient_accumulation_steps", "test_gradient_accumulation_is_invariant_but_splits_the_work")
_parametrized("policy_optimization.kl_control.adaptive", "test_kl_controller_keys_move_beta")
_parametrized("policy_optimization.kl_control.target_kl", "test_kl_controller_keys_move_beta")
_parametrized("policy_optimization.kl_control.max_kl", "test_max_kl_guard_stops_updates")
_parametrized("policy_optimization.advantage.normalization", "test_advantage_normalization_changes_the_advantages")
_parametrized("policy_optimization.advantage.degenerate_group_filter.min_reward_std",
              "test_min_reward_std_decides_which_groups_are_degenerate")
_parametrized("policy_optimization.exploration.diversity_bonus.enabled", "test_diversity_bonus_keys_change_rewards")
_parametrized("policy_optimization.exploration.diversity_bonus.coef", "test_diversity_bonus_keys_change_rewards")
_parametrized("learner.batch_size", "test_batch_size_and_group_size_change_what_a_step_trains")
_parametrized("policy_optimization.advantage.group_size", "test_batch_size_and_group_size_change_what_a_step_trains")

KEY_TESTS.update({
    # the pipeline (tests/test_pipeline_keys.py, tests/test_modes.py and the component tests)
    "buffer.type": "tests/test_pipeline_keys.py::test_fifo_and_priority_buffers_train_different_groups_and_count_evictions",
    "rollout.partial_rollout.replay_buffer_size":
        "tests/test_pipeline_keys.py::test_fifo_and_priority_buffers_train_different_groups_and_count_evictions",
    "buffer.freshness_weight": "tests/test_pipeline_buffer.py::test_priorities_of_three_groups_and_eviction_order",
    "buffer.diversity_weight": "tests/test_pipeline_buffer.py::test_zero_priority_only_when_nothing_else_is_left",
    "policy_optimization.advantage.degenerate_group_filter.enabled":
        "tests/test_pipeline_shaping.py::test_no_resample_attempts_drops_at_once_and_filter_off_keeps",
    "policy_optimization.advantage.degenerate_group_filter.resample_attempts":
        "tests/test_pipeline_shaping.py::test_no_resample_attempts_drops_at_once_and_filter_off_keeps",
    "trainer.use_trainer_do_validate":
        "tests/test_pipeline_keys.py::test_use_trainer_do_validate_evaluates_the_trainers_or_the_rollouters_weights",
    "trainer.trigger_parameter_sync_step":
        "tests/test_pipeline_keys.py::test_trigger_parameter_sync_step_sets_the_parameter_version",
    "rollout.mode": "tests/test_modes.py::test_async_modes_at_staleness_zero_equal_sync",
    "rollout.scheduler.max_staleness": "tests/test_modes.py::test_bounds_hold_under_slow_long_tailed_tools",
    "policy_optimization.rollout_allocation.strategy":
        "tests/test_pipeline_shaping.py::test_adaptive_allocation_moves_budget_to_tasks_whose_outcomes_vary",
    "policy_optimization.rollout_allocation.reallocation_interval":
        "tests/test_pipeline_shaping.py::test_adaptive_allocation_moves_budget_to_tasks_whose_outcomes_vary",
    "policy_optimization.rollout_allocation.base_rollouts_per_prompt":
        "tests/test_config.py::test_group_size_and_base_rollouts_are_one_number",
})


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    file = REPO / path
    return file.is_file() and re.search(rf"^(async )?def {re.escape(name)}\b", file.read_text(), re.M) is not None


def test_every_seed_key_has_a_flip_test():
    keys = seed_keys()
    assert len(keys) == 92  # the six seed files
    missing = [k for k in keys if k not in KEY_TESTS]
    assert not missing, f"seed keys without a flip test: {missing}"
    broken = {k: ref for k, ref in KEY_TESTS.items() if not _test_exists(ref)}
    assert not broken, f"tests named in KEY_TESTS that do not exist: {broken}"
