"""Diversity bonus: reward a group for finding *distinct* successful strategies, not one strategy many times.

Strategy signature of a trajectory (``strategy_signature(traj.messages)``), from the assistant messages that
``agent/loop.py`` records, in order:
  * each tool call other than ``respond_to_user`` → ``name(canonical JSON of its arguments)``;
  * each message to the user (a ``respond_to_user`` call, or assistant text without tool calls, which the loop
    delivers to the user) → the marker ``respond_to_user``, so asking the user first is a different path;
  * last, ``answer:`` + the *facts* of the final message to the user.
Canonical JSON: keys sorted, numbers formatted one way (3, 3.0 and "3.00" → 3; 12.5 and "12.50" → 12.5), strings
lower-cased and whitespace-collapsed; a prose string (one with whitespace, e.g. an escalation summary) and the
final answer are reduced to their facts: the sorted set of tokens that contain a digit (amounts, counts, ids such
as o-1042), numbers normalised. Wording is left out on purpose: with it every paraphrase would count as a new
strategy, and the bonus would pay the policy to vary its phrasing rather than its approach.

Clustering: exact equality of signatures. Deterministic, needs no embedding model on the CPU, and auditable (the
signature is the cluster's name). It under-merges (two call orders of independent lookups are two clusters) —
the price of not guessing equivalences. ``semantic_cluster_count`` (the seed's metric name) is the number of
distinct signatures in a group, averaged over groups.

Bonus (per group): a successful trajectory gets coef / k, k = the number of successful trajectories of the group
sharing its signature; a failure gets 0. The group's bonuses sum to coef × (number of distinct successful
strategies): a second success along the same path adds nothing, a new successful path adds coef. Cf. DARLING
(arXiv 2509.02534), which multiplies quality by a learned-partition diversity score; this is a rule-based,
additive variant for tool-using agents.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Hashable, Sequence
from typing import Any

from tether.types import USER_TOOL

_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
_NUMERIC_STRING = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_EDGE_PUNCT = "$€£.,;:!?\"'()[]{}<>"

Signature = tuple[str, ...]


def _number(x: float) -> int | float:
    """One format per value: integral floats become ints, others stay floats (shortest repr)."""
    return int(x) if math.isfinite(x) and x == int(x) and abs(x) < 1e15 else float(x)


def _number_text(match: re.Match[str]) -> str:
    return str(_number(float(match.group(0).replace(",", ""))))


def answer_facts(text: str) -> str:
    """The facts of a message: sorted unique lower-cased tokens containing a digit, numbers normalised."""
    tokens = (t.strip(_EDGE_PUNCT) for t in _NUMBER.sub(_number_text, text.lower()).split())
    return " ".join(sorted({t for t in tokens if any(c.isdigit() for c in t)}))


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return _number(float(value))
    text = _NUMBER.sub(_number_text, " ".join(str(value).split()).lower())  # "1,000.0" → "1000", "sku-007" → "sku-7"
    if _NUMERIC_STRING.fullmatch(text):
        return _number(float(text))
    return answer_facts(text) if " " in text else text


def canonical_arguments(arguments: Any) -> str:
    """Canonical JSON of a tool call's arguments (a dict, or the JSON string of one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # keep the raw string, canonicalised as text
    return json.dumps(_canonical(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def strategy_signature(messages: Sequence[dict[str, Any]]) -> Signature:
    """The strategy signature of a conversation (``Trajectory.messages``; rules in the module docstring)."""
    steps: list[str] = []
    final = ""
    for m in messages:
        if m.get("role") != "assistant":
            continue
        calls = m.get("tool_calls") or []
        if not calls and (m.get("content") or "").strip():
            steps.append(USER_TOOL)  # text without a call is said to the user
            final = m["content"]
        for call in calls:
            fn = call.get("function", call)
            name, args = fn.get("name", ""), fn.get("arguments", {})
            if name == USER_TOOL:
                steps.append(USER_TOOL)
                final = args.get("message", "") if isinstance(args, dict) else str(args)
            else:
                steps.append(f"{name}({canonical_arguments(args)})")
    return (*steps, f"answer:{answer_facts(final)}")


def cluster_ids(signatures: Sequence[Hashable]) -> list[int]:
    """Dense cluster index per item, by exact equality, numbered in order of first appearance."""
    index: dict[Hashable, int] = {}
    return [index.setdefault(s, len(index)) for s in signatures]


def diversity_bonus(
    group_signatures: Sequence[Sequence[Hashable]],
    group_successes: Sequence[Sequence[bool]],
    *,
    coef: float,
) -> tuple[list[list[float]], dict[str, float]]:
    """Per-trajectory bonus coef / (successes sharing the signature) for successes, 0 for failures, per group.

    Args:
        group_signatures: per group, one signature per trajectory (``strategy_signature``).
        group_successes: per group, one success flag per trajectory (``Trajectory.success``).
        coef: bonus coefficient ≥ 0 (the seed's ``diversity_bonus.coef``, 0.05).

    Returns:
        bonuses: per group, one float per trajectory, to add to its reward before advantages.
        metrics: ``semantic_cluster_count`` (distinct signatures per group, mean over groups),
            ``successful_cluster_count`` (distinct signatures among successes, mean over groups),
            ``diversity_bonus_mean`` (mean bonus over all trajectories).
    """
    if not coef >= 0.0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    if len(group_signatures) != len(group_successes) or any(
        len(s) != len(f) for s, f in zip(group_signatures, group_successes)
    ):
        raise ValueError("group_signatures and group_successes must have the same groups and group sizes")
    bonuses: list[list[float]] = []
    clusters, successful = [], []
    for sigs, wins in zip(group_signatures, group_successes):
        ids = cluster_ids(sigs)
        shared: dict[int, int] = {}
        for c, ok in zip(ids, wins):
            shared[c] = shared.get(c, 0) + bool(ok)
        bonuses.append([coef / shared[c] if ok else 0.0 for c, ok in zip(ids, wins)])
        clusters.append(len(set(ids)))
        successful.append(sum(1 for k in shared.values() if k > 0))
    n_groups, flat = len(bonuses), [b for g in bonuses for b in g]
    metrics = {
        "semantic_cluster_count": sum(clusters) / n_groups if n_groups else 0.0,
        "successful_cluster_count": sum(successful) / n_groups if n_groups else 0.0,
        "diversity_bonus_mean": math.fsum(flat) / len(flat) if flat else 0.0,
    }
    return bonuses, metrics
