"""A rubric as a judge prompt, and the judge's answer as a score: the strict format and its parser.

The judge is asked to end its answer with one line ``SCORE: <a number from 0 to 1>`` (``FORMAT``, appended to
every rubric prompt, so a prompt from the config says only what to grade). ``parse_score`` accepts exactly
that: reasoning before it is fine (a ``<think>…</think>`` block is ignored), but no ``SCORE:`` line, two of
them, a number outside [0, 1], a fraction ("7/10") or a word ("high") is ``UnparseableJudgeAnswer``, naming the
rubric and showing the answer — never a guessed or default score.
"""

from __future__ import annotations

import hashlib
import json
import re

from tether.env.verifier import JudgeView

FORMAT = ("\n\nGive your reasons in a few words if you like, then end your answer with exactly one line of the "
          "form\nSCORE: <a number from 0 to 1>\nfor example `SCORE: 0.5`.")
JUDGE_SYSTEM = "You are a strict, fair grader of customer-service conversations. You answer in the requested format."

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_SCORE_LINE = re.compile(r"^[ \t*_`]*score[ \t*_`]*:[ \t*_`]*(?P<value>\S.*?)[ \t*_`]*$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"(?:0|1)(?:\.\d+)?|\.\d+")
_SHOWN = 300  # characters of a bad answer shown in the error


class UnparseableJudgeAnswer(ValueError):
    """The judge's answer is not in the strict format (module docstring)."""


def render(template: str, view: JudgeView) -> str:
    """The rubric's prompt with the episode filled in, and the answer format appended."""
    return template.format_map(view.fields()) + FORMAT


def parse_score(answer: str, rubric: str = "rubric") -> float:
    """The score in [0, 1] of a judge answer in the strict format; ``UnparseableJudgeAnswer`` otherwise."""
    text = _THINK.sub("", answer or "")
    lines = list(_SCORE_LINE.finditer(text))
    shown = (answer or "")[:_SHOWN] + ("..." if len(answer or "") > _SHOWN else "")
    if len(lines) != 1:
        what = "no line" if not lines else f"{len(lines)} lines"
        raise UnparseableJudgeAnswer(f"judge answer for rubric {rubric!r} has {what} `SCORE: <number from 0 to 1>` "
                                     f"(exactly one is required): {shown!r}")
    value = lines[0].group("value")
    if not _NUMBER.fullmatch(value):
        raise UnparseableJudgeAnswer(f"judge answer for rubric {rubric!r}: `SCORE: {value}` is not a number from 0 "
                                     f"to 1 (write e.g. 0.75): {shown!r}")
    score = float(value)
    if not 0.0 <= score <= 1.0:
        raise UnparseableJudgeAnswer(f"judge answer for rubric {rubric!r}: SCORE {score} is outside [0, 1]: {shown!r}")
    return score


def cache_key(prompt: str, judge: str) -> str:
    """The key of a judge result: the rendered prompt (rubric template + trajectory content) and the judge's
    identity (endpoint, model, samples, sampling), hashed."""
    return hashlib.sha256(json.dumps([judge, prompt]).encode()).hexdigest()
