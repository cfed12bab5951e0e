"""The ``environment.openenv`` section: how an OpenEnv environment (``environment.name: openenv:<url | app>``) is
served and talked to (``tether.env.openenv``)."""

from __future__ import annotations

from typing import Literal

from tether.config.base import PosFloat, PosInt, Section


class OpenEnvConfig(Section):
    """An OpenEnv server: the one at ``openenv:<url>``, or the ones tether starts for ``openenv:<module | file.py |
    folder>`` (uvicorn on a free loopback port each, stopped when the run ends)."""

    servers: PosInt = 1
    """Server processes tether starts for an app (not a URL), in processes; the episodes are dealt out among them
    (each episode is a WebSocket session of its own on one server). With a URL: 1."""
    start_timeout_s: PosFloat = 60.0
    """How long a started server may take to answer ``GET /health``, in seconds; longer fails the run at start (or,
    for a restart after a server died, the episodes that needed it)."""
    request_timeout_s: PosFloat = 30.0
    """How long one request to the server (connect, reset, a tool call, list tools, state) may take, in seconds;
    longer fails the episode, counted as ``env/openenv_errors/timeout``."""
    on_server_death: Literal["fail_episode", "stop"] = "fail_episode"
    """What a dead server costs: ``fail_episode`` — the episodes on it fail (counted as
    ``env/openenv_errors/server_died``, left out of their groups like any failed episode) and a server tether started
    is started again for the next ones (``env/openenv_server_restarts``); ``stop`` — the run stops with one line
    naming the server and how it ended. For a URL, a refused or lost connection counts as its death."""
    success_threshold: float = 1.0
    """An episode succeeded when its reward (the sum of the server's step rewards) is at least this, unless the
    server's state has a boolean ``success`` of its own, which wins (unitless)."""
    system_prompt: str = "Solve the task with the tools you are given. Call one tool at a time."
    """The system message of every episode (an OpenEnv server has none to give)."""
