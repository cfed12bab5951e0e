"""The calculator as an MCP tool server (FastMCP over stdio): ``examples/custom_env``'s ``calculate``, moved out of
the environment's process. tether starts it (``environment.mcp_servers`` in config.yaml), lists its tools and calls
them through the official ``mcp`` SDK; any MCP server — in any language — plugs in the same way."""

from __future__ import annotations

import ast
import operator

from fastmcp import FastMCP

server = FastMCP("calc")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / and parentheses are allowed")


@server.tool
def calculate(expression: str) -> float:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / and parentheses, e.g. (3 + 4) * 5.
    """
    return round(_eval(ast.parse(expression, mode="eval").body), 6)


if __name__ == "__main__":
    server.run(show_banner=False, log_level="warning")
