"""Every config key has an effect or is refused: unbuilt features refused at load, one-value labels that say
so, class keys that select the pipeline, warnings for values that cannot act within the run, and a doc for
every field that `tether config --explain` prints."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from tether.cli import app
from tether.config import ConfigError, RunConfig, load_config
from tether.config.explain import every_field, explain, seed_documents
from tether.config.inert import horizon_for, inert_values, max_kl_coef_change
from tether.config.io import _unwrap
from tether.config.sections import PIPELINES
from tether.config.support import UNSUPPORTED

SEEDS = sorted((Path(__file__).resolve().parents[1] / "configs" / "seeds").glob("*.yaml"))
runner = CliRunner()


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- refused: not built yet

# (--set override, the key the message names, the words that say what is missing)
REFUSED = [
    ("actor_worker.strategy=megatron", "`actor_worker.strategy` = 'megatron' (--set)", "FSDP2 only"),
]


@pytest.mark.parametrize("override, key, reason", REFUSED, ids=[r[0].partition("=")[0] for r in REFUSED])
def test_key_of_an_unbuilt_feature_is_refused_naming_it(override, key, reason):
    message = str(pytest.raises(ConfigError, load_config, [], [override]).value)
    assert message.startswith(key) and "not supported yet" in message and reason in message, message


def test_every_unsupported_entry_is_exercised():
    tested = {r[0].partition("=")[0].split(".")[0] for r in REFUSED} | {r[0].partition("=")[0] for r in REFUSED}
    for entry in UNSUPPORTED:
        assert ".".join(entry.key) in tested, entry.key


def test_refusal_names_the_file_that_set_the_key(tmp_path):
    """ray.weight_transfer: nccl beside it is built (test_ray_weight_broadcast.py): the one refusal is megatron."""
    path = write(tmp_path, "cluster.yaml", "actor_worker: {strategy: megatron}\nray: {weight_transfer: nccl}\n")
    message = str(pytest.raises(ConfigError, load_config, [path]).value)
    assert message.startswith(f"`actor_worker.strategy` = 'megatron' ({path}): not supported yet"), message
    assert "weight_transfer" not in message


def test_defaults_and_the_supported_values_are_not_refused(tmp_path):
    cfg = load_config([], ["backend=local", "engine.type=local"])
    assert cfg.backend == "local" and cfg.engine.type == "local"
    again = load_config([write(tmp_path, "dump.yaml", RunConfig().to_yaml())])  # a dump sets every key it has
    assert again == RunConfig()


def test_one_value_labels_accept_only_that_value_and_say_so():
    """A Literal with one value (and no null) is a label, not a choice: its doc says it is the only value today."""
    seen = []
    todo, done = [RunConfig], set()
    while todo:
        model = todo.pop()
        if model in done:
            continue
        done.add(model)
        for name, f in model.model_fields.items():
            tp, _ = _unwrap(f.annotation, [])
            inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                todo.append(inner)
            if typing.get_origin(f.annotation) is typing.Literal and len(typing.get_args(f.annotation)) == 1:
                seen.append(f"{model.__name__}.{name}")
                assert "the only value today" in " ".join(f.description.split()), f"{model.__name__}.{name}"
    assert len(seen) >= 8, seen  # metric, estimator, allocation_metric, optimizer.type, memory.type, ...
    message = str(pytest.raises(ConfigError, load_config, [], ["policy_optimization.advantage.estimator=gae"]).value)
    assert "`policy_optimization.advantage.estimator` = 'gae' in --set: allowed: 'group_relative'" in message


# ----------------------------------------------------------------------------- class keys select the pipeline

# (rollout.mode, trainer.class, rollouter.class) as set (None = unset) -> resolved mode
CLASSES = [
    ((None, None, None), "sync"),
    (("fully_async", None, None), "fully_async"),
    (("one_step_off_policy", None, None), "one_step_off_policy"),
    ((None, "FullyAsyncTrainer", "FullyAsyncRollouter"), "fully_async"),
    ((None, "FullyAsyncTrainer", None), "fully_async"),
    ((None, None, "OneStepOffRollouter"), "one_step_off_policy"),
    ((None, "Trainer", "Rollouter"), "sync"),
    (("async", "FullyAsyncTrainer", None), "fully_async"),
    (("sync", "Trainer", None), "sync"),
]
PAIRS = {"sync": ("Trainer", "Rollouter"), "one_step_off_policy": ("OneStepOffTrainer", "OneStepOffRollouter"),
         "fully_async": ("FullyAsyncTrainer", "FullyAsyncRollouter")}


def _overrides(mode, trainer, rollouter):
    given = {"rollout.mode": mode, "trainer.class": trainer, "rollouter.class": rollouter}
    return [f"{k}={v}" for k, v in given.items() if v is not None]


@pytest.mark.parametrize("given, mode", CLASSES, ids=["-".join(map(str, c[0])) for c in CLASSES])
def test_class_keys_and_mode_resolve_to_one_coherent_pipeline(given, mode):
    cfg = load_config([], _overrides(*given))
    assert cfg.rollout.mode == mode
    assert PIPELINES[cfg.rollout.mode] == PAIRS[mode]
    assert not hasattr(cfg.trainer, "class_") and not hasattr(cfg, "rollouter")  # the pipeline is held once
    assert cfg.message_queue.class_ == "MessageQueue"


@pytest.mark.parametrize("given, keys", [
    (("sync", "FullyAsyncTrainer", "FullyAsyncRollouter"), ["rollout.mode", "trainer.class", "rollouter.class"]),
    (("one_step_off_policy", None, "FullyAsyncRollouter"), ["rollout.mode", "rollouter.class"]),
    ((None, "Trainer", "FullyAsyncRollouter"), ["trainer.class", "rollouter.class"]),
])
def test_disagreeing_class_keys_or_mode_are_an_error_naming_them(given, keys):
    message = str(pytest.raises(ConfigError, load_config, [], _overrides(*given)).value)
    for key in keys:
        assert f"`{key}` = " in message, message


# ----------------------------------------------------------------------------- warnings: values that cannot act


def test_defaults_warn_about_what_cannot_act_in_100_steps():
    assert RunConfig().warnings() == [
        "policy_optimization.rollout_allocation.reallocation_interval = 100 >= trainer.total_steps = 100: adaptive "
        "allocation never reallocates in this run (every task gets group_size rollouts, as with strategy: fixed); "
        "set it below 100",
        "environment.state.max_turns = 20 is never reached: the agent loop ends an episode after at most "
        "agent_loop.max_assistant_turns × max_parallel_calls = 5 × 2 = 10 environment steps, so "
        "termination.max_turns_exceeded never applies",
    ]


def test_a_config_whose_values_all_act_has_no_warning():
    cfg = load_config([], ["policy_optimization.rollout_allocation.reallocation_interval=10",
                           "environment.state.max_turns=10", "policy_optimization.kl_control.horizon=100"])
    assert cfg.warnings() == []


def _warnings(*overrides):
    return load_config([], list(overrides)).warnings()


def test_each_warning_names_its_key():
    base = ["policy_optimization.rollout_allocation.reallocation_interval=5", "environment.state.max_turns=10",
            "policy_optimization.kl_control.horizon=100", "trainer.total_steps=20", "trainer.save_every=10"]
    assert _warnings(*base) == []
    cases = {
        "trainer.eval_every=21": "trainer.eval_every = 21 > trainer.total_steps = 20: held-out evaluation runs only "
                                 "at step 0 and at the end",
        "trainer.save_every=50": "trainer.save_every = 50 > trainer.total_steps = 20: the only checkpoint is the one "
                                 "at the end",
        "policy_optimization.rollout_allocation.reallocation_interval=20":
            "policy_optimization.rollout_allocation.reallocation_interval = 20 >= trainer.total_steps = 20",
        "agent_loop.max_parallel_calls=1": "environment.state.max_turns = 10 is never reached: the agent loop ends "
                                           "an episode after at most agent_loop.max_assistant_turns × "
                                           "max_parallel_calls = 5 × 1 = 5 environment steps",
        "policy_optimization.kl_control.init_coef=0": "policy_optimization.kl_control.adaptive = true with "
                                                      "init_coef = 0: the controller scales β, so β stays 0",
    }
    for override, expected in cases.items():
        got = _warnings(*base, override)
        assert len(got) == 1 and got[0].startswith(expected), (override, got)
    # fixed allocation, no KL or a fixed β: the keys that would not act are not in play
    assert _warnings(*base, "policy_optimization.rollout_allocation.strategy=fixed",
                     "policy_optimization.rollout_allocation.reallocation_interval=20") == []
    assert _warnings(*base, "policy_optimization.kl_control.horizon=100000",
                     "policy_optimization.kl_control.adaptive=false") == []


def test_trigger_parameter_sync_step_beyond_the_run_warns_in_async_modes_only():
    over = ["trainer.trigger_parameter_sync_step=30", "trainer.total_steps=20", "trainer.eval_every=0",
            "trainer.save_every=0", "environment.state.max_turns=10",
            "policy_optimization.rollout_allocation.strategy=fixed", "policy_optimization.kl_control.adaptive=false"]
    assert _warnings(*over) == []  # sync pushes every step
    for mode in ("fully_async", "one_step_off_policy"):
        assert _warnings(*over, f"rollout.mode={mode}") == [
            f"trainer.trigger_parameter_sync_step = 30 > trainer.total_steps = 20: the rollouter never receives new "
            f"weights in this run ({mode}); every rollout comes from the initial policy"]


def test_adaptive_kl_that_cannot_move_beta_warns_with_the_horizon_that_would():
    # per step β changes by at most 0.2 · 64 / 10000 = 0.128 %; over 16 steps 1.00128^16 − 1 = 2.07 %
    assert max_kl_coef_change(64, 10_000, 16) == pytest.approx(0.020677, abs=1e-6)
    # 10 % over 16 steps needs 1.1^(1/16) − 1 = 0.5975 % per step: horizon <= 0.2 · 64 / 0.005975 = 2142
    assert horizon_for(64, 16) == 2142
    assert max_kl_coef_change(64, 2142, 16) >= 0.10 > max_kl_coef_change(64, 2143, 16)
    got = [w for w in _warnings("trainer.total_steps=16") if "kl_control" in w]
    assert got == ["policy_optimization.kl_control.adaptive = true with horizon = 10000 trajectories: β can change "
                   "by at most 2.1% over 16 steps of 64 trajectories, so it stays ≈ init_coef; for β to follow "
                   "target_kl set horizon <= 2142 (or adaptive: false)"]
    assert not [w for w in _warnings("trainer.total_steps=16", "policy_optimization.kl_control.horizon=2142")
                if "kl_control" in w]


def test_tether_config_prints_warnings_as_comments_that_load_back(tmp_path):
    result = runner.invoke(app, ["config", str(SEEDS[4]), "--set", "trainer.total_steps=16"])
    assert SEEDS[4].name == "policy_optim.yaml" and result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("# warning: ")]
    assert lines == [f"# warning: {w}" for w in load_config([SEEDS[4]], ["trainer.total_steps=16"]).warnings()]
    assert len(lines) == 4  # reallocation_interval, kl_control.adaptive, save_every, max_turns
    assert load_config([write(tmp_path, "dump.yaml", result.stdout)]).trainer.total_steps == 16


# ----------------------------------------------------------------------------- docs and --explain


def test_every_field_has_a_doc_with_its_unit():
    fields = every_field()
    assert len(fields) > 150
    for path in fields:
        text = explain(path)
        doc = text.splitlines()[1].strip()
        assert doc and doc != "(no doc)", path
        name = path.rsplit(".", 1)[-1]
        if name.endswith("_s"):
            assert "second" in text, path
        if name.endswith("_ms") or path.endswith("latency_ms.median") or path.endswith("latency_ms.max"):
            assert "ms" in text, path
        if name.startswith(("max_tokens", "context_window", "segment_length")):
            assert "token" in text, path


def test_explain_pins_one_key(tmp_path):
    path = write(tmp_path, "kl.yaml", "policy_optimization:\n  kl_control: {horizon: 500}\n")
    assert explain("policy_optimization.kl_control.horizon", [path]) == "\n".join([
        "policy_optimization.kl_control.horizon",
        "  Adaptive controller horizon, in trajectories: β moves by at most 20 % × batch_size / horizon per step.",
        "  type: an integer >= 1",
        "  default: 10000",
        "  named by: tether's own (no seed config names it)",
        f"  in the given files: 500 ({path})",
        "  resolved: 500",
    ])


def test_explain_names_the_seed_and_what_is_not_built():
    text = explain("actor_worker.strategy")
    assert "type: one of 'none', 'fsdp', 'fsdp2', 'veOmni', 'megatron'" in text
    assert "named by: separation_config.yaml" in text and "not supported yet (some values are refused" in text
    text = explain("rollout.mode")
    assert "named by: async_pipeline.yaml" in text and "default: sync" in text
    assert "type: 'gym_like' (the only value today)" in explain("environment.type")
    assert "named by: env_config.yaml" in explain("environment.action_space[2].timeout_ms")


def test_seed_documents_are_read_from_the_seed_files():
    docs = seed_documents()
    assert docs["trainer.class"] == ("fully_async_ppo.yaml",)
    assert docs["environment.verifier.rule_based.check"] == ("env_config.yaml",)
    assert docs["learner.off_policy_correction.tis_enabled"] == ("async_pipeline.yaml",)
    assert set(n for names in docs.values() for n in names) == {p.name for p in SEEDS}


@pytest.mark.parametrize("seed", SEEDS, ids=[p.name for p in SEEDS])
def test_explain_works_for_every_key_of_the_seed(seed):
    keys = [k for k, names in seed_documents().items() if seed.name in names]
    assert keys
    for key in keys:
        result = runner.invoke(app, ["config", str(seed), "--explain", key])
        assert result.exit_code == 0, (key, result.output)
        assert result.stdout.startswith(key + "\n") and f"named by: {seed.name}" in result.stdout, result.stdout
        assert "in the given files: " in result.stdout and "not set" not in result.stdout, result.stdout


def test_explain_of_an_alias_names_its_canonical_key_and_the_resolved_value(tmp_path):
    path = write(tmp_path, "q.yaml", "rollouter: {max_queue_size: 7}\n")
    text = explain("rollouter.max_queue_size", [path])
    assert text.startswith("rollouter.max_queue_size\n  Message-queue capacity, in groups")
    assert "alias of message_queue.max_queue_size: folded into it at load" in text and "type: an integer >= 1" in text
    assert f"in the given files: 7 ({path})" in text and "resolved: message_queue.max_queue_size = 7" in text
    text = explain("trainer.require_batches")
    assert "as learner.batch_size = trainer.ppo_mini_batch_size × trainer.require_batches" in text
    assert "type: one of 'Trainer', 'OneStepOffTrainer', 'FullyAsyncTrainer'" in explain("trainer.class")
    assert "a section of aliases with keys max_queue_size, partial_rollout, class" in explain("rollouter")


def test_explain_of_an_unknown_key_exits_2_with_a_guess():
    result = runner.invoke(app, ["config", "--explain", "policy_optimization.kl_control.horizn"])
    assert result.exit_code == 2 and "did you mean `horizon`?" in result.stderr


def test_async_only_keys_set_in_sync_mode_warn_and_defaults_do_not(tmp_path):
    seed = Path(__file__).resolve().parents[1] / "configs" / "seeds" / "async_pipeline.yaml"
    warned = load_config([seed], ["rollout.mode=sync"]).warnings()
    for key in ("buffer.type", "rollout.partial_rollout.replay_buffer_size", "rollout.scheduler.max_staleness"):
        assert any(w.startswith(f"{key} acts in the async modes only") for w in warned), key
    assert not any("acts in the async modes only" in w for w in load_config([seed]).warnings())  # fully_async
    assert not any("acts in the async modes only" in w for w in RunConfig().warnings())  # defaults: no claim
    both = load_config([write(tmp_path, "v.yaml", "trainer: {use_trainer_do_validate: false}")]).warnings()
    assert any(w.startswith("trainer.use_trainer_do_validate acts in the async modes only") for w in both)


def test_tis_settings_that_cannot_change_the_weights_warn():
    tis = lambda **kw: RunConfig.model_validate({"learner": {"off_policy_correction": kw}}).warnings()  # noqa: E731
    assert any("tis_enabled = false has no effect" in w
               for w in tis(method="truncated_importance_sampling", tis_enabled=False))
    # band [0.8, 1.2] and cap 2: no in-band weight reaches the cap; a cap of 1.1 does act
    assert any("truncation never acts" in w for w in tis(tis_enabled=True, tis_cap=2.0))
    assert not any("truncation never acts" in w for w in tis(tis_enabled=True, tis_cap=1.1))


def test_lr_decay_ends_at_the_runs_last_update_and_its_inert_values_warn():
    opt = "policy_optimization.optimizer"
    cfg = load_config([], [f"{opt}.lr_scheduler=cosine", "trainer.total_steps=16", "learner.batch_size=64",
                           "learner.mini_batch_size=16", "learner.update_frequency=2"])
    assert cfg.policy_optimization.optimizer.decay_steps == 16 * 4 * 2  # steps × updates a step × epochs
    assert load_config([], [f"{opt}.lr_scheduler=linear", f"{opt}.decay_steps=7"]).policy_optimization.optimizer \
        .decay_steps == 7
    assert RunConfig().policy_optimization.optimizer.decay_steps is None  # constant: nothing to end
    for key in ("min_lr_ratio=0.1", "decay_steps=100"):
        assert any(w.startswith(f"{opt}.{key.split('=')[0]} acts with lr_scheduler cosine or linear only")
                   for w in _warnings(f"{opt}.{key}")), key
    assert any("falls from lr to lr × min_lr_ratio in one update" in w for w in
               _warnings(f"{opt}.lr_scheduler=cosine", f"{opt}.decay_steps=5", f"{opt}.warmup_steps=4"))
    assert any("min_lr_ratio = 1" in w for w in _warnings(f"{opt}.lr_scheduler=cosine", f"{opt}.min_lr_ratio=1"))
    assert not any(w.startswith(opt) for w in _warnings(f"{opt}.lr_scheduler=cosine", f"{opt}.min_lr_ratio=0.1"))


def test_the_flagship_example_warns_about_nothing_in_itself():
    """examples/customer_service/config.yaml is the reference a newcomer copies: no value in it is inert at start."""
    assert inert_values(load_config(["examples/customer_service/config.yaml"])) == []
