"""Tasks of a plugin environment: from a JSONL or YAML file, or from a Python function.

A task record is an object; ``split`` (``train`` or ``eval``, the held-out split) is required, ``id``, ``kind``
and ``tools`` (the task's tool selection, ``agent_loop.tool_selection: per_sample``) are optional, and every
other key is the task's data (``Task.data``: what the environment's functions read)::

    {"split": "train", "prompt": "What is 12 * 7 + 3?", "answer": 87}
    {"split": "eval", "id": "hard_1", "kind": "two_step", "prompt": "What is (3 + 4) * 5?", "answer": 35}

- ``.jsonl``: one record per line (blank lines skipped);
- ``.yaml`` / ``.yml``: a list of records, or a mapping ``{train: [...], eval: [...]}`` whose records then need
  no ``split``.

A task without an ``id`` is named ``<split>_<index>`` (``train_000`` …, index within its split). Ids must be
unique across both splits. Every problem raises ``TaskFileError`` naming the file and the line (JSONL) or the
record. A function source is ``tasks(split, config) -> list[Task | dict]`` (dicts read as records of that split).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tether.types import Task

SPLITS = ("train", "eval")
RESERVED = ("id", "split", "kind", "tools")
TaskSource = str | Path | Callable[[str, Any], Sequence[Task | Mapping[str, Any]]]


class TaskFileError(ValueError):
    """A task file or record that cannot be used; the message names where."""


def record_task(record: Any, where: str, split: str | None = None, index: int = 0) -> Task:
    """One record (see the module docstring) as a ``Task``; ``split`` is the split the record must be in (or
    gives it, when the record has none)."""
    if isinstance(record, Task):
        if split is not None and record.split != split:
            raise TaskFileError(f"{where}: task {record.id!r} is in split {record.split!r}, listed as {split!r}")
        return record
    if not isinstance(record, Mapping):
        raise TaskFileError(f"{where}: a task is an object with a split and its data, got {type(record).__name__}")
    got = record.get("split", split)
    if got not in SPLITS:
        raise TaskFileError(f"{where}: split must be one of {list(SPLITS)}, got {got!r}")
    if split is not None and got != split:
        raise TaskFileError(f"{where}: the record's split {got!r} differs from the list it is in ({split!r})")
    tid = record.get("id", f"{got}_{index:03d}")
    kind = record.get("kind", "task")
    tools = record.get("tools")
    if not isinstance(tid, str) or not tid or not isinstance(kind, str):
        raise TaskFileError(f"{where}: id and kind must be non-empty strings")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, str) for t in tools)):
        raise TaskFileError(f"{where}: tools must be a list of tool names")
    data = {k: v for k, v in record.items() if k not in RESERVED}
    return Task(id=tid, split=got, kind=kind, data=data, tools=tuple(tools) if tools is not None else None)


def _numbered(tasks: Sequence[tuple[str, Any, str | None]]) -> dict[str, list[Task]]:
    out: dict[str, list[Task]] = {s: [] for s in SPLITS}
    seen: dict[str, str] = {}
    for where, record, split in tasks:
        got = record.get("split", split) if isinstance(record, Mapping) else split
        task = record_task(record, where, split, len(out[got]) if isinstance(got, str) and got in out else 0)
        if task.id in seen:
            raise TaskFileError(f"{where}: task id {task.id!r} is also used at {seen[task.id]}")
        seen[task.id] = where
        out[task.split].append(task)
    return out


def load_task_file(path: str | Path) -> dict[str, list[Task]]:
    """``{"train": [...], "eval": [...]}`` from a JSONL or YAML file (module docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskFileError(f"{path}: no such task file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{path}: cannot read it ({e})") from None
    records: list[tuple[str, Any, str | None]] = []
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((f"{path}:{n}", json.loads(line), None))
                except json.JSONDecodeError as e:
                    raise TaskFileError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    elif path.suffix in (".yaml", ".yml"):
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise TaskFileError(f"{path}: YAML syntax error ({e})") from None
        if isinstance(doc, list):
            records = [(f"{path}: task {i}", r, None) for i, r in enumerate(doc)]
        elif isinstance(doc, Mapping) and set(doc) <= set(SPLITS):
            for split in SPLITS:
                items = doc.get(split) or []
                if not isinstance(items, list):
                    raise TaskFileError(f"{path}: {split} must be a list of tasks")
                records += [(f"{path}: {split}[{i}]", r, split) for i, r in enumerate(items)]
        else:
            raise TaskFileError(f"{path}: expected a list of tasks or a mapping {{train: [...], eval: [...]}}")
    else:
        raise TaskFileError(f"{path}: task files are .jsonl, .yaml or .yml")
    out = _numbered(records)
    if not out["train"]:
        raise TaskFileError(f"{path}: no train tasks in it")
    return out


def tasks_from(source: TaskSource, split: str, config: Any = None) -> list[Task]:
    """The ``split`` tasks of a file path or a function (module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if isinstance(source, (str, Path)):
        return load_task_file(source)[split]
    if not callable(source):
        raise TypeError(f"tasks must be a file path or a function (split, config) -> tasks, "
                        f"got {type(source).__name__}")
    name = getattr(source, "__name__", repr(source))
    records = [(f"task {i} of {name}({split!r})", r, split) for i, r in enumerate(source(split, config))]
    return _numbered(records)[split]
