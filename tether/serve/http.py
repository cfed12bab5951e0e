"""Serving an app over HTTP: a bound socket (``bind``), uvicorn's settings (``uvicorn_config``) and ``ServerThread``
(the app in a background thread: tests, a co-located trainer, the agent-program gateway).

The listening socket is bound before uvicorn starts, so port 0 picks a free port without a race and the actual
address is known (``ServerThread.base_url``).
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from starlette.types import ASGIApp


def uvicorn_config(app: ASGIApp, *, log_level: str, grace_s: int) -> uvicorn.Config:
    """uvicorn's settings for tether serve. Its "auto" loop and HTTP protocol pick uvloop and httptools (pinned
    dependencies): the per-request and per-chunk cost on the event loop is what the engine's core loses."""
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace_s, loop="auto", http="auto")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 = any free port); OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """``app`` served by uvicorn in a background thread on ``host`` (a free port unless given).

    >>> with ServerThread(app) as server:
    ...     OpenAI(base_url=server.base_url + "/v1", api_key="...")
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):

        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, log_level=log_level, grace_s=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="tether-serve", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.base_url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
