"""What a resumed run checks of its run directory before anything is written: the checkpoint to resume from (a
corrupt latest one refused, naming the one before it), the recorded config (changes refused unless
``--allow-config-change`` names them) and the metrics / samples logs against the checkpoint (an interruption's torn
tail dropped, damage before the checkpoint refused). ``Run.build`` calls these under the run directory's lock
(``run_lock``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from tether.learner.checkpoint import resumable_checkpoint
from tether.metrics import read_jsonl_rows
from tether.pipeline.run_lock import LOCK_FILE, RunDirError


def resume_jsonl(path: Path, first: int, last: int, allowed: tuple[str, ...]) -> tuple[list[str], str | None]:
    """Check a step log against the checkpoint of step ``last``; returns the warnings and the text to write instead
    (without what the interrupted run wrote after the checkpoint; None: keep the file as it is). ``first``: the
    log's first step (metrics.jsonl: one row per step from 0, the held-out evaluations merged into their step's
    row; samples.jsonl: one per step from 1).

    An interruption leaves rows after the checkpoint (dropped: the resumed run writes them again) and at most a
    torn last line after the checkpoint's rows (a write cut short by a kill or a full disk: dropped, with a
    warning), never less: each step's row is written before its checkpoint. Anything else — rows of steps
    ``first``..``last`` missing or repeated, an unreadable line before the end — is damage done to the file after
    it was written, and is refused (``RunDirError``) unless ``allowed`` (``--allow-config-change``) names the
    file: then the resume keeps what is there (a gap stays a gap; unreadable lines go) and says so."""
    rows, bad = read_jsonl_rows(path) if path.exists() else ([], [])
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
    last_line = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    torn = [line for n, line in bad if n == last_line]
    broken = [(n, line) for n, line in bad if n != last_line]
    count = Counter(row["step"] for row in rows if first <= row["step"] <= last)
    missing = [s for s in range(first, last + 1) if not count[s]]
    repeated = sorted(s for s, c in count.items() if c > 1)
    damage = []
    if missing:
        damage.append(f"lacks the rows of {_spans(missing)}")
    if repeated:
        damage.append(f"holds the rows of {_spans(repeated)} more than once")
    if broken:
        damage.append(f"has {len(broken)} unreadable line(s) before its end (line {broken[0][0]}: "
                      f"{broken[0][1][:60]!r})")
    notes = []
    if damage:
        what = "; ".join(damage) + f", before checkpoint step_{last}" + (" (and ends in a torn line)" if torn else "")
        if path.name not in allowed:
            raise RunDirError(f"{path} {what}: damage done to the file after it was written (cut, edited or copied "
                              "in part), not by an interruption, which only loses rows after the checkpoint; restore "
                              f"the file, or resume anyway with --allow-config-change {path.name} (what is missing "
                              "stays missing)")
        notes.append(f"{path} {what}: resumed as --allow-config-change {path.name} allows; what is missing stays "
                     "missing")
    elif torn:
        notes.append(f"{path}: dropped a torn last line ({len(torn[0])} characters) after the checkpoint's rows, "
                     "left by the interruption")
    kept = [row for row in rows if row["step"] <= last]
    if len(kept) < len(rows) or bad:
        return notes, "".join(json.dumps(row, allow_nan=True) + "\n" for row in kept)
    return notes, None


def _spans(steps: list[int]) -> str:
    """[3, 4, 7, 9, 10, 11] → "steps 3–4, 7, 9–11"; [5] → "step 5"."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    words = ", ".join(f"{a}–{b}" if b > a else f"{a}" for a, b in spans)
    return f"step {words}" if len(steps) == 1 else f"steps {words}"


# Keys a resumed run may change freely: how long it runs, how often it evaluates and saves, where metrics go, how many
# trainer ranks train (N ranks train what one trains; a checkpoint holds whole weights and optimizer state).
RESUMABLE_CHANGES = ("trainer.total_steps", "trainer.eval_every", "trainer.save_every", "trainer.eval_tasks",
                     "metrics.", "monitors.", "resource_pool.trainer_pool.num_ranks")


def _leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def config_changes(recorded: dict, new: dict, allowed: tuple[str, ...] = ()) -> list[str]:
    """The keys whose value differs between a run's recorded config and ``new``, except those in
    ``RESUMABLE_CHANGES`` or ``allowed`` (a key, or a prefix ending in "."), as "key: old → new"."""
    old, now = _leaves(recorded), _leaves(new)
    ok = RESUMABLE_CHANGES + tuple(allowed)
    return [f"{k}: {old.get(k)!r} → {now.get(k)!r}" for k in sorted(set(old) | set(now))
            if old.get(k) != now.get(k) and not any(k == a or (a.endswith(".") and k.startswith(a)) for a in ok)]


def check_run_dir(config: dict, run_dir: Path, resume: bool, allow_config_change: tuple[str, ...]) -> Path | None:
    """Validate the run directory before anything is written (under its lock: ``run_lock``, whose file is not
    counted as content); returns the checkpoint to resume from. ``config``: the run's config as it would be
    recorded (``RunConfig.redacted_dict``), compared with the recorded one. A corrupt latest checkpoint is refused
    naming the complete one before it (``CorruptCheckpoint``, a ValueError)."""
    if not resume:
        if run_dir.is_dir() and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
            raise RunDirError(f"--run-dir {run_dir} already holds a run; pass --resume to continue it, or choose a "
                              "new --run-dir (nothing was written)")
        return None
    ckpt = resumable_checkpoint(run_dir)
    recorded = run_dir / "config.yaml"
    if ckpt is None and not recorded.is_file():
        raise FileNotFoundError(f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}")
    if recorded.is_file():
        changes = config_changes(yaml.safe_load(recorded.read_text()) or {}, config, allow_config_change)
        if changes:
            raise RunDirError(f"--resume with a config that changes the run ({'; '.join(changes)}); resume with the "
                              "recorded config, or list each key with --allow-config-change KEY")
    return ckpt if ckpt is not None else NO_CHECKPOINT_YET


NO_CHECKPOINT_YET = Path("step_0")  # a run stopped before its first checkpoint: resumed from the start
