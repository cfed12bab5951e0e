"""MCP client sessions on one background event loop: the thread that owns every MCP session of the process.

The ``mcp`` SDK's transports and ``ClientSession`` are anyio context managers that must be entered and exited in the
same task, and live as long as the server does — across episodes, across the ``asyncio.run`` of each evaluation and
across the rollouter's worker threads. So no caller's loop owns them: ``McpLoop`` is one daemon thread with its own
event loop; a ``Connection`` is one task on it that enters the transport and the session, signals that it is ready,
waits to be told to close and exits both in that same task. Callers on any loop or thread reach it with
``asyncio.run_coroutine_threadsafe`` (``Connection.call`` from async code, ``open`` / ``close`` from sync code); a
caller's cancellation (a tool timeout) cancels the call on the MCP loop too.

``close_all()`` closes every connection still open and stops the loop; it is registered with ``atexit``, so that no
stdio server outlives the process (the SDK's stdio transport closes the server's stdin, then terminates its process
tree). ``mcp`` is imported here only when a connection is opened (``tether.env.mcp`` builds them).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any

CLOSE_TIMEOUT_S = 10.0  # a stdio server gets 2 s after its stdin closes, then SIGTERM, 2 s, SIGKILL (the SDK's policy)


class McpLoop:
    """The process's MCP event loop, in a daemon thread started on first use (``McpLoop.get()``)."""

    _instance: McpLoop | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.connections: set[Connection] = set()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tether-mcp", daemon=True)
        self._thread.start()

    @classmethod
    def get(cls) -> McpLoop:
        with cls._lock:
            if cls._instance is None or not cls._instance.loop.is_running():
                cls._instance = McpLoop()
                atexit.register(close_all)
            return cls._instance

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        """Close every open connection (waiting for their servers to exit), then stop the loop and its thread."""
        pending = [self.submit(c.aclose()) for c in list(self.connections)]
        concurrent.futures.wait(pending, timeout=CLOSE_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=CLOSE_TIMEOUT_S)


def close_all() -> None:
    """Close every MCP connection of the process and stop its loop (at exit, and for tests)."""
    with McpLoop._lock:
        hub, McpLoop._instance = McpLoop._instance, None
    if hub is not None and hub.loop.is_running():
        hub.stop()


async def started(conn: Connection) -> None:
    """Wait on any loop until ``conn`` has started (raising why it could not); a cancelled waiter leaves it be."""
    await asyncio.shield(asyncio.wrap_future(conn.ready))


Opener = Callable[[], contextlib.AbstractAsyncContextManager[Any]]
"""Makes the transport's context manager (``stdio_client(...)``, ``streamable_http_client(...)``): it yields the
``(read_stream, write_stream)`` pair a ``ClientSession`` runs over."""


class Connection:
    """One MCP client session, owned by one task on the ``McpLoop``. ``start()`` begins it without waiting (calls
    wait for it to be ready); ``broken`` once the server's connection is gone (a killed server, a closed session)."""

    def __init__(self, name: str, opener: Opener, hub: McpLoop | None = None):
        self.name, self._opener = name, opener
        self.hub = hub or McpLoop.get()
        self.broken = False
        self._session: Any = None
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()  # set once initialised (or failed)
        self._task: asyncio.Task[None] | None = None
        self._closing: asyncio.Event | None = None

    # -- life -----------------------------------------------------------------------------------------------------
    def start(self) -> Connection:
        """Start the session on the MCP loop and return at once."""
        self.hub.connections.add(self)
        self.hub.loop.call_soon_threadsafe(self._spawn)
        return self

    def _spawn(self) -> None:
        self._closing = asyncio.Event()
        self._task = self.hub.loop.create_task(self._own())

    async def _own(self) -> None:
        from mcp import ClientSession  # noqa: PLC0415 — the mcp extra, imported only when a server is configured

        assert self._closing is not None
        try:
            async with self._opener() as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                self._session = session
                if not self.ready.done():
                    self.ready.set_result(None)
                await self._closing.wait()
        except BaseException as e:  # noqa: BLE001 — told to whoever waits for the session; never lost
            if not self.ready.done():
                self.ready.set_exception(e if isinstance(e, Exception) else ConnectionError(f"{type(e).__name__}"))
            if not isinstance(e, Exception):
                raise
        finally:
            self._session, self.broken = None, True
            self.hub.connections.discard(self)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the session is initialised; raise what stopped it (a server that would not start)."""
        self.ready.result(timeout=timeout_s)

    async def aclose(self) -> None:
        """On the MCP loop: tell the owner task to exit its session and transport, and wait for it."""
        if self._closing is None:  # start() was called but _spawn has not run yet: it runs before this coroutine
            await asyncio.sleep(0)
        if self._closing is not None:
            self._closing.set()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_TIMEOUT_S)

    def close(self, wait: bool = True) -> None:
        """Close the session (a stdio server is stopped); ``wait=False`` returns at once and lets it finish."""
        if not self.hub.loop.is_running():
            return
        future = self.hub.submit(self.aclose())
        if wait:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                future.result(timeout=CLOSE_TIMEOUT_S + 1)

    # -- calls ------------------------------------------------------------------------------------------------------
    async def _on_loop(self, method: str, *args: Any, **kwargs: Any) -> Any:
        await started(self)
        session = self._session
        if session is None:
            raise ConnectionError(f"MCP server {self.name} is closed")
        try:
            return await getattr(session, method)(*args, **kwargs)
        except Exception as e:
            from mcp_types import CONNECTION_CLOSED  # noqa: PLC0415

            if getattr(e, "code", None) == CONNECTION_CLOSED:  # the server is gone (killed, exited)
                self.broken = True
            raise

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``session.<method>(*args, **kwargs)`` on the MCP loop, awaited from any loop (cancelling it cancels it)."""
        return await asyncio.wrap_future(self.hub.submit(self._on_loop(method, *args, **kwargs)))

    def call_sync(self, method: str, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """The same from synchronous code (listing the tools at start)."""
        return self.hub.submit(self._on_loop(method, *args, **kwargs)).result(timeout=timeout_s)
