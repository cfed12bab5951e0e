"""A real MCP server for the tests (FastMCP, the fixture only): stdio by default, streamable HTTP with ``--http PORT``.

Tools: ``add`` (a sum), ``bump`` (a counter of this server process: fresh per process, kept by a shared session),
``nap`` (sleeps: timeouts), ``fail`` (an ``isError`` result), ``pid`` (the server's process id), ``shape`` (structured
content only, no text), ``whoami`` (the HTTP request's Authorization header, to show a header reached the server),
``env_var`` (a variable of the server's environment and its working directory).
"""

from __future__ import annotations

import asyncio
import os
import sys

from fastmcp import FastMCP
from fastmcp.tools import ToolResult

server = FastMCP("fixture")
COUNTER = {"n": 0}


@server.tool
def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@server.tool
def bump() -> int:
    """Add one to this server's counter and return it."""
    COUNTER["n"] += 1
    return COUNTER["n"]


@server.tool
async def nap(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "awake"


@server.tool
def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"refused: {reason}")


@server.tool
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool
def shape() -> ToolResult:
    """Structured content without text."""
    return ToolResult(content=[], structured_content={"rows": 2, "cols": 3})


@server.tool
def whoami() -> str:
    """The Authorization header of the HTTP request (empty over stdio)."""
    from fastmcp.server.dependencies import get_http_headers

    return get_http_headers(include={"authorization"}).get("authorization", "")


@server.tool
def env_var(var: str) -> str:
    """An environment variable of the server's process, and its working directory."""
    return f"{os.environ.get(var, '')} in {os.path.basename(os.getcwd())}"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--http":
        server.run(transport="http", host="127.0.0.1", port=int(sys.argv[2]), show_banner=False, log_level="warning")
    else:
        server.run(show_banner=False, log_level="warning")
