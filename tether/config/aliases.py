"""Aliases: the seeds' second spellings of one number, folded into one canonical key at load.

The seed configs name some values twice (verl's fully_async recipe beside tether's own sections): the queue's
capacity in ``rollouter`` and in ``message_queue``, the partial-rollout switch in ``rollouter`` and in ``rollout``,
the group size in ``rollout_allocation`` and in ``advantage``, the pipeline by ``rollout.mode`` and by the
trainer's and rollouter's classes, and the step size by ``learner.batch_size`` and by ``trainer.ppo_mini_batch_size
× trainer.require_batches``. ``RunConfig`` holds each value once, under its canonical key: ``fold`` moves each alias
found in the data to its canonical key before validation (``tether.config.io.load_config`` with the files that set
them, so that errors name them; ``RunConfig`` itself for data given in Python). An alias given alone sets the
canonical key; given with it (or with another alias of it) and disagreeing, it is an error that names both keys,
who set them and both values. The alias keys are not fields of any section: ``ALIASES`` is their only declaration,
with their docs, which ``tether config --explain`` prints.

``trainer.ppo_mini_batch_size`` is not an alias: it is the async trainer's queue batch (``Plan.groups_per_take``)
and stays a field. ``trainer.require_batches`` (queue batches per step) is the alias, of the factor that makes
``learner.batch_size = ppo_mini_batch_size × require_batches``; as in the seed, either trainer key given without
``learner.batch_size`` sets it (the other at its default, 64 or 2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from tether.config.base import CrossFieldError
from tether.config.sections import PIPELINES, LearnerConfig, RolloutConfig, TrainerConfig

Key = tuple[str, ...]
Origins = dict[tuple[Any, ...], str]


@dataclass(frozen=True)
class Alias:
    key: Key
    """The seed's spelling, e.g. ("rollouter", "max_queue_size")."""
    canonical: Key
    """The key RunConfig holds the value under, e.g. ("message_queue", "max_queue_size")."""
    doc: str
    """What the key means, as ``--explain`` prints it."""
    names: str = "one number"
    """What the alias and its canonical key name, for the error when they disagree."""
    values: Mapping[str, Any] | None = None
    """The alias's allowed values → the canonical value each means (None: the same value)."""
    same: Callable[[Any, Any], bool] = field(default=lambda given, folded: given == folded)
    """Whether the canonical key as given (raw) holds the alias's folded value."""
    relation: str = ""
    """How the alias is folded, when it is not the same value (``--explain``)."""


def _mode(raw: Any) -> Any:
    """``rollout.mode`` as validated (the seed's ``async`` is fully_async); an invalid mode as given."""
    try:
        return RolloutConfig(mode=raw).mode
    except ValidationError:
        return raw


_PAIRS = "; ".join(f"{t} + {r} run {m}" for m, (t, r) in PIPELINES.items())

ALIASES: tuple[Alias, ...] = (
    Alias(("rollouter", "max_queue_size"), ("message_queue", "max_queue_size"),
          "Message-queue capacity, in groups; when full the oldest group is dropped.", names="one queue"),
    Alias(("rollouter", "partial_rollout"), ("rollout", "partial_rollout", "enabled"),
          "Interrupted generations resume under the new weights (true) or the weight sync waits for them (false).",
          names="one switch"),
    Alias(("policy_optimization", "rollout_allocation", "base_rollouts_per_prompt"),
          ("policy_optimization", "advantage", "group_size"),
          "Rollouts per prompt before reallocation, in rollouts.",
          names="one number (rollouts per task before reallocation)"),
    Alias(("trainer", "class"), ("rollout", "mode"),
          "The pipeline, named by its trainer: Trainer (sync), OneStepOffTrainer (one_step_off_policy) or "
          "FullyAsyncTrainer (fully_async).",
          names=f"one pipeline ({_PAIRS})", values={t: m for m, (t, _) in PIPELINES.items()},
          same=lambda given, mode: _mode(given) == mode),
    Alias(("rollouter", "class"), ("rollout", "mode"),
          "The pipeline, named by its rollouter: Rollouter (sync), OneStepOffRollouter (one_step_off_policy) or "
          "FullyAsyncRollouter (fully_async).",
          names=f"one pipeline ({_PAIRS})", values={r: m for m, (_, r) in PIPELINES.items()},
          same=lambda given, mode: _mode(given) == mode),
    Alias(("trainer", "require_batches"), ("learner", "batch_size"),
          "Queue batches per trainer step, in batches (2 when only ppo_mini_batch_size is given).",
          relation="learner.batch_size = trainer.ppo_mini_batch_size × trainer.require_batches"),
)

SECTIONS: dict[Key, str] = {
    ("rollouter",): "The seed's rollouter section (verl's fully_async recipe). Each of its keys is an alias, folded "
                    "at load: " + ", ".join(f"{a.key[-1]} into {'.'.join(a.canonical)}"
                                           for a in ALIASES if a.key[0] == "rollouter") + ".",
}
"""Sections made of aliases only: no field of RunConfig; dropped at load once their keys are folded."""

_PPO, _BATCHES, _BATCH, _MINI = (("trainer", "ppo_mini_batch_size"), ("trainer", "require_batches"),
                                 ("learner", "batch_size"), ("learner", "mini_batch_size"))


def alias_of(key: tuple[Any, ...]) -> Alias | None:
    """The table's entry for ``key`` (a key path as written in a file), if it is an alias."""
    return next((a for a in ALIASES if a.key == tuple(key)), None)


def fold(data: dict[Any, Any], origins: Origins | None = None) -> list[CrossFieldError]:
    """Move each alias in ``data`` (merged config data, changed in place) to its canonical key; an entry of
    ``origins`` (key path → file) is added for each canonical key set so, naming the alias. Returns the conflicts
    and bad alias values, each a CrossFieldError whose ``values`` are keyed by full key paths."""
    problems = _fold_step(data, origins)
    for canonical in dict.fromkeys(a.canonical for a in ALIASES if a.key != _BATCHES):
        problems += _fold_one(data, origins, [a for a in ALIASES if a.canonical == canonical])
    for section in SECTIONS:
        if _get(data, section) == (True, {}):
            _pop(data, section)
    return problems


def _fold_one(data: dict[Any, Any], origins: Origins | None, aliases: list[Alias]) -> list[CrossFieldError]:
    canonical = aliases[0].canonical
    given: list[tuple[Alias, Any]] = []  # (alias, its folded value)
    raws: dict[str, Any] = {}  # each alias given → its value as written
    for a in aliases:
        found, raw = _pop(data, a.key)
        if not found:
            continue
        if a.values is not None and not (isinstance(raw, str) and raw in a.values):
            return [CrossFieldError(f"allowed: {_one_of(a.values)}", {_dotted(a.key): raw})]
        given.append((a, a.values[raw] if a.values is not None else raw))
        raws[_dotted(a.key)] = raw
    if not given:
        return []
    first, value = given[0]
    if any(v != value for _, v in given[1:]):
        return [CrossFieldError(f"{' and '.join(raws)} name {first.names}", raws)]
    found, held = _get(data, canonical)
    if not found:
        _set(data, canonical, value)
        if origins is not None:
            origins[canonical] = ", ".join(f"{origins.get(a.key, '--set')} (as `{_dotted(a.key)}`)" for a, _ in given)
    elif not first.same(held, value):
        if first.values is not None:  # the class keys name the mode
            rule = (f"{' and '.join(dict.fromkeys(map(str, raws.values())))} run {_dotted(canonical)} {value}: set "
                    f"the mode to {value}, or unset the class keys to follow the mode")
        else:
            rule = (f"{_dotted(canonical)} and {' and '.join(raws)} name {first.names}: make them equal (or set "
                    f"only one)")
        return [CrossFieldError(rule, {_dotted(canonical): held, **raws})]
    return []


def _fold_step(data: dict[Any, Any], origins: Origins | None) -> list[CrossFieldError]:
    """``trainer.require_batches`` into ``learner.batch_size = ppo_mini_batch_size × require_batches``."""
    (ppo_given, ppo), (batches_given, batches) = _get(data, _PPO), _pop(data, _BATCHES)
    batch_given, batch = _get(data, _BATCH)
    if not batches_given and (not ppo_given or batch_given):
        return []  # the learner's side alone, or a queue batch within a given step (its divisibility: RunConfig)
    if batches_given and not _positive_int(batches):
        return [CrossFieldError("expected an integer >= 1", {_dotted(_BATCHES): batches})]
    if not ppo_given:
        ppo = TrainerConfig.model_fields["ppo_mini_batch_size"].default
        _set(data, _PPO, ppo)  # the queue batch that require_batches counts, held as given
    if not _positive_int(ppo):
        return []  # the validation names the bad ppo_mini_batch_size
    step = ppo * (batches if batches_given else 2)  # 2: the seed's require_batches
    if batch_given:
        if batch == step:
            return []
        return [CrossFieldError(
            "trainer.ppo_mini_batch_size × trainer.require_batches is the samples of one trainer step, which "
            "learner.batch_size also sets: make them equal (or set only one side)",
            {_dotted(_PPO): ppo, _dotted(_BATCHES): batches if batches_given else 2, _dotted(_BATCH): batch})]
    _set(data, _BATCH, step)
    if origins is not None:
        origins[_BATCH] = ", ".join(f"{origins.get(k, '--set')} (as `{_dotted(k)}`)"
                                    for k, g in ((_PPO, ppo_given), (_BATCHES, batches_given)) if g)
    if not _get(data, _MINI)[0] and step % LearnerConfig.model_fields["mini_batch_size"].default:
        _set(data, _MINI, ppo)  # one optimizer update per queue batch when the default does not divide the step
        if origins is not None:
            origins[_MINI] = origins[_BATCH]
    return []


def _one_of(values: Mapping[str, Any]) -> str:
    shown = [repr(v) for v in values]
    return f"{', '.join(shown[:-1])} or {shown[-1]}"


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _get(data: Any, key: Key) -> tuple[bool, Any]:
    for part in key:
        if not isinstance(data, dict) or part not in data:
            return False, None
        data = data[part]
    return True, data


def _pop(data: Any, key: Key) -> tuple[bool, Any]:
    found, parent = _get(data, key[:-1])
    if not found or not isinstance(parent, dict) or key[-1] not in parent:
        return False, None
    return True, parent.pop(key[-1])


def _set(data: dict[Any, Any], key: Key, value: Any) -> None:
    for part in key[:-1]:
        if data.get(part) is None:
            data[part] = {}  # a section not given (or given as null): the alias is its one key
        elif not isinstance(data[part], dict):
            return  # a section that is not a mapping: the validation names it
        data = data[part]
    data[key[-1]] = value


def _dotted(key: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in key)
