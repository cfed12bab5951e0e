"""A calculator environment of one's own: the user asks an arithmetic question; the agent may compute with the
``calculate`` tool and answers the user. Selected by ``environment.name: calc_env:environment``."""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

from tether.env.plugin import ToolEnvironment

HERE = Path(__file__).resolve().parent
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


def calculate(state: dict, expression: str) -> float:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / and parentheses, e.g. (3 + 4) * 5.
    """
    value = round(_eval(ast.parse(expression, mode="eval").body), 6)
    state["results"].append(value)
    return value


def respond_to_user(state: dict, message: str) -> str:
    """Send a message to the user; returns their reply.

    Args:
        message: The answer, with its number.
    """
    numbers = _NUMBER.findall(message.replace(",", ""))
    if not numbers:
        return "Please tell me the number."
    state["answer"] = float(numbers[-1])
    return "Thanks."


def correct(state: dict, transcript, task) -> float:
    """Rule check: the number the user was told is the task's answer."""
    return float(state["answer"] is not None and abs(state["answer"] - task.data["answer"]) < 1e-6)


def computed(state: dict, transcript, task) -> float:
    """Rule check: the answer was computed with the tool, not guessed."""
    return float(any(abs(r - task.data["answer"]) < 1e-6 for r in state["results"]))


def brief(transcript, task) -> float:
    """Rubric: one calculation and one answer is enough."""
    return min(1.0, 2 / max(len(transcript.turns), 1))


def expert(task):
    """A policy that solves a task (``tether verify env`` plays it): calculate, then tell the user the result."""
    calls = iter([{"name": "calculate", "params": {"expression": task.data["prompt"][8:-1]}}])  # "What is ...?"
    return lambda obs: next(calls, {"name": "respond_to_user", "params": {"message": f"{obs['last_tool_result']}"}})


environment = ToolEnvironment(
    tools=[calculate, respond_to_user],
    tasks=HERE / "tasks.jsonl",
    system_prompt="Answer the user's arithmetic question: call calculate, then tell the user the number.",
    new_state=lambda task: {"results": [], "answer": None},
    rules={"correct": correct, "computed": computed},
    rubrics={"brief": brief},
    gate=lambda transcript, task: transcript.termination == "user_issue_resolved",
    gated=("brief",),
    resolved=lambda state: state["answer"] is not None,
    observations={"last_result": lambda state, task: state["results"][-1] if state["results"] else None},
    expert=expert,
)
