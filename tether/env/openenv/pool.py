"""The servers of one OpenEnv environment and the one event loop every episode's client runs on.

``ServerPool`` holds either the running server a URL names or ``servers`` processes tether started
(``server.ServerProcess``), and deals episodes out among them in turn. openenv-core's ``EnvClient`` is asyncio
(a ``websockets`` connection belongs to the loop that opened it), while tether's episodes run on whatever loop the
rollouter uses (one ``asyncio.run`` per sync step, the async rollouter's thread, evaluation's) and call ``reset`` /
``finalize`` / ``close`` synchronously: so the clients live on one loop of the pool's own, in a daemon thread;
``call`` awaits them from any loop and ``call_sync`` waits for them (a synchronous reset blocks its caller for one
round trip, bounded by ``request_timeout_s``).

**Faults.** Every failed request is classified once, counted as ``env/openenv_errors/<cause>`` and raised as
``OpenEnvError`` (the episode fails and the rollouter leaves it out, as it does any environment failure):
``timeout`` (no answer within ``request_timeout_s``), ``server_error`` (the server answered with an error message:
an exception in its environment, its session capacity reached), ``server_died`` (the process tether started has
exited; for a URL: the connection was refused or lost), ``connection`` (a lost connection to a process that still
runs), ``restart_failed``. With ``on_server_death: stop`` a death raises ``StopRun`` instead, naming the server and
its exit status, and the run ends; with ``fail_episode`` a server found dead when an episode starts is started again
(``env/openenv_server_restarts``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import subprocess
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tether.config.openenv import OpenEnvConfig
from tether.env.openenv.server import ServerProcess, ServerStartError
from tether.env.openenv.target import app_spec, is_url
from tether.errors import StopRun
from tether.metrics import record_metric

T = TypeVar("T")


class OpenEnvError(RuntimeError):
    """A request to an OpenEnv server failed; ``cause`` is the metric's last part."""

    def __init__(self, cause: str, message: str):
        super().__init__(f"{cause}: {message}")
        self.cause = cause


class Endpoint:
    """Where one episode talks: a URL, and the process behind it when tether started it (that process, not its
    slot's current one: a replacement started meanwhile must not hide this one's death)."""

    def __init__(self, url: str, server: ServerProcess | None):
        self.url, self.server = url, server
        self.proc = server.proc if server is not None else None
        self.description = server.describe() if server is not None else f"the OpenEnv server at {url}"

    def exit_status(self, wait_s: float) -> int | None:
        """The process's exit code (negative: the signal that killed it), None while it runs or for a URL; waits up
        to ``wait_s`` (a lost connection is seen a moment before the dead process is reaped)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def describe(self) -> str:
        return self.description


class ServerPool:
    def __init__(self, target: str, cfg: OpenEnvConfig):
        self.cfg, self.target = cfg, target
        self.url = target if is_url(target) else None
        if self.url is not None and cfg.servers != 1:
            raise ValueError(f"environment.openenv.servers = {cfg.servers}: tether starts servers for an app, not for "
                             f"a URL ({target}); remove the key or set it to 1")
        spec = None if self.url is not None else app_spec(target)
        self.servers = [] if spec is None else [ServerProcess(spec, i) for i in range(cfg.servers)]
        self._lock = threading.Lock()
        self._next = 0
        self._closed = False
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tether-openenv", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)
        try:
            for s in self.servers:  # launched together, then waited for: N servers start in the time of one
                s.launch()
            for s in self.servers:
                s.wait_ready(cfg.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # -- dealing episodes out --------------------------------------------------------------------------
    def endpoint(self) -> Endpoint:
        """The next server in turn; one tether started that has died since is started again (``fail_episode``) or
        stops the run (``stop``)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the OpenEnv servers were shut down")
            if self.url is not None:
                return Endpoint(self.url, None)
            server = self.servers[self._next % len(self.servers)]
            self._next += 1
            if not server.alive():
                self._replace(server)
            return Endpoint(server.url, server)

    def _replace(self, server: ServerProcess) -> None:
        status = server.exit_status()
        if self.cfg.on_server_death == "stop":
            raise StopRun(f"{server.describe()} died (exit status {status}); environment.openenv.on_server_death: "
                          "stop")
        try:
            server.start(self.cfg.start_timeout_s)
        except ServerStartError as e:
            record_metric("env/openenv_errors/restart_failed", 1, "sum")
            raise OpenEnvError("restart_failed", str(e)) from e
        record_metric("env/openenv_server_restarts", 1, "sum")

    # -- running the clients' coroutines ----------------------------------------------------------------
    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def call(self, where: Endpoint, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` run on the pool's loop, awaited from the caller's; a failure is classified and counted."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self._submit(coro)), self._bound())
        except Exception as e:  # noqa: BLE001 — classified, counted and raised as OpenEnvError / StopRun
            status = await asyncio.to_thread(self._exit_status, where)
            raise self._fault(where, e, status) from e

    def call_sync(self, where: Endpoint, coro: Coroutine[Any, Any, T]) -> T:
        """``call`` for a synchronous caller (``reset``, ``finalize``)."""
        future = self._submit(coro)
        try:
            return future.result(timeout=self._bound())
        except Exception as e:  # noqa: BLE001 — as in ``call``
            future.cancel()
            raise self._fault(where, e, self._exit_status(where)) from e

    def detach(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` (a client's close) without waiting for it; ``shutdown`` waits for what is left."""
        if self._closed:
            coro.close()
            return
        future = self._submit(coro)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def _bound(self) -> float:
        # the client's own timeouts apply per message; a request is a connect and a reply, or a few replies at most
        return 4 * self.cfg.request_timeout_s

    @staticmethod
    def _exit_status(where: Endpoint) -> int | None:
        return where.exit_status(wait_s=0.5)

    def _fault(self, where: Endpoint, error: Exception, status: int | None) -> Exception:
        text = f"{type(error).__name__}: {error}"
        if isinstance(error, TimeoutError | concurrent.futures.TimeoutError):
            cause = "timeout"
            text = f"no answer within {self.cfg.request_timeout_s:g} s (environment.openenv.request_timeout_s)"
        elif where.server is not None and status is not None:
            cause = "server_died"
            text = f"{where.describe()} died (exit status {status}) during the request ({text})"
        elif isinstance(error, RuntimeError) and str(error).startswith("Server error"):
            cause = "server_error"
        elif where.server is None and _is_connection_error(error):
            cause = "server_died"
            text = f"{where.describe()} refused or lost the connection ({text})"
        elif _is_connection_error(error):
            cause = "connection"
        else:
            cause = "server_error"
        record_metric(f"env/openenv_errors/{cause}", 1, "sum")
        if cause == "server_died" and self.cfg.on_server_death == "stop":
            return StopRun(f"{text}; environment.openenv.on_server_death: stop")
        return OpenEnvError(cause, text)

    # -- the end -------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close what clients are still closing, stop the servers tether started and the loop; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        concurrent.futures.wait(list(self._pending), timeout=2.0)
        for s in self.servers:
            s.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)
        atexit.unregister(self.shutdown)


def _is_connection_error(error: BaseException) -> bool:
    from websockets.exceptions import WebSocketException  # noqa: PLC0415 — the optional extra ``openenv`` brings it

    return isinstance(error, ConnectionError | OSError | EOFError | WebSocketException)
