"""``examples/custom_env``'s calculator with its ``calculate`` tool served by an MCP server (``calc_server.py``): the
environment keeps ``respond_to_user`` and the state; ``environment.mcp_servers`` adds the server's tools to every
episode, and ``on_result`` records what ``calculate`` answered. Selected by
``environment.name: mcp_env:environment``."""

from __future__ import annotations

import re
from pathlib import Path

from tether.env.plugin import ToolEnvironment
from tether.env.tools import ToolResult

HERE = Path(__file__).resolve().parent
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


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


def record(state: dict, result: ToolResult) -> None:
    """After a successful call: the MCP server's answer (its text) to ``calculate`` joins the state."""
    if result.name == "calculate":
        state["results"].append(float(result.text))


def correct(state: dict, transcript, task) -> float:
    """Rule check: the number the user was told is the task's answer."""
    return float(state["answer"] is not None and abs(state["answer"] - task.data["answer"]) < 1e-6)


def computed(state: dict, transcript, task) -> float:
    """Rule check: the answer was computed with the MCP tool, not guessed."""
    return float(any(abs(r - task.data["answer"]) < 1e-6 for r in state["results"]))


def expert(task):
    """A policy that solves a task (``tether verify env`` plays it): calculate, then tell the user the result."""
    calls = iter([{"name": "calculate", "params": {"expression": task.data["prompt"][8:-1]}}])  # "What is ...?"
    return lambda obs: next(calls, {"name": "respond_to_user", "params": {"message": f"{obs['last_tool_result']}"}})


environment = ToolEnvironment(
    tools=[respond_to_user],
    tasks=HERE / "tasks.jsonl",
    system_prompt="Answer the user's arithmetic question: call calculate, then tell the user the number.",
    new_state=lambda task: {"results": [], "answer": None},
    rules={"correct": correct, "computed": computed},
    on_result=record,
    resolved=lambda state: state["answer"] is not None,
    expert=expert,
)
