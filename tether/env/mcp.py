"""MCP tool servers as tools of an environment's episodes (``environment.mcp_servers``).

Each configured server (a stdio ``command`` started as a subprocess, or a streamable-HTTP ``url``) is connected through
the official ``mcp`` SDK at start: its tools are listed (``list_tools``, every page), the ``tools`` subset kept, and
each becomes a ``tether.env.tools.Tool`` with the server's name, description and JSON input schema — what
``tool_schemas()`` shows the model and the chat template renders. A name that is also a tool of the environment (or of
an earlier server) is an error at start naming both. The timeout of a tool is the ``timeout_ms`` of an
``environment.action_space`` entry of its name (with its simulated ``latency_ms`` and, when it lists ``params``, only
those offered), else the server's ``timeout_ms``.

A call is ``call_tool`` on the server's session, run by ``tether.env.tools.run_tool`` like any tool: under its
timeout, arguments checked against the schema first. The text content of the result is the observation (its
structured content as JSON when it has no text); an ``isError`` result, an exception, a timeout and a dead server
are error observations, counted as tool errors by the environment — never an exception out of the episode.

Scopes: ``shared`` — one session per environment, opened here and reused by every episode (a session found broken at
reset, e.g. a killed server, is replaced by a new one); ``episode`` — a session per episode, started at reset without
waiting (``McpEpisode.ready`` waits before the first call, outside the call's timeout) and closed with the episode.
The sessions live on one background event loop (``tether.env.mcp_session``). ``mcp`` is imported only here and only
when ``environment.mcp_servers`` is set; without it the error names the extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
import weakref
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.config.environment import McpServerConfig, ToolSpec
from tether.env.mcp_session import Connection, Opener, started
from tether.env.tools import Latency, Tool, ToolError
from tether.errors import ConfigError

START_TIMEOUT_S = 60.0  # a server must start and answer initialize + tools/list within this


def require_mcp() -> None:
    """Raise a ConfigError naming the extra when the ``mcp`` SDK is not installed."""
    try:
        import mcp  # noqa: F401, PLC0415
    except ImportError:
        raise ConfigError("`environment.mcp_servers` needs the MCP SDK: install the extra, pip install 'tether[mcp]' "
                          "(mcp==2.3.0)") from None


def server_log(name: str) -> Path:
    """Where a stdio server's stderr goes (the terminal stays tether's): the temp folder, per server and process."""
    return Path(tempfile.gettempdir()) / f"tether-mcp-{name}-{os.getpid()}.log"


def opener(server: McpServerConfig) -> Opener:
    """The transport of ``server`` (its secrets read from the environment now: a missing variable is a ConfigError)."""
    if server.command is not None:
        from mcp import StdioServerParameters, stdio_client  # noqa: PLC0415

        program = sys.executable if server.command[0] == "python" else server.command[0]
        env = {k: v.get() for k, v in server.env.items()}
        params = StdioServerParameters(command=program, args=list(server.command[1:]), env=env or None,
                                       cwd=server.cwd)
        errlog = server_log(server.name).open("a")  # noqa: SIM115 — held by the opener for every session it starts
        return lambda: stdio_client(params, errlog=errlog)

    import httpx2  # noqa: PLC0415 — the mcp SDK's HTTP client
    from mcp.client.streamable_http import streamable_http_client  # noqa: PLC0415

    url = server.url
    assert url is not None
    headers = {k: v.get() for k, v in server.headers.items()}

    @contextlib.asynccontextmanager
    async def http() -> AsyncIterator[Any]:
        client = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))  # the SDK's defaults
        async with client, streamable_http_client(url, http_client=client) as streams:
            yield streams

    return http


def result_text(result: Any) -> str:
    """The observation of a ``CallToolResult``: its text content, else its structured content as JSON."""
    texts = [c.text for c in result.content if getattr(c, "type", None) == "text"]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    kinds = [str(getattr(c, "type", "?")) for c in result.content]
    return f"(no text content: {', '.join(kinds)})" if kinds else ""


@dataclass(frozen=True)
class McpTool:
    """One listed tool as offered: the schema it is shown with, its timeout and simulated latency."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    timeout_ms: float
    latency: Latency | None

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema the model sees."""
        fn = {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}
        return {"type": "function", "function": fn}

    def tool(self, server: str, conn: Connection) -> Tool:
        name = self.name

        async def call(**params: Any) -> str:
            try:
                result = await conn.call("call_tool", name, params)
            except Exception as e:  # noqa: BLE001 — a dead or failing server is an observation, not a crash
                message = getattr(e, "message", None) or str(e) or type(e).__name__
                raise ToolError(f"MCP server {server} could not run {name}: {message}") from e
            text = result_text(result)
            if result.is_error:
                raise ToolError(text or f"{name} returned an error")
            return text

        return Tool(name, self.description, (), call, self.timeout_ms, self.latency, parameters=self.parameters)


def offered(listed: Any, spec: ToolSpec | None, server: McpServerConfig, key: str) -> McpTool:
    """``listed`` (an ``mcp`` Tool) under the ``action_space`` entry ``spec`` of its name, if any."""
    schema = dict(listed.input_schema or {"type": "object", "properties": {}})
    timeout, latency = server.timeout_ms, None
    if spec is not None:
        timeout, latency = spec.timeout_ms, Latency.from_spec(spec.latency_ms)
        props = dict(schema.get("properties", {}))
        required = list(schema.get("required", []))
        if spec.params:
            unknown = [p for p in spec.params if p not in props]
            missing = [p for p in required if p not in spec.params]
            if unknown or missing:
                why = "; ".join(x for x in (unknown and f"not parameters of it: {', '.join(unknown)}",
                                            missing and f"required and not listed: {', '.join(missing)}") if x)
                raise ConfigError(f"`{key}`: the action_space entry of MCP tool {listed.name} lists params "
                                  f"{list(spec.params)}; the server's schema has {list(props)} ({why})")
            schema = {**schema, "properties": {p: props[p] for p in spec.params},
                      "required": [p for p in spec.params if p in required]}
    return McpTool(listed.name, listed.description or "", schema, float(timeout), latency)


@dataclass
class _Server:
    config: McpServerConfig
    key: str
    open: Opener
    tools: list[McpTool] = field(default_factory=list)
    shared: Connection | None = None


@dataclass
class McpEpisode:
    """The MCP side of one episode: its tools, the sessions started for it (``scope: episode``: closed with it) and
    those it waits for before its first call (those, and a shared session restarted at its reset)."""

    tools: list[Tool]
    own: list[Connection]
    waits: list[Connection]

    async def ready(self) -> None:
        """Wait, without blocking the loop, until the sessions have started; a server that failed to start is left to
        its calls, which answer with an error observation."""
        waits, self.waits = self.waits, []
        for conn in waits:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(started(conn), START_TIMEOUT_S)

    def close(self) -> None:
        """Stop this episode's own sessions without waiting (the environment's ``close`` waits for every one)."""
        for conn in self.own:
            conn.close(wait=False)


class McpTools:
    """The MCP servers of one environment: started and listed at construction, closed by ``close()``."""

    def __init__(self, servers: Sequence[McpServerConfig], env_tools: Collection[str],
                 action_space: Sequence[ToolSpec]):
        require_mcp()
        self._servers: list[_Server] = []
        self._connections: weakref.WeakSet[Connection] = weakref.WeakSet()
        specs = {s.name: s for s in action_space}
        owners = {n: "the environment's tool" for n in env_tools}
        try:
            for i, config in enumerate(servers):
                key = f"environment.mcp_servers[{i}]"
                server = _Server(config, key, opener(config))
                self._servers.append(server)
                conn = self._connect(server)
                listed = self._list(server, conn)
                for t in listed:
                    if t.name in owners:
                        raise ConfigError(f"`{key}`: MCP tool {t.name!r} of server {config.name} has the name of "
                                          f"{owners[t.name]} {t.name!r}; rename one, or leave it out with "
                                          f"`{key}.tools`")
                    owners[t.name] = f"MCP server {config.name}'s tool"
                    server.tools.append(offered(t, specs.get(t.name), config, server.key))
                if config.scope == "shared":
                    server.shared = conn
                else:
                    conn.close(wait=False)
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return [t.name for s in self._servers for t in s.tools]

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for s in self._servers for t in s.tools]

    def _connect(self, server: _Server) -> Connection:
        conn = Connection(server.config.name, server.open).start()
        self._connections.add(conn)
        return conn

    def _list(self, server: _Server, conn: Connection) -> list[Any]:
        """The server's tools (every page), the ``tools`` subset when one is configured."""
        name = server.config.name
        try:
            conn.wait_ready(START_TIMEOUT_S)
            from mcp_types import PaginatedRequestParams  # noqa: PLC0415

            page = conn.call_sync("list_tools", timeout_s=START_TIMEOUT_S)
            tools = list(page.tools)
            while page.next_cursor:
                page = conn.call_sync("list_tools", params=PaginatedRequestParams(cursor=page.next_cursor),
                                      timeout_s=START_TIMEOUT_S)
                tools += page.tools
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 — any failure to start is a bad server config, said with its cause
            where = f" (its stderr: {server_log(name)})" if server.config.command is not None else ""
            leaf: BaseException = e
            while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:  # anyio's task groups wrap the cause
                leaf = leaf.exceptions[0]
            cause = getattr(leaf, "message", None) or str(leaf) or type(leaf).__name__
            raise ConfigError(f"`{server.key}`: MCP server {name} did not start or list its tools{where}: "
                              f"{type(leaf).__name__}: {cause}") from None
        if server.config.tools is None:
            return tools
        by_name = {t.name: t for t in tools}
        unknown = [n for n in server.config.tools if n not in by_name]
        if unknown:
            raise ConfigError(f"`{server.key}.tools` names {unknown}, which MCP server {name} does not list; "
                              f"its tools: {list(by_name)}")
        return [by_name[n] for n in server.config.tools]

    def episode(self) -> McpEpisode:
        """The tools of a new episode: shared sessions (a broken one replaced), a new session per ``episode`` server."""
        tools: list[Tool] = []
        own: list[Connection] = []
        waits: list[Connection] = []
        for server in self._servers:
            if server.config.scope == "shared":
                if server.shared is None or server.shared.broken:
                    server.shared = self._connect(server)
                    waits.append(server.shared)
                conn = server.shared
            else:
                conn = self._connect(server)
                own.append(conn)
                waits.append(conn)
            tools += [t.tool(server.config.name, conn) for t in server.tools]
        return McpEpisode(tools, own, waits)

    def close(self) -> None:
        """Close every session of these servers (shared and episodes' alike) and wait for their servers to stop."""
        for server in self._servers:
            server.shared = None
        for conn in list(self._connections):
            conn.close(wait=True)
