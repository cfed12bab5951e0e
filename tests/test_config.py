"""RunConfig: the seed files load (less the sections whose feature is not built, which are refused), merging
and overrides, errors that say where, secrets. Refusals, class keys, warnings and --explain:
tests/test_config_honesty.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from tether.config import (
    ConfigError,
    EnvironmentConfig,
    RunConfig,
    Secret,
    Section,
    load_config,
)
from tether.config.aliases import SECTIONS as ALIAS_SECTIONS
from tether.config.plan import Plan
from tether.config.sections import PIPELINES
from tether.config.support import REFUSED_SECTIONS
from tether.secrets import redact_by_name

REPO = Path(__file__).resolve().parents[1]
SEEDS = ["agent_loop_config.yaml", "async_pipeline.yaml", "env_config.yaml",
         "fully_async_ppo.yaml", "policy_optim.yaml", "separation_config.yaml"]
# the seed keys whose feature is not built: loading them is refused, naming each key (tether.config.support)
REFUSED_IN_SEED: dict[str, list[str]] = {}  # none left: separation_config.yaml's pools are the Ray backend's


def seed_dir(where: str) -> Path:
    """The seed configs as shipped in the repository (no test reads outside it)."""
    return REPO / "configs" / "seeds"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def supported_part(path: Path, tmp_path: Path) -> Path:
    """A copy of the seed file without the sections refused at load (the rest must still parse)."""
    data = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k not in REFUSED_SECTIONS}
    return write(tmp_path, path.name, yaml.safe_dump(data))


def unchecked(text: str) -> RunConfig:
    """Validate without the load-time refusal of unbuilt features (to test the typed sections they keep)."""
    return RunConfig.model_validate(yaml.safe_load(text))


# ----------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("where", ["repo"])
@pytest.mark.parametrize("name", SEEDS)
def test_each_seed_file_loads_or_names_its_unbuilt_keys(where, name, tmp_path):
    path = seed_dir(where) / name
    if name in REFUSED_IN_SEED:
        message = str(pytest.raises(ConfigError, load_config, [path]).value)
        for key in REFUSED_IN_SEED[name]:
            assert f"`{key}`" in message, message
        assert "not supported yet" in message and name in message
        load_config([supported_part(path, tmp_path)])  # what remains loads
    else:
        load_config([path])
    data = yaml.safe_load(path.read_text())
    for section in data:  # every top-level key of the file is a section of the config (or of its aliases)
        assert section in RunConfig.model_fields or (section,) in ALIAS_SECTIONS
    RunConfig.model_validate(data)  # the refused sections keep their typed shape too


@pytest.mark.parametrize("where", ["repo"])
def test_all_seeds_merged_spot_checks(where, tmp_path):
    # fully_async_ppo.yaml's trainer step (64 × 2 batches) and async_pipeline.yaml's learner.batch_size (64)
    # disagree; merged, one of them has to give way (test_seed_step_sizes_conflict_when_merged)
    cfg = load_config([supported_part(seed_dir(where) / n, tmp_path) for n in SEEDS], ["trainer.require_batches=1"])
    assert cfg.rollout.mode == "fully_async"  # the seed says "async"
    lr = cfg.policy_optimization.optimizer.lr
    assert lr == 1e-6 and type(lr) is float  # PyYAML reads `1e-6` as a string
    assert cfg.trainer.trigger_parameter_sync_step == 4
    assert PIPELINES[cfg.rollout.mode][0] == "FullyAsyncTrainer"
    assert cfg.tool_parser.name == "function_call_parser" and cfg.tool_parser.stop_token_ids == [128009]
    assert cfg.learner.off_policy_correction.method == "double_sided_importance_sampling"
    assert cfg.environment.action_space[1].params == ["order_id", "reason_code"]
    assert cfg.environment.verifier.model_based[0].rubric == "response_quality"
    assert cfg.message_queue.max_queue_size == 512 and not hasattr(cfg, "rollouter")  # held once
    assert Plan.of(cfg).totals() == {"samples_per_step": 64, "prompts_per_step": 8, "group_size": 8,
                             "optimizer_updates_per_step": 8, "micro_batch_size": 4, "eval_tasks": 64}


@pytest.mark.parametrize("where", ["repo"])
def test_refused_seed_sections_keep_their_typed_shape(where):
    data = yaml.safe_load((seed_dir(where) / "separation_config.yaml").read_text())
    cfg = RunConfig.model_validate(data)
    assert cfg.actor_worker.strategy == "fsdp2" and cfg.actor_worker.class_ == "DetachActorWorker"
    assert cfg.resource_pool.rollout_pool.num_gpus == 8
    client = load_config([seed_dir(where) / "agent_loop_config.yaml"]).llm_client  # built: loads as it is
    assert isinstance(client.api_key, Secret) and client.model == "your-rollout-model-id"


def test_environment_defaults_equal_env_config_yaml():
    data = yaml.safe_load((REPO / "configs/seeds/env_config.yaml").read_text())
    assert EnvironmentConfig.model_validate(data["environment"]) == EnvironmentConfig()


def test_defaults_are_valid_and_a_single_section_loads(tmp_path):
    cfg = RunConfig()
    assert cfg.rollout.mode == "sync" and cfg.policy_optimization.optimizer.lr == 1e-6
    assert cfg.model.preset == "tiny" and cfg.llm_client.api_key is None
    one = load_config([write(tmp_path, "one.yaml", "engine:\n  temperature: 0.5\n")])
    assert one.engine.temperature == 0.5 and one.learner == cfg.learner


def _models(root: type[BaseModel]) -> set[type[BaseModel]]:
    found, todo = set(), [root]
    while todo:
        model = todo.pop()
        if model in found:
            continue
        found.add(model)
        for f in model.model_fields.values():
            todo += [t for t in _types_in(f.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
    return found


def _types_in(tp):
    yield tp
    for arg in getattr(tp, "__args__", ()):
        yield from _types_in(arg)


def test_every_model_forbids_extra_keys_and_documents_every_field():
    models = _models(RunConfig)
    assert len(models) >= 30
    for model in models:
        assert model.model_config["extra"] == "forbid", model
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no docstring"


def test_secret_looking_string_fields_must_be_secret():
    with pytest.raises(TypeError, match="looks like a secret"):
        class Bad(Section):
            auth_token: str = ""
            """A token."""


# ----------------------------------------------------------------------------- merging and overrides


def test_merge_later_wins_mappings_merge_lists_replace(tmp_path):
    a = write(tmp_path, "a.yaml", "learner:\n  batch_size: 32\n  mini_batch_size: 4\n"
                                  "tool_parser:\n  stop_token_ids: [1, 2, 3]\n")
    b = write(tmp_path, "b.yaml", "learner:\n  batch_size: 16\ntool_parser:\n  stop_token_ids: [9]\n")
    cfg = load_config([a, b])
    assert (cfg.learner.batch_size, cfg.learner.mini_batch_size) == (16, 4)
    assert cfg.tool_parser.stop_token_ids == [9]


def test_set_overrides_parse_yaml_values(tmp_path):
    cfg = load_config([supported_part(REPO / "configs/seeds/agent_loop_config.yaml", tmp_path)],
                      ["agent_loop.max_parallel_calls=4", "tool_parser.stop_token_ids=[1,2]",
                       "rollout.mode=async", "policy_optimization.optimizer.lr=3e-4",
                       "metrics.wandb_project=null"])
    assert cfg.agent_loop.max_parallel_calls == 4
    assert cfg.tool_parser.stop_token_ids == [1, 2]
    assert cfg.rollout.mode == "fully_async"
    assert cfg.policy_optimization.optimizer.lr == 3e-4
    assert cfg.metrics.wandb_project is None


def test_numeric_string_accepted_for_float(tmp_path):
    cfg = load_config([write(tmp_path, "lr.yaml", 'policy_optimization:\n  optimizer:\n    lr: "2e-5"\n')])
    assert cfg.policy_optimization.optimizer.lr == 2e-5


def test_seed_step_sizes_conflict_when_merged():
    with pytest.raises(ConfigError) as err:
        load_config([seed_dir("repo") / n for n in SEEDS])
    msg = str(err.value)
    for part in ("`trainer.ppo_mini_batch_size` = 64 (", "`trainer.require_batches` = 2 (",
                 "`learner.batch_size` = 64 (", "make them equal"):
        assert part in msg


def test_trainer_step_keys_set_the_learner_batch(tmp_path):
    cfg = load_config([write(tmp_path, "t.yaml", "trainer: {ppo_mini_batch_size: 16, require_batches: 3}\n")])
    assert (cfg.learner.batch_size, cfg.learner.mini_batch_size) == (48, 8)  # 8 still divides 48
    cfg = load_config([write(tmp_path, "t.yaml", "trainer: {ppo_mini_batch_size: 10, require_batches: 2}\n"
                                                 "policy_optimization: {advantage: {group_size: 4}}\n")])
    assert (cfg.learner.batch_size, cfg.learner.mini_batch_size) == (20, 10)  # 8 does not: one update per queue batch
    cfg = load_config([], ["learner.batch_size=24"])  # learner side only: the trainer's queue batch follows
    assert (cfg.trainer.ppo_mini_batch_size, cfg.learner.batch_size // cfg.trainer.ppo_mini_batch_size) == (12, 2)
    assert not hasattr(cfg.trainer, "require_batches")  # folded into learner.batch_size: held once


def test_partial_rollout_switch_given_on_one_side_sets_both(tmp_path):
    cfg = load_config([write(tmp_path, "r.yaml", "rollouter:\n  partial_rollout: false\n")])
    assert cfg.rollout.partial_rollout.enabled is False
    with pytest.raises(ConfigError, match="name one switch"):
        load_config([], ["rollouter.partial_rollout=false", "rollout.partial_rollout.enabled=true"])


def test_queue_size_given_on_one_side_sets_both(tmp_path):
    cfg = load_config([write(tmp_path, "q.yaml", "rollouter:\n  max_queue_size: 7\n")])
    assert cfg.message_queue.max_queue_size == 7


# (alias as given, canonical key, the value the run holds)
ALIASES_ALONE = [
    ({"rollouter": {"max_queue_size": 7}}, "message_queue.max_queue_size", 7),
    ({"rollouter": {"partial_rollout": False}}, "rollout.partial_rollout.enabled", False),
    ({"policy_optimization": {"rollout_allocation": {"base_rollouts_per_prompt": 4}}},
     "policy_optimization.advantage.group_size", 4),
    ({"trainer": {"class": "OneStepOffTrainer"}}, "rollout.mode", "one_step_off_policy"),
    ({"rollouter": {"class": "FullyAsyncRollouter"}}, "rollout.mode", "fully_async"),
    ({"trainer": {"require_batches": 3, "ppo_mini_batch_size": 16}}, "learner.batch_size", 48),
]


@pytest.mark.parametrize("given, canonical, value", ALIASES_ALONE, ids=[a[1] for a in ALIASES_ALONE])
def test_an_alias_sets_its_canonical_key_and_the_config_holds_it_once(tmp_path, given, canonical, value):
    for cfg in (RunConfig.model_validate(given), load_config([write(tmp_path, "a.yaml", yaml.safe_dump(given))])):
        held: object = cfg
        for part in canonical.split("."):
            held = getattr(held, part)
        assert held == value
        dump = yaml.safe_load(cfg.to_yaml())
        assert "rollouter" not in dump and "class" not in dump["trainer"] and "require_batches" not in dump["trainer"]
        assert "base_rollouts_per_prompt" not in dump["policy_optimization"]["rollout_allocation"]
        assert load_config([write(tmp_path, "dump.yaml", cfg.to_yaml())]) == cfg


def test_disagreeing_aliases_given_in_python_are_an_error_too():
    with pytest.raises(ValueError, match="name one queue: make them equal"):
        RunConfig.model_validate({"rollouter": {"max_queue_size": 7}, "message_queue": {"max_queue_size": 8}})
    with pytest.raises(ValueError, match="rollouter"):  # an alias is no field: a section cannot hold it
        RunConfig.model_validate({"rollouter": {"max_queue_size": 7, "max_queue_sise": 8}})
    given = {"trainer": {"require_batches": 1, "ppo_mini_batch_size": 32}}
    data = {"trainer": dict(given["trainer"])}
    RunConfig.model_validate(data)
    assert data == given  # the caller's mappings are left as given


def test_a_queue_batch_that_does_not_divide_the_step_is_an_error(tmp_path):
    message = str(pytest.raises(ConfigError, load_config, [], ["trainer.ppo_mini_batch_size=24",
                                                                "learner.batch_size=64"]).value)
    assert "`trainer.ppo_mini_batch_size` = 24 (--set)" in message and "`learner.batch_size` = 64 (--set)" in message
    assert "must divide learner.batch_size" in message


def test_a_bad_value_given_through_an_alias_names_the_alias_and_its_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "r.yaml", "rollouter:\n  max_queue_size: 0\n  max_queue_sise: 3\n")
    message = str(pytest.raises(ConfigError, load_config, ["r.yaml"]).value)
    assert "`message_queue.max_queue_size` = 0 in r.yaml (as `rollouter.max_queue_size`): expected an integer >= 1" \
        in message
    assert "unknown key `rollouter.max_queue_sise` in r.yaml; did you mean `max_queue_size`?" in message


def test_model_path_alone_replaces_default_preset(tmp_path):
    cfg = load_config([], ["model.path=/models/qwen"])
    assert (cfg.model.preset, cfg.model.path) == (None, "/models/qwen")


def test_round_trip_of_the_dump(tmp_path):
    cfg = load_config([supported_part(REPO / "configs/seeds" / n, tmp_path) for n in SEEDS],
                      ["environment.action_space=[]", "trainer.require_batches=1"])
    dump = cfg.to_yaml()
    assert not REFUSED_SECTIONS & set(yaml.safe_load(dump))  # left out, so that the dump loads back
    again = load_config([write(tmp_path, "dump.yaml", dump)])
    assert again == cfg


def test_dump_keeps_a_key_reference_and_never_a_literal_key(tmp_path):
    cfg = load_config([], ["llm_client.api_key=${TETHER_TEST_KEY}"])
    dump = cfg.to_yaml()
    assert "${TETHER_TEST_KEY}" in dump and load_config([write(tmp_path, "dump.yaml", dump)]) == cfg
    literal = load_config([], ["llm_client.api_key=sk-literal-0042"]).to_yaml()
    assert "sk-literal-0042" not in literal and "api_key: '***'" in literal  # (a 401 then says it was a dump)


# ----------------------------------------------------------------------------- bad configs

# (id, {file name: text}, --set overrides, substrings the message must contain)
BAD = [
    ("unknown_section", {"bad.yaml": "learnr:\n  batch_size: 8\n"}, [],
     ["unknown key `learnr`", "bad.yaml", "did you mean `learner`?"]),
    ("unknown_nested_key", {"bad.yaml": "learner:\n  batchsize: 8\n"}, [],
     ["unknown key `learner.batchsize` in ", "bad.yaml", "did you mean `batch_size`?"]),
    ("wrong_type", {"bad.yaml": "learner:\n  batch_size: lots\n"}, [],
     ["`learner.batch_size` = 'lots'", "bad.yaml", "expected an integer >= 1"]),
    ("negative_max_staleness", {"bad.yaml": "rollout:\n  scheduler:\n    max_staleness: -1\n"}, [],
     ["`rollout.scheduler.max_staleness` = -1", "bad.yaml", "expected an integer >= 0"]),
    ("clip_ratio_above_1", {"bad.yaml": "learner:\n  off_policy_correction:\n    clip_ratio: 1.5\n"}, [],
     ["`learner.off_policy_correction.clip_ratio` = 1.5", "bad.yaml", "expected a number in (0, 1)"]),
    ("bad_mode", {"bad.yaml": "rollout:\n  mode: asynchronous\n"}, [],
     ["`rollout.mode` = 'asynchronous'", "bad.yaml", "'sync', 'one_step_off_policy' or 'fully_async'"]),
    ("mini_batch_above_batch", {"b.yaml": "learner:\n  batch_size: 8\n",
                                "m.yaml": "learner:\n  mini_batch_size: 16\n"}, [],
     ["`learner.mini_batch_size` = 16 (m.yaml)", "`learner.batch_size` = 8 (b.yaml)",
      "mini_batch_size must be <= batch_size"]),
    ("max_rollouts_below_base",
     {"bad.yaml": "policy_optimization:\n  rollout_allocation:\n    max_rollouts_per_prompt: 4\n"}, [],
     ["`policy_optimization.rollout_allocation.max_rollouts_per_prompt` = 4 (", "bad.yaml",
      "`policy_optimization.advantage.group_size` = 8 (the defaults)",
      "must be >= base_rollouts_per_prompt"]),
    ("group_size_and_base_rollouts_differ",
     {"bad.yaml": "policy_optimization:\n  advantage: {group_size: 4}\n"
                  "  rollout_allocation: {base_rollouts_per_prompt: 8}\n"}, [],
     ["`policy_optimization.advantage.group_size` = 4 (bad.yaml)",
      "`policy_optimization.rollout_allocation.base_rollouts_per_prompt` = 8 (bad.yaml)", "make them equal"]),
    ("max_kl_below_target", {"bad.yaml": "policy_optimization:\n  kl_control:\n    target_kl: 0.1\n"}, [],
     ["`policy_optimization.kl_control.max_kl` = 0.05", "`policy_optimization.kl_control.target_kl` = 0.1",
      "bad.yaml", "max_kl must be >= target_kl"]),
    ("bad_base_url", {"bad.yaml": "llm_client:\n  base_url: ftp://example.com\n"}, [],
     ["`llm_client.base_url` = 'ftp://example.com'", "bad.yaml", "http:// or https://"]),
    ("preset_and_path", {"bad.yaml": "model:\n  preset: tiny\n  path: /models/m\n"}, [],
     ["`model.preset` = 'tiny'", "`model.path` = '/models/m'", "bad.yaml", "exactly one of preset and path"]),
    ("negative_stop_token", {"bad.yaml": "tool_parser:\n  stop_token_ids: [128009, -1]\n"}, [],
     ["`tool_parser.stop_token_ids[1]` = -1", "bad.yaml", "expected an integer >= 0"]),
    ("penalty_unknown_pattern",
     {"bad.yaml": "environment:\n  verifier:\n    anti_hacking:\n      penalty: {flattery: 0.5}\n"}, [],
     ["unknown key `environment.verifier.anti_hacking.penalty.flattery`", "bad.yaml",
      "'repeated_tool_calls', 'context_stuffing' or 'no_op_pass'"]),
    ("conflicting_queue_sizes", {"r.yaml": "rollouter:\n  max_queue_size: 256\n",
                                 "q.yaml": "message_queue:\n  max_queue_size: 512\n"}, [],
     ["`message_queue.max_queue_size` = 512 (q.yaml)", "`rollouter.max_queue_size` = 256 (r.yaml)",
      "make them equal"]),
    ("bad_set_path", {"ok.yaml": "learner:\n  batch_size: 8\n"}, ["learner.batchsize=4"],
     ["unknown key `learner.batchsize` in --set", "did you mean `batch_size`?"]),
    ("bad_set_value", {"ok.yaml": "agent_loop:\n  max_user_turns: 2\n"}, ["agent_loop.max_parallel_calls=0"],
     ["`agent_loop.max_parallel_calls` = 0 in --set", "expected an integer >= 1"]),
    ("set_without_equals", {"ok.yaml": "{}\n"}, ["learner.batch_size"],
     ["--set learner.batch_size: no value", "--set takes key.path=value as one word"]),
    ("yaml_syntax_error", {"bad.yaml": "learner:\n  batch_size: [8\n"}, [],
     ["bad.yaml:3:", "YAML syntax error"]),
    ("top_level_list", {"bad.yaml": "# a list, not sections\n- learner\n- rollout\n"}, [],
     ["bad.yaml:2:", "top level must be a mapping of sections", "got a list"]),
    ("missing_file", {}, [], ["config file not found:", "nope.yaml"]),
    ("bad_rule_check_in_list",
     {"bad.yaml": "environment:\n  verifier:\n    rule_based:\n      - {check: tone, weight: 1}\n"}, [],
     ["`environment.verifier.rule_based[0].check` = 'tone'", "bad.yaml",
      "'refund_amount_correct' or 'policy_compliance'"]),
    ("weight_out_of_range",
     {"bad.yaml": "environment:\n  verifier:\n    model_based:\n      - {rubric: efficiency, weight: 11}\n"}, [],
     ["`environment.verifier.model_based[0].weight` = 11", "bad.yaml", "expected a number in [0, 10]"]),
    ("top_p_zero", {"bad.yaml": "engine:\n  top_p: 0\n"}, [],
     ["`engine.top_p` = 0", "bad.yaml", "expected a number in (0, 1]"]),
    ("section_not_a_mapping", {"bad.yaml": "rollout: fast\n"}, [],
     ["`rollout` = 'fast'", "bad.yaml", "expected a mapping"]),
    ("batch_not_multiple_of_group",
     {"bad.yaml": "learner: {batch_size: 12, mini_batch_size: 4, gradient_accumulation_steps: 1}\n"}, [],
     ["`learner.batch_size` = 12 (bad.yaml)", "`policy_optimization.advantage.group_size` = 8 (the defaults)",
      "must be a multiple of"]),
    ("lr_not_a_number", {"bad.yaml": "policy_optimization:\n  optimizer:\n    lr: fast\n"}, [],
     ["`policy_optimization.optimizer.lr` = 'fast'", "bad.yaml", "expected a number > 0"]),
    ("bad_trainer_class", {"bad.yaml": "trainer:\n  class: PPOTrainer\n"}, [],
     ["`trainer.class` = 'PPOTrainer'", "bad.yaml", "'Trainer', 'OneStepOffTrainer' or 'FullyAsyncTrainer'"]),
    ("bad_queue_class", {"bad.yaml": "message_queue:\n  class: RedisQueue\n"}, [],
     ["`message_queue.class` = 'RedisQueue'", "bad.yaml", "allowed: 'MessageQueue'"]),
    ("api_key_not_a_string", {"bad.yaml": "llm_client:\n  api_key: [1, 2]\n"}, [],
     ["`llm_client.api_key`", "bad.yaml", "expected a string"]),
    ("async_classes_in_sync_mode", {"c.yaml": "trainer: {class: FullyAsyncTrainer}\n"
                                              "rollouter: {class: FullyAsyncRollouter}\n",
                                    "m.yaml": "rollout: {mode: sync}\n"}, [],
     ["`rollout.mode` = 'sync' (m.yaml)", "`trainer.class` = 'FullyAsyncTrainer' (c.yaml)",
      "`rollouter.class` = 'FullyAsyncRollouter' (c.yaml)", "run rollout.mode fully_async"]),
    ("mixed_classes", {"c.yaml": "trainer: {class: Trainer}\nrollouter: {class: FullyAsyncRollouter}\n"}, [],
     ["`trainer.class` = 'Trainer' (c.yaml)", "`rollouter.class` = 'FullyAsyncRollouter' (c.yaml)",
      "name one pipeline", "Trainer + Rollouter run sync"]),
]


@pytest.mark.parametrize("name, files, overrides, expected", BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_key_file_and_what_is_allowed(tmp_path, monkeypatch, name, files, overrides, expected):
    monkeypatch.chdir(tmp_path)  # paths as a user types them, so messages show `m.yaml`
    paths = [write(tmp_path, f, text).name for f, text in files.items()] or ["nope.yaml"]
    with pytest.raises(ConfigError) as info:
        load_config(paths, overrides)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in:\n{message}"


def test_error_names_the_file_that_set_the_key_last(tmp_path):
    a = write(tmp_path, "first.yaml", "rollout:\n  scheduler:\n    max_staleness: 2\n")
    b = write(tmp_path, "second.yaml", "rollout:\n  scheduler:\n    max_staleness: -3\n")
    message = str(pytest.raises(ConfigError, load_config, [a, b]).value)
    assert "second.yaml" in message and "first.yaml" not in message


def test_all_errors_are_reported_at_once(tmp_path):
    path = write(tmp_path, "bad.yaml", "learner:\n  batchsize: 8\nengine:\n  top_p: 2\n")
    message = str(pytest.raises(ConfigError, load_config, [path]).value)
    assert message.startswith("2 errors in config:")
    assert "learner.batchsize" in message and "engine.top_p" in message


# ----------------------------------------------------------------------------- secrets


# llm_client.api_key is the only secret today (tests/test_llm_client.py: it never reaches a request's output).


def test_secret_reference_is_resolved_only_when_used(tmp_path, monkeypatch):
    monkeypatch.delenv("TETHER_TEST_KEY", raising=False)
    cfg = unchecked('llm_client:\n  api_key: "${TETHER_TEST_KEY}"\n')
    with pytest.raises(ConfigError, match=r"`llm_client.api_key` refers to environment variable TETHER_TEST_KEY"):
        cfg.llm_client.api_key.get()

    monkeypatch.setenv("TETHER_TEST_KEY", "sk-resolved-7731")
    assert cfg.llm_client.api_key.get() == "sk-resolved-7731"
    assert cfg.llm_client.resolved()["api_key"] == "sk-resolved-7731"
    for shown in (cfg.to_yaml(), repr(cfg), str(cfg), str(cfg.model_dump()), cfg.model_dump_json()):
        assert "sk-resolved-7731" not in shown
    assert cfg.model_dump(mode="json")["llm_client"]["api_key"] == "${TETHER_TEST_KEY}"


def test_literal_secret_never_shown(tmp_path):
    cfg = unchecked("llm_client:\n  api_key: sk-literal-9911\n")
    assert cfg.llm_client.api_key.get() == "sk-literal-9911"
    for shown in (cfg.to_yaml(), repr(cfg), str(cfg), repr(cfg.llm_client.api_key), str(cfg.model_dump())):
        assert "sk-literal-9911" not in shown
    assert cfg.model_dump(mode="json")["llm_client"]["api_key"] == "***"


def test_base_url_and_model_resolve_lazily(tmp_path, monkeypatch):
    monkeypatch.delenv("TETHER_TEST_URL", raising=False)
    monkeypatch.setenv("TETHER_TEST_MODEL", "qwen-7b")
    cfg = unchecked("llm_client: {base_url: '${TETHER_TEST_URL}', model: '${TETHER_TEST_MODEL}'}")
    with pytest.raises(ConfigError, match=r"`llm_client.base_url` refers to environment variable TETHER_TEST_URL"):
        cfg.llm_client.resolved()
    monkeypatch.setenv("TETHER_TEST_URL", "http://localhost:8000/v1")
    assert cfg.llm_client.resolved() == {"base_url": "http://localhost:8000/v1", "api_key": None,
                                         "model": "qwen-7b"}
    monkeypatch.setenv("TETHER_TEST_URL", "localhost:8000")
    with pytest.raises(ConfigError, match="http:// or https://"):
        cfg.llm_client.resolved()


def test_string_under_a_secret_looking_key_is_redacted_in_dumps():
    assert redact_by_name({"x": {"hf_token": "hf_abc", "password": "${PW}", "stop_token_ids": [1]}}) == {
        "x": {"hf_token": "***", "password": "${PW}", "stop_token_ids": [1]}
    }
