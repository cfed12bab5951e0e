"""A second OpenEnv app for tests/test_openenv*.py (openenv-core's classes only): ``wait(seconds)`` sleeps,
``finish(reward)`` ends the episode with that reward (its state has no ``success`` flag); importing it sleeps
``SLOW_START_S`` seconds first (a server slow to start)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

time.sleep(float(os.environ.get("SLOW_START_S", "0")))


class ProbeEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("probe")

        @mcp.tool()
        async def wait(seconds: float) -> str:
            """Sleep.

            Args:
                seconds: How long.
            """
            await asyncio.sleep(seconds)
            return "waited"

        @mcp.tool()
        def finish(reward: float) -> str:
            """End the episode.

            Args:
                reward: The episode's reward.
            """
            self._reward = reward
            return "finished"

        super().__init__(mcp)
        self._reward: float | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._reward = None
        return Observation()

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        obs.done, obs.reward = self._reward is not None, self._reward
        return obs

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation()

    @property
    def state(self) -> State:
        return State(step_count=0)


app = create_app(ProbeEnvironment, CallToolAction, CallToolObservation, env_name="probe", max_concurrent_envs=16)
