"""Loading a RunConfig: YAML files deep-merged in order, ``--set`` overrides, errors that say where.

Merging: mappings merge key by key, a later file wins, lists and scalars are replaced whole. Every leaf
remembers who set it (a file path or ``--set``), so an error names the key path, that source, the bad
value and what is allowed. Nothing is read from the environment here: ``${VAR}`` stays as written until
a secret is used.

Aliases (``tether.config.aliases``): after merging, each alias is moved to its canonical key, and the canonical
key's origin names it (``r.yaml (as `rollouter.max_queue_size`)``), so a bad value is reported where it was written.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel, ValidationError

from tether.config.aliases import ALIASES, SECTIONS, fold
from tether.config.base import ConfigError, CrossFieldError
from tether.config.run import RunConfig
from tether.config.support import refusals
from tether.secrets import Secret, looks_secret

Key = tuple[Any, ...]  # a key path, e.g. ("rollout", "scheduler", "max_staleness")
Origins = dict[Key, str]  # key path of each leaf -> the file (or "--set") that set it
SET = "--set"


def load_config(paths: Sequence[str | Path] | str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Merge the YAML ``paths`` in order, apply ``--set key.path=value`` ``overrides``, validate.

    Raises ConfigError naming the key path, the file that set it, the value and what is allowed; a key
    whose feature is not built yet (``tether.config.support.UNSUPPORTED``) is refused the same way."""
    data, origins = merged(paths, overrides)
    lines = refusals(data, origins)  # keys whose feature is not built (tether.config.support)
    lines += [describe_rule(problem, (), origins) for problem in fold(data, origins)]
    lines += bools_as_numbers(data, origins)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        lines += [describe_error(err, origins) for err in e.errors()]
    if lines:
        head = f"{len(lines)} errors in config:\n  - " if len(lines) > 1 else ""
        raise ConfigError(head + "\n  - ".join(lines)) from None
    return cfg


def merged(paths: Sequence[str | Path] | str | Path, overrides: Sequence[str] = ()) -> tuple[dict[Any, Any], Origins]:
    """The files and ``--set`` overrides deep-merged, not validated, and who set each leaf."""
    if isinstance(paths, str | Path):
        paths = [paths]
    data: dict[Any, Any] = {}
    origins: Origins = {}
    for path in paths:
        merge(data, read_yaml(path), str(path), origins)
    for text in overrides:
        key, value = parse_override(text)
        for part in reversed(key):
            value = {part: value}
        merge(data, value, SET, origins)
    return data, origins


# What an API key looks like (a provider's prefix, or 24+ letters and digits): a config file so named, with no folder
# and no .yaml, is most likely the value of a `--set KEY VALUE` written with a space, and is not echoed.
_KEY_VALUE = re.compile(r"(?:(?:sk|pk|rk|hf|gsk|r8|ghp|gho|ghs|github_pat|glpat|xox[abprs]|nvapi)[-_]|AKIA|AIza|eyJ)"
                        r"[-_A-Za-z0-9.]{8,}|(?=\S*[0-9])(?=\S*[A-Za-z])[-_A-Za-z0-9]{24,}")


def _looks_like_a_key(name: str) -> bool:
    return not name.endswith((".yaml", ".yml")) and bool(_KEY_VALUE.fullmatch(name))


def read_yaml(path: str | Path) -> dict[Any, Any]:
    """One config file as a mapping of sections; an empty file is an empty mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if _looks_like_a_key(str(path)):
            raise ConfigError("config file not found (its name is not shown: it looks like a key; --set takes "
                              "key=value as one word, e.g. --set 'llm_client.api_key=${VAR}')") from None
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        node = yaml.compose(text)
        assert node is not None  # the document is not empty: data is not None
        line = node.start_mark.line + 1
        raise ConfigError(
            f"{path}:{line}: the top level must be a mapping of sections (e.g. `learner:`), "
            f"got {_type_name(data)}"
        )
    return data


def parse_override(text: str) -> tuple[Key, Any]:
    """``"a.b=c"`` -> (("a", "b"), c) with c parsed as YAML (``4``, ``[1, 2]``, ``null``, ``fifo``)."""
    key, sep, raw = text.partition("=")
    parts = tuple(p.strip() for p in key.split("."))
    if not sep and re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*", text):  # a key alone: `--set KEY VALUE`
        value = "'${VAR}'" if looks_secret(parts[-1]) else "VALUE"
        raise ConfigError(f"--set {text}: no value; --set takes key.path=value as one word, e.g. --set {text}={value} "
                          "(a value after a space is read as a config file, and is not shown here)")
    if not sep or not all(parts):
        secretish = any(looks_secret(word) for word in re.split(r"\W+", text))  # no '=': key and value are one text
        shown = repr(text) if not secretish else "(not shown: it may hold a secret)"
        raise ConfigError(f"--set {shown}: expected key.path=value, e.g. --set learner.batch_size=32")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        if is_secret(parts):  # the YAML error quotes the value: say only where to look
            raise ConfigError(f"--set {key.strip()}=…: the value is not valid YAML (not shown: the key looks "
                              f"secret); quote it, e.g. --set '{key.strip()}=\"...\"'") from None
        raise ConfigError(f"--set {text!r}: the value is not valid YAML: {e}") from None
    return parts, value


def is_secret(key: Key) -> bool:
    """A key whose value must never be echoed: declared ``Secret``, or named like one (``*_key``, ``*token*``,
    ``*secret*``, ``password``) unless declared a number or a bool (``engine.max_tokens``)."""
    tp, _ = _type_at(key)
    if tp is Secret:
        return True
    return tp not in (int, float, bool) and bool(key) and looks_secret(str(key[-1]))


def bools_as_numbers(data: Any, origins: Origins, key: Key = ()) -> list[str]:
    """``true``/``false`` given for an integer or number key: pydantic's lax mode would take it as 1/0."""
    if isinstance(data, dict):
        return [line for k, v in data.items() for line in bools_as_numbers(v, origins, (*key, k))]
    if isinstance(data, list):
        return [line for i, v in enumerate(data) for line in bools_as_numbers(v, origins, (*key, i))]
    if isinstance(data, bool) and _type_at(key)[0] in (int, float):
        return [f"`{_dotted(key)}` = {data} in {_where(key, origins)}: {_expected(key, None)}"]
    return []


def merge(base: dict, update: dict, source: str, origins: Origins, prefix: Key = ()) -> None:
    """Deep-merge ``update`` into ``base`` in place (later wins, lists replaced) and record ``source``
    as the origin of every leaf it sets."""
    for k, v in update.items():
        key = (*prefix, k)
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            merge(base[k], v, source, origins, key)
            continue
        for old in [o for o in origins if o[: len(key)] == key]:
            del origins[old]
        base[k] = copy.deepcopy(v)
        _record(v, key, source, origins)


def _record(value: Any, key: Key, source: str, origins: Origins) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _record(v, (*key, k), source, origins)
    else:
        origins[key] = source


def sources_of(key: Key, origins: Origins) -> list[str]:
    """Who set ``key``: the source of the key or of its closest set parent, else of the keys under it."""
    for i in range(len(key), 0, -1):
        if key[:i] in origins:
            return [origins[key[:i]]]
    return list(dict.fromkeys(s for k, s in origins.items() if k[: len(key)] == key))


# ----------------------------------------------------------------------------- error messages

_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def describe_error(err: Any, origins: Origins) -> str:
    """One pydantic error as a sentence: key path, source, value, what is allowed."""
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    is_key = bool(loc) and loc[-1] == "[key]"  # a bad key of a dict field
    if is_key:
        loc = loc[:-1]
    path = _dotted(loc)
    where = _where(loc, origins)

    if kind == "extra_forbidden" and tuple(loc) in SECTIONS and isinstance(err.get("input"), dict):
        names = [a.key[-1] for a in ALIASES if a.key[:-1] == tuple(loc)]  # what folding left of an alias section
        return "; ".join(_unknown(f"{path}.{k}", where, str(k), names) for k in err["input"])
    if kind == "extra_forbidden":
        model = _type_at(loc[:-1])[0]
        names = [f.alias or n for n, f in model.model_fields.items()] if _is_model(model) else []
        return _unknown(path, where, str(loc[-1]), names)
    if kind == "value_error" and isinstance(ctx.get("error"), CrossFieldError):
        return describe_rule(ctx["error"], loc, origins)
    if kind == "missing":
        return f"`{path}` is required ({where}): {_expected(loc, 'a value')}"

    value = _short(err.get("input")) if not is_secret(loc) else "(not shown: a secret)"
    if is_key:
        return f"unknown key `{path}` in {where}; allowed: {ctx.get('expected', err['msg'])}"
    if kind == "literal_error":
        allowed = f"allowed: {ctx['expected']}"
    elif kind in _BOUNDS or kind in _EXPECTED:
        allowed = _expected(loc, _EXPECTED.get(kind))
    elif kind == "value_error":
        allowed = str(ctx.get("error", err["msg"]))
    else:
        allowed = err["msg"]
    return f"`{path}` = {value} in {where}: {allowed}"


def describe_rule(rule: CrossFieldError, loc: Key, origins: Origins) -> str:
    """A rule between keys as a sentence: each key (relative to ``loc``) with its value and source, then the rule."""
    parts = []
    for rel, value in rule.values.items():
        full = (*loc, *(int(k) if k.isdigit() else k for k in rel.split(".")))  # list indices as in pydantic
        parts.append(f"`{_dotted(full)}` = {value!r} ({_where(full, origins)})")
    return ", ".join(parts) + f": {rule.rule}"


def _unknown(path: str, where: str, name: str, names: list[str]) -> str:
    guess = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"did you mean `{guess[0]}`?" if guess else "known keys: " + ", ".join(names)
    return f"unknown key `{path}` in {where}; {hint}"


def _where(loc: Key, origins: Origins) -> str:
    found = sources_of(loc, origins)
    return ", ".join(found) if found else "the defaults"


def _dotted(loc: Key) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(value: Any) -> str:
    return {list: "a list", str: "a string", int: "an integer", float: "a number", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _expected(loc: Key, fallback: str | None) -> str:
    """``expected an integer >= 0`` / ``expected a number in (0, 1)`` from the field's declaration."""
    tp, meta = _type_at(loc)
    name = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, fallback)
    lo = hi = None  # (bound, inclusive)
    for m in meta:
        if isinstance(m, at.Gt | at.Ge):
            lo = (m.gt, False) if isinstance(m, at.Gt) else (m.ge, True)
        elif isinstance(m, at.Lt | at.Le):
            hi = (m.lt, False) if isinstance(m, at.Lt) else (m.le, True)
    if lo and hi:
        rng = f"in {'[' if lo[1] else '('}{lo[0]}, {hi[0]}{']' if hi[1] else ')'}"
    elif lo:
        rng = f"{'>=' if lo[1] else '>'} {lo[0]}"
    elif hi:
        rng = f"{'<=' if hi[1] else '<'} {hi[0]}"
    else:
        rng = ""
    return f"expected {name or 'a valid value'} {rng}".rstrip()


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _unwrap(tp: Any, meta: list[Any]) -> tuple[Any, list[Any]]:
    """Strip ``Annotated`` (collecting its constraints) and ``| None``."""
    while True:
        if get_origin(tp) is Annotated:
            tp, *extra = get_args(tp)
            for m in extra:
                meta = meta + list(getattr(m, "metadata", [m]))
        elif get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp, meta
            tp = rest[0]
        else:
            return tp, meta


def _type_at(loc: Key) -> tuple[Any, list[Any]]:
    """The declared type (and its constraints) of the key at ``loc``; (None, []) when unknown."""
    tp, meta = _unwrap(RunConfig, [])
    for part in loc:
        if _is_model(tp):
            field = next((f for n, f in tp.model_fields.items() if part in (n, f.alias)), None)
            if field is None:
                return None, []
            tp, meta = _unwrap(field.annotation, list(field.metadata))
        elif get_origin(tp) is list and isinstance(part, int):
            tp, meta = _unwrap(get_args(tp)[0], [])
        elif get_origin(tp) is dict:
            tp, meta = _unwrap(get_args(tp)[1], [])
        else:
            return None, []
    return tp, meta

