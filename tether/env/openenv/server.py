"""One OpenEnv server process that tether starts: ``python -m uvicorn <module>:<app>`` on a free loopback port, in
this interpreter, ready once ``GET /health`` answers 200 (the route every OpenEnv ``create_app`` registers).

openenv-core's own launcher (``UVProvider``) runs ``uv run --isolated --project``, which builds a fresh environment
for the project (a network install): tether starts uvicorn itself, with the packages it runs with, as openenv's
launcher would otherwise. The child's output goes to a log file (named in every error about it); on Linux the child
is asked to die with the thread that started it (``PR_SET_PDEATHSIG``), so a tether killed outright leaves no server
behind; ``stop`` (and the pool's ``atexit``) end it otherwise.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AppSpec:
    """What uvicorn serves: ``app`` (``module:attribute``) imported from ``app_dir``."""

    app: str
    app_dir: Path


class ServerStartError(RuntimeError):
    """A server did not become healthy; the message names the app, the key and the log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # in the child, before exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """``start()`` launches and waits for health (``start_timeout_s``), ``alive()``, ``stop()``; ``url`` and ``pid``
    of the current process; ``start()`` again after a death launches a new one on a new port."""

    def __init__(self, spec: AppSpec, index: int = 0):
        self.spec, self.index = spec, index
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log = Path(tempfile.gettempdir()) / f"tether-openenv-{os.getpid()}-{index}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def describe(self) -> str:
        return f"OpenEnv server {self.index} ({self.spec.app}, pid {self.pid}, {self.url})"

    def start(self, timeout_s: float) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Start the process (a new one on a new port); ``wait_ready`` waits for its health."""
        self.stop()
        self.port = free_port()
        cmd = [sys.executable, "-m", "uvicorn", self.spec.app, "--app-dir", str(self.spec.app_dir), "--host",
               "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        paths = [str(self.spec.app_dir), *(p for p in sys.path if p), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=str(self.spec.app_dir),
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.describe()} exited with code {self.proc.returncode} before it was "
                                       f"ready; its log {self.log} ends:\n{self._tail()}")
            if self._healthy():
                return
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(f"{self.describe()} did not answer GET /health within {timeout_s:g} s "
                               f"(environment.openenv.start_timeout_s); its log {self.log} ends:\n{self._tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(unreadable)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_status(self) -> int | None:
        """The current process's exit code (negative: killed by that signal), None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5.0)
