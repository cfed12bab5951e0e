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
import re
from typing import Any

import pytest
import torch
import yaml

from conftest import REPO, SEEDS, batch_source, group_producer, make_learner, random_trajectories, rollout_allocator
from tether.config import ConfigError, RunConfig, load_config
from tether.config.plan import Plan
from tether.learner import load_model_and_tokenizer
from tether.pipeline.streaming import advantages
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
    return random_trajectories(vocab, n, seed)


def learner_run(base_model, overrides: dict) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    cfg = RunConfig.model_validate(merge(LEARNER_BASE, overrides))
    torch.manual_seed(0)
    learner = make_learner(copy.deepcopy(base_model), cfg)
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
    ("policy_optimization.optimizer.lr_scheduler", "constant", "cosine",
     {"policy_optimization.optimizer.decay_steps": 3}),
    ("policy_optimization.optimizer.min_lr_ratio", 0.0, 0.5, {"policy_optimization.optimizer.lr_scheduler": "linear",
                                                              "policy_optimization.optimizer.decay_steps": 3}),
    ("policy_optimization.optimizer.decay_steps", 3, 8, {"policy_optimization.optimizer.lr_scheduler": "cosine"}),
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
    assert Plan.of(cfg).micro_batch_size == 2  # 4 trajectories per update in 2 micro-batches


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
        out[norm] = advantages(groups, norm, min_std=0.0)[0]
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
    producer = group_producer(cfg, Scripted(script))
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
    """learner.batch_size sets the tasks per step; advantage.group_size ≡ base_rollouts_per_prompt their rollouts."""
    _, base, _ = small_run("base", "trainer.total_steps=1", "trainer.save_every=0")
    _, half, _ = small_run("half", "trainer.total_steps=1", "trainer.save_every=0", "learner.batch_size=4",
                           "learner.mini_batch_size=4")
    _, pairs, _ = small_run("pairs", "trainer.total_steps=1", "trainer.save_every=0",
                            "policy_optimization.advantage.group_size=2")
    assert [s["group_sizes"] for s in (base[0], half[0], pairs[0])] == [[4, 4], [4], [2, 2, 2, 2]]
    # base_rollouts_per_prompt is the same number as group_size: set alone, it sets the group size
    cfg = RunConfig.model_validate(nested("policy_optimization.rollout_allocation.base_rollouts_per_prompt", 2))
    assert cfg.policy_optimization.advantage.group_size == 2 and Plan.of(cfg).prompts_per_step == 32


def test_max_rollouts_per_prompt_caps_the_adaptive_allocation():

    def sizes(cap: int) -> list[int]:
        cfg = RunConfig.model_validate({"policy_optimization": {"advantage": {"group_size": 8}, "rollout_allocation": {
            "strategy": "adaptive", "max_rollouts_per_prompt": cap, "reallocation_interval": 1}}})
        alloc = rollout_allocator(cfg)
        alloc.observe([Group("mixed", [Trajectory("mixed", [1], reward=r) for r in [1, 0] * 4]),
                       Group("solved", [Trajectory("solved", [1], reward=1.0) for _ in range(8)])], step=1)
        return alloc.sizes([Task("mixed", "train", "k"), Task("solved", "train", "k")])

    # budget 16 (kept exactly): solved (variance 0) gets the minimum 2 and mixed the rest, 14; with a cap of 10
    # mixed gets 10 and the 6 left over go to the only task under the cap
    assert (sizes(32), sizes(10)) == ([14, 2], [10, 6])


# ----------------------------------------------------------------------------- the runtime's keys

@pytest.fixture(scope="module")
def runtime(tiny_model):
    from tether.runtime import Runtime

    def build(*overrides: str):
        return Runtime.build(load_config([], [f"model.path={tiny_model}", *overrides]))

    return build


def test_agent_loop_name_selects_the_registered_loop(runtime):
    from tether.agent.loop import ToolAgentLoop, register

    @register("tool_agent_for_a_test")
    class Custom(ToolAgentLoop):
        pass

    rt = runtime("agent_loop.name=tool_agent_for_a_test")
    try:
        assert type(rt.loop()) is Custom
    finally:
        rt.close()
    rt = runtime("agent_loop.name=no_such_loop")
    try:
        with pytest.raises(KeyError, match="registered: .*tool_agent"):
            rt.loop()
    finally:
        rt.close()


def test_environment_name_selects_the_environment(runtime):
    with pytest.raises(ValueError, match="customer_service_agent"):
        runtime("environment.name=no_such_env")


def test_tool_parser_name_changes_what_counts_as_a_call(runtime):
    text = '{"name": "query_inventory", "arguments": {"sku_id": "SKU-1"}}'  # bare JSON, no <tool_call> tags
    calls = {}
    for name in ("hermes", "function_call_parser"):
        rt = runtime(f"tool_parser.name={name}")
        try:
            calls[name] = len(rt.loop().parse(text).calls)
        finally:
            rt.close()
    assert calls == {"hermes": 0, "function_call_parser": 1}


def test_context_window_cuts_the_episode(runtime):
    from tether.pipeline.rollouter import Rollouter

    lengths = {}
    for window in (32768, 0):
        rt = runtime("environment.num_train_tasks=4", "engine.max_tokens=16")
        try:
            task = rt.tasks("train")[0]
            if window == 0:  # just above the prompt: the first turn is cut
                prompt = asyncio.run(Rollouter(rt.loop(), rt.make_env).group(task, 1, 0)).trajectories[0].prompt_ids
                rt.close()
                rt = runtime("environment.num_train_tasks=4", "engine.max_tokens=16",
                             f"environment.state.context_window={len(prompt) + 4}")
            traj = asyncio.run(Rollouter(rt.loop(), rt.make_env).group(task, 1, 0)).trajectories[0]
            lengths[window] = (len(traj.prompt_ids) + len(traj.response_ids), traj.termination)
        finally:
            rt.close()
    assert lengths[0][1] == "context_window" and lengths[0][0] < lengths[32768][0]


class _SlowProducer:
    """Counts how many groups are produced at once."""

    def __init__(self):
        self.now = self.peak = 0

    async def produce(self, task, size, step, index):
        from tether.pipeline.shaping import Produced

        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(0.02)
        self.now -= 1
        return Produced(Group(task.id, [Trajectory(task.id, [1], reward=float(i % 2)) for i in range(size)]),
                        step, index)


def test_max_concurrent_tasks_bounds_the_groups_in_flight():
    from tether.pipeline.weights import WeightSync

    peaks = {}
    for cap in (4, 16):
        cfg = RunConfig.model_validate({"learner": {"batch_size": 32, "mini_batch_size": 32,
                                                    "gradient_accumulation_steps": 1},
                                        "policy_optimization": {"advantage": {"group_size": 4}},
                                        "rollout": {"worker": {"max_concurrent_tasks": cap}}})
        producer = _SlowProducer()
        tasks = [Task(f"t{i}", "train", "k") for i in range(8)]
        source = batch_source(cfg, producer, lambda step: tasks,  # noqa: B023 — used within this iteration
                              WeightSync(None, None, 1), start_step=0, sizes=lambda ts: [4] * len(ts))
        source.next_batch(1)
        peaks[cap] = producer.peak
    assert peaks == {4: 1, 16: 4}  # trajectories in flight / group_size groups


class _FlakyLoop:
    """An agent loop whose first ``fail`` attempts raise, and which takes ``delay`` seconds."""

    def __init__(self, fail: int = 0, delay: float = 0.0):
        self.fail, self.delay, self.calls = fail, delay, 0

    async def run(self, task, env, *, seed=None):
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.calls <= self.fail:
            raise RuntimeError("tool sandbox crashed")
        return Trajectory(task.id, [1], reward=1.0)


class _NullEnv:
    def close(self):
        pass


def test_task_timeout_and_retry_on_failure_decide_whether_an_episode_survives():
    from tether.pipeline.rollouter import Rollouter, RolloutError

    task = Task("t", "train", "k")

    def episode(loop, **kw):
        return asyncio.run(Rollouter(loop, _NullEnv, **kw).rollout(task, 0))

    with pytest.raises(RolloutError, match="timed out"):
        episode(_FlakyLoop(delay=0.2), timeout_s=0.05)
    assert episode(_FlakyLoop(delay=0.2), timeout_s=5).reward == 1.0
    with pytest.raises(RolloutError, match="sandbox crashed"):
        episode(_FlakyLoop(fail=1), retries=0)
    assert episode(_FlakyLoop(fail=1), retries=1).reward == 1.0


def test_ppo_mini_batch_size_times_require_batches_is_the_trainer_step():
    def step(ppo: int, batches: int) -> dict:
        cfg = RunConfig.model_validate({"trainer": {"ppo_mini_batch_size": ppo, "require_batches": batches},
                                        "policy_optimization": {"advantage": {"group_size": 4}}})
        return {"batch": cfg.learner.batch_size, "tasks": Plan.of(cfg).prompts_per_step}

    assert step(64, 2) == {"batch": 128, "tasks": 32}
    assert step(16, 2) == {"batch": 32, "tasks": 8}
    assert step(16, 1) == {"batch": 16, "tasks": 4}


def test_tool_error_threshold_decides_when_errors_end_the_episode():
    from tether.config import EnvironmentConfig
    from tether.env.customer_service import CustomerServiceEnv

    ended_after = {}
    for threshold in (1, 3):
        env = CustomerServiceEnv(EnvironmentConfig.model_validate({"termination": {"tool_error_threshold": threshold}}))
        try:
            env.reset(task_id=env.tasks("train")[0].id)
            for n in range(1, 5):
                _, _, done, info = env.step({"name": "no_such_tool", "params": {}})
                if done:
                    ended_after[threshold] = (n, info["termination"])
                    break
        finally:
            env.close()
    assert ended_after == {1: (1, "tool_errors"), 3: (3, "tool_errors")}


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
    "buffer.type":
        "tests/test_pipeline_keys.py::test_fifo_and_priority_buffers_train_different_groups_and_count_evictions",
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
        "tests/test_seed_keys.py::test_batch_size_and_group_size_change_what_a_step_trains",
})


KEY_TESTS.update({
    # agent loop and parser
    "agent_loop.name": "tests/test_seed_keys.py::test_agent_loop_name_selects_the_registered_loop",
    "agent_loop.max_user_turns": "tests/test_agent_loop.py::test_max_user_turns",
    "agent_loop.max_assistant_turns":
        "tests/test_agent_loop.py::test_max_assistant_turns_truncates_and_scores_through_finalize",
    "agent_loop.max_parallel_calls":
        "tests/test_agent_loop.py::test_parallel_calls_run_concurrently_and_extra_calls_are_refused",
    "agent_loop.tool_selection": "tests/test_env_state_keys.py::test_per_sample_and_all_give_different_prompts",
    "tool_parser.name": "tests/test_seed_keys.py::test_tool_parser_name_changes_what_counts_as_a_call",
    "agent_loop.constrained_tool_calls":  # tether's own key
        "tests/test_constrained_rollouts.py::test_constrained_tool_calls_flip_what_the_rollouts_call",
    "tool_parser.stop_token_ids": "tests/test_engine.py::test_stop_ids_and_max_tokens",
    # the OpenAI-compatible client: each key flipped, the request (server, key, model) changes
    **{k: "tests/test_llm_client.py::test_llm_client_section_base_url_api_key_and_model_decide_the_request"
       for k in ("llm_client.base_url", "llm_client.api_key", "llm_client.model")},
    # the Ray backend's pools: a pool the cluster cannot hold fails at start naming the key
    **{f"resource_pool.{p}.num_gpus": "tests/test_ray_backend.py::test_a_pool_too_large_fails_at_start_before_any_actor"
       for p in ("trainer_pool", "rollout_pool")},
    # the trainer's worker (tests/test_detach_worker.py, tests/test_fsdp2.py)
    "actor_worker.class": "tests/test_detach_worker.py::test_flipping_the_class_changes_a_run_inside_a_sync_window",
    "actor_worker.strategy": "tests/test_fsdp2.py::test_a_run_with_fsdp2_trains_what_a_plain_run_does_and_resumes",
    # not a seed key; the model section's compute dtype, flipped through a run
    "model.dtype": "tests/test_bf16.py::test_model_dtype_bf16_run_trains_with_finite_metrics_and_differs_from_fp32",
    # environment
    "environment.name": "tests/test_seed_keys.py::test_environment_name_selects_the_environment",
    "environment.action_space":
        "tests/test_env_episodes.py::test_tool_latency_above_timeout_is_an_error_and_three_end_the_episode",
    "environment.state.max_turns":
        "tests/test_env_state_keys.py::test_fail_and_truncate_score_an_episode_that_hits_max_turns_differently",
    "environment.state.context_window": "tests/test_seed_keys.py::test_context_window_cuts_the_episode",
    "environment.state.memory.k": "tests/test_memory_segments.py::test_k_bounds_the_context_and_changes_the_tokens",
    "environment.state.memory.summary_enabled":
        "tests/test_memory_segments.py::test_summary_enabled_changes_the_segment_prompt",
    "environment.state.memory.type":
        "tests/test_config_honesty.py::test_one_value_labels_accept_only_that_value_and_say_so",
    "environment.state.observation_fields":
        "tests/test_env_state_keys.py::test_each_observation_field_changes_the_observation_tokens",
    "environment.termination.max_turns_exceeded":
        "tests/test_env_state_keys.py::test_fail_and_truncate_score_an_episode_that_hits_max_turns_differently",
    "environment.termination.tool_error_threshold":
        "tests/test_seed_keys.py::test_tool_error_threshold_decides_when_errors_end_the_episode",
    "environment.verifier.type": "tests/test_env_tools.py::test_verifier_arithmetic_gate_and_types",
    "environment.verifier.rule_based": "tests/test_env_tools.py::test_verifier_arithmetic_gate_and_types",
    "environment.verifier.model_based": "tests/test_env_tools.py::test_verifier_arithmetic_gate_and_types",
    "environment.verifier.anti_hacking.enabled":
        "tests/test_env_customer_service.py::test_anti_hacking_disabled_and_custom_penalty",
    "environment.verifier.anti_hacking.detect_patterns":
        "tests/test_env_customer_service.py::test_anti_hacking_disabled_and_custom_penalty",
    # rollout, buffer and components
    "rollout.scheduler.type": "tests/test_pipeline_queue.py::test_windowed_get_batch_waits_for_the_straggler",
    "rollout.scheduler.window_size":
        "tests/test_pipeline_scheduler.py::test_plan_batch_slides_the_window_inside_a_batch",
    "rollout.partial_rollout.enabled":
        "tests/test_engine.py::test_without_partial_rollout_an_update_waits_for_the_running_generations",
    "rollouter.partial_rollout": "tests/test_config.py::test_partial_rollout_switch_given_on_one_side_sets_both",
    "rollout.partial_rollout.segment_length":
        "tests/test_engine.py::test_segment_length_spaces_the_interruption_points",
    "rollout.partial_rollout.reuse_policy":
        "tests/test_pipeline_staleness.py::test_on_policy_segment_only_masks_the_older_segments",
    "rollout.worker.num_workers": "tests/test_pipeline_workers.py::test_pool_bounds_concurrent_env_steps",
    "rollout.worker.max_concurrent_tasks":
        "tests/test_seed_keys.py::test_max_concurrent_tasks_bounds_the_groups_in_flight",
    "rollout.worker.task_timeout_s":
        "tests/test_seed_keys.py::test_task_timeout_and_retry_on_failure_decide_whether_an_episode_survives",
    "rollout.worker.retry_on_failure":
        "tests/test_seed_keys.py::test_task_timeout_and_retry_on_failure_decide_whether_an_episode_survives",
    "buffer.stale_filter.enabled":
        "tests/test_pipeline_keys.py::test_stale_filter_drops_what_lags_more_than_max_policy_lag",
    "buffer.stale_filter.max_policy_lag":
        "tests/test_pipeline_keys.py::test_stale_filter_drops_what_lags_more_than_max_policy_lag",
    "message_queue.max_queue_size": "tests/test_pipeline_queue.py::test_drop_oldest_at_capacity_by_hand",
    "rollouter.max_queue_size": "tests/test_config.py::test_queue_size_given_on_one_side_sets_both",
    "trainer.class": "tests/test_config_honesty.py::test_class_keys_and_mode_resolve_to_one_coherent_pipeline",
    "rollouter.class": "tests/test_config_honesty.py::test_class_keys_and_mode_resolve_to_one_coherent_pipeline",
    "message_queue.class": "tests/test_config_honesty.py::test_one_value_labels_accept_only_that_value_and_say_so",
    "trainer.ppo_mini_batch_size":
        "tests/test_seed_keys.py::test_ppo_mini_batch_size_times_require_batches_is_the_trainer_step",
    "trainer.require_batches":
        "tests/test_seed_keys.py::test_ppo_mini_batch_size_times_require_batches_is_the_trainer_step",
    "policy_optimization.rollout_allocation.max_rollouts_per_prompt":
        "tests/test_seed_keys.py::test_max_rollouts_per_prompt_caps_the_adaptive_allocation",
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
