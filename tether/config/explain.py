"""``tether config --explain KEY``: what a key does, its unit, type, default, the value the given files set,
and which source document (seed config) names it.

The text comes from the field's docstring (every field has one, ``tests/test_config_honesty.py``), the type
and constraints from its declaration, and "which seed names it" from the seed files in ``configs/seeds/``,
read at run time, so that nothing here can drift from the config classes or the seeds. An alias (a key the seeds
spell beside its canonical key, ``tether.config.aliases``) is explained from the alias table: its doc, the key it
is folded into, and that key's type.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic.fields import FieldInfo

from tether.config.aliases import ALIASES, SECTIONS, Alias, alias_of
from tether.config.base import ConfigError
from tether.config.io import _expected, _is_model, _unwrap, is_secret, load_config, merged, read_yaml
from tether.config.run import RunConfig
from tether.config.support import not_built
from tether.secrets import Secret

SEEDS_DIR = Path(__file__).resolve().parents[2] / "configs" / "seeds"
Part = str | int


def explain(key: str, files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> str:
    """The explanation of ``key`` (``a.b.c``, list items as ``a.b[0].c`` or ``a.b.c``), as printed text.

    Raises ConfigError for a key that is not in the config (with the closest known key)."""
    parts = _parse(key)
    plain = tuple(str(p) for p in parts if not isinstance(p, int))
    if plain in SECTIONS or alias_of(plain) is not None:
        return _explain_alias(plain, files, overrides)
    field, loc, dict_key = _lookup(parts)
    shown = _dotted(loc, parts)
    doc = inspect.cleandoc(field.description or "(no doc)")
    lines = [shown, *("  " + line for line in doc.splitlines())]
    lines.append(f"  type: {_type_text(field, loc, dict_key)}")
    if dict_key is None:
        lines.append(f"  default: {_show(_default(field), secret=_is_secret(field, loc))}")
    names = seed_documents().get(_plain_key(loc))
    lines.append("  named by: " + (", ".join(names) if names else "tether's own (no seed config names it)"))
    entry = not_built(tuple(str(p) for p in loc if not isinstance(p, int)))
    if entry is not None:
        what = "setting it is refused at load" if entry.refuses is None else "some values are refused at load"
        lines.append(f"  not supported yet ({what}): {entry.reason}")
    if files or overrides:
        lines += _in_files(parts, loc, files, overrides, secret=_is_secret(field, loc))
    return "\n".join(lines)


def _explain_alias(key: tuple[str, ...], files: Sequence[str | Path], overrides: Sequence[str]) -> str:
    """An alias, or a section of aliases: its doc, what it is folded into, the type, the seeds and the files."""
    alias = alias_of(key)
    dotted = ".".join(key)
    lines = [dotted, *("  " + line for line in (SECTIONS.get(key) or (alias.doc if alias else "")).splitlines())]
    if alias is None:
        keys = [a.key[-1] for a in _aliases_under(key)]
        lines.append("  type: a section of aliases with keys " + ", ".join(keys))
    else:
        target = ".".join(alias.canonical)
        how = f" as {alias.relation}" if alias.relation else ""
        lines.append(f"  alias of {target}: folded into it at load{how} (given with it, the two must agree)")
        lines.append(f"  type: {_alias_type(alias)}")
        lines.append(f"  default: unset ({target}'s default applies)")
    names = seed_documents().get(dotted)
    lines.append("  named by: " + (", ".join(names) if names else "tether's own (no seed config names it)"))
    if files or overrides:
        resolved: list[Part] | None = list(alias.canonical) if alias is not None else None
        lines += _in_files(list(key), key, files, overrides, secret=False, resolved_at=resolved)
    return "\n".join(lines)


def _aliases_under(section: tuple[str, ...]) -> list[Alias]:
    return [a for a in ALIASES if a.key[: len(section)] == section]


def _alias_type(alias: Alias) -> str:
    if alias.values is not None:
        return "one of " + ", ".join(repr(v) for v in alias.values)
    field, loc, dict_key = _lookup(list(alias.canonical))
    return _type_text(field, loc, dict_key)


@functools.cache
def seed_documents() -> dict[str, tuple[str, ...]]:
    """Every key path of the seed configs (list items without index, e.g. ``environment.action_space.name``,
    sections included) → the seed files that name it."""
    found: dict[str, list[str]] = {}

    def walk(value: Any, prefix: str, name: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                path = f"{prefix}.{k}" if prefix else str(k)
                found.setdefault(path, []).append(name)
                walk(v, path, name)
        elif isinstance(value, list):
            for item in value:
                walk(item, prefix, name)

    for path in sorted(SEEDS_DIR.glob("*.yaml")) if SEEDS_DIR.is_dir() else []:
        walk(read_yaml(path), "", path.name)
    return {k: tuple(dict.fromkeys(v)) for k, v in found.items()}


def every_field() -> list[str]:
    """The dotted path of every field of RunConfig (sections included; list items without index)."""
    out: list[str] = []

    def walk(model: Any, prefix: str) -> None:
        for name, f in model.model_fields.items():
            path = prefix + (f.alias or name)
            out.append(path)
            inner = _item_type(f.annotation)
            if _is_model(inner):
                walk(inner, path + ".")

    walk(RunConfig, "")
    return out


# ----------------------------------------------------------------------------- looking a key up

_INDEX = re.compile(r"^(.*?)\[(\d+)\]$")


def _parse(key: str) -> list[Part]:
    parts: list[Part] = []
    for raw in key.strip().split("."):
        indexes: list[int] = []
        while (m := _INDEX.match(raw)) is not None:
            raw, index = m.group(1), int(m.group(2))
            indexes.insert(0, index)
        if raw.isdigit():
            parts.append(int(raw))
        elif raw:
            parts.append(raw)
        else:
            raise ConfigError(f"--explain {key!r}: expected a key path such as policy_optimization.kl_control.horizon")
        parts += indexes
    return parts


def _item_type(tp: Any) -> Any:
    """The model a field holds, itself or as list items (else the unwrapped type)."""
    tp, _ = _unwrap(tp, [])
    if get_origin(tp) is list:
        tp, _ = _unwrap(get_args(tp)[0], [])
    return tp


def _lookup(parts: list[Part]) -> tuple[FieldInfo, tuple[Part, ...], Part | None]:
    """(the field, its location — list indexes as given, else 0 —, the dict key when the path ends in one)."""
    tp: Any = RunConfig
    field: FieldInfo | None = None
    loc: list[Part] = []
    dict_key: Part | None = None
    for part in parts:
        here = _dotted(tuple(loc), parts)
        if get_origin(tp) is list:  # an index, or a name of the items' model (index 0 stands for any item)
            loc.append(part if isinstance(part, int) else 0)
            tp, _ = _unwrap(get_args(tp)[0], [])
            if isinstance(part, int):
                continue
        if isinstance(part, int):
            raise ConfigError(f"`{here}` is not a list (asked for item [{part}])")
        if get_origin(tp) is dict and dict_key is None:
            key_type, value_type = (_unwrap(a, [])[0] for a in get_args(tp))
            if get_origin(key_type) is Literal and part not in get_args(key_type):
                raise ConfigError(f"`{here}` has no key `{part}`; its keys: " + ", ".join(get_args(key_type)))
            loc.append(part)
            dict_key, tp = part, value_type
            continue
        if not _is_model(tp):
            raise ConfigError(f"`{here}` has no keys below it (asked for `{part}`)")
        by_name = {(f.alias or n): (n, f) for n, f in tp.model_fields.items()}
        by_name.update({n: (n, f) for n, f in tp.model_fields.items()})
        if part not in by_name:
            known = [f.alias or n for n, f in tp.model_fields.items()]
            guess = difflib.get_close_matches(str(part), known, n=1, cutoff=0.6)
            hint = f"did you mean `{guess[0]}`?" if guess else "known keys here: " + ", ".join(known)
            raise ConfigError(f"unknown key `{f'{here}.{part}' if here else part}`; {hint}")
        name, field = by_name[part]
        loc.append(field.alias or name)
        tp, _ = _unwrap(field.annotation, [])
    if field is None:
        raise ConfigError("--explain needs a key path, e.g. policy_optimization.kl_control.horizon")
    return field, tuple(loc), dict_key


def _dotted(loc: tuple[Part, ...], parts: list[Part]) -> str:
    """``loc`` as the user would type it: list indexes only where the user gave them."""
    given = {p for p in parts if isinstance(p, int)}
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]" if p in given else ""
        else:
            out += f".{p}" if out else str(p)
    return out


def _plain_key(loc: tuple[Part, ...]) -> str:
    return ".".join(str(p) for p in loc if not isinstance(p, int))


# ----------------------------------------------------------------------------- describing it


def _type_text(field: FieldInfo, loc: tuple[Part, ...], dict_key: Part | None) -> str:
    tp, meta = _unwrap(field.annotation, list(field.metadata))
    optional = tp is not field.annotation and type(None) in get_args(field.annotation)
    if dict_key is not None:
        return f"{_describe(get_args(tp)[1], loc)} (the value under `{dict_key}`)"
    text = _describe(tp, loc)
    return f"{text}, or null" if optional else text


def _describe(tp: Any, loc: tuple[Part, ...]) -> str:
    tp, _ = _unwrap(tp, [])
    if get_origin(tp) is Literal:
        values = [repr(v) if isinstance(v, str) else _show(v) for v in get_args(tp)]
        return f"{values[0]} (the only value today)" if len(values) == 1 else "one of " + ", ".join(values)
    if tp is Secret:
        return "a secret string: a literal or a ${VAR} reference (never printed)"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if _is_model(tp):
        return "a section with keys " + ", ".join(f.alias or n for n, f in tp.model_fields.items())
    if get_origin(tp) is list:
        item, _ = _unwrap(get_args(tp)[0], [])
        if _is_model(item):
            return "a list of mappings with keys " + ", ".join(f.alias or n for n, f in item.model_fields.items())
        return f"a list; each item: {_describe(item, (*loc, 0))}"
    if get_origin(tp) is dict:
        k, v = (_describe(a, (*loc, "k")) for a in get_args(tp))
        return f"a mapping; keys: {k}; values: {v}"
    return _expected(loc, None).removeprefix("expected ")


def _default(field: FieldInfo) -> Any:
    if field.is_required():
        return "(required)"
    return field.get_default(call_default_factory=True)


def _is_secret(field: FieldInfo, loc: tuple[Part, ...]) -> bool:
    tp, _ = _unwrap(field.annotation, [])
    return tp is Secret or is_secret(loc)


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _show(value: Any, *, secret: bool = False) -> str:
    if isinstance(value, str) and value == "(required)":
        return value
    if secret and value is not None:
        return Secret(value).redacted() if isinstance(value, str) else str(value)
    value = _plain(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _pick(data: Any, parts: list[Part]) -> tuple[bool, Any]:
    """The value at ``parts`` in plain data; a name after a list without index maps over its items."""
    for n, part in enumerate(parts):
        if isinstance(data, list) and not isinstance(part, int):
            picked = [_pick(item, parts[n:]) for item in data]
            return any(found for found, _ in picked), [v for found, v in picked if found]
        if isinstance(part, int):
            if not isinstance(data, list) or part >= len(data):
                return False, None
            data = data[part]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return False, None
    return True, data


def _in_files(parts: list[Part], loc: tuple[Part, ...], files: Sequence[str | Path], overrides: Sequence[str],
              *, secret: bool, resolved_at: list[Part] | None = None) -> list[str]:
    """The value the given files (and --set) write at the key, who wrote it, and the resolved value (of the key,
    or of ``resolved_at``: an alias's canonical key)."""
    data, origins = merged(files, overrides)
    names = _names_as_given(parts, loc)
    found, value = _pick(data, names)
    plain = tuple(p for p in names if not isinstance(p, int))
    sources = []  # who set the key, a key below it, or the list or section above it that holds it
    for k, source in origins.items():
        k = tuple(p for p in k if not isinstance(p, int))
        if (k[: len(plain)] == plain or plain[: len(k)] == k) and source not in sources:
            sources.append(source)
    lines = [f"  in the given files: {_show(value, secret=secret)} ({', '.join(sources)})" if found
             else "  in the given files: not set (the default applies)"]
    try:
        cfg = load_config(files, overrides)
    except ConfigError:
        lines.append("  resolved: the files do not load (run `tether config FILES` for the errors)")
        return lines
    found, value = _pick(cfg.model_dump(mode="json", by_alias=True), resolved_at or names)
    if found:
        at = f"{'.'.join(map(str, resolved_at))} = " if resolved_at else ""
        lines.append(f"  resolved: {at}{_show(value, secret=secret)}")
    return lines


def _names_as_given(parts: list[Part], loc: tuple[Part, ...]) -> list[Part]:
    """``parts`` with each name replaced by its alias (``class_`` → ``class``), as the files spell it."""
    names = [p for p in loc if not isinstance(p, int)]
    out, it = [], iter(names)
    for p in parts:
        out.append(p if isinstance(p, int) else next(it))
    return out
