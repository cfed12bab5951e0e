"""A number-guessing environment written with openenv-core's own server classes (no tether import): an
``MCPEnvironment`` whose one MCP tool, ``guess(number)``, answers higher / lower / correct. ``reset(seed)`` picks the
secret number from the seed; the episode ends at the right guess (reward 1) or after ``MAX_GUESSES`` wrong ones
(reward 0); the state carries a ``success`` flag. Served by ``create_app`` like any OpenEnv environment:

    uvicorn guess_server:app --port 8000            # from this folder; tether starts it itself for
                                                   # environment.name: openenv:guess_server.py
"""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH, MAX_GUESSES = 1, 20, 5


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session: episodes share nothing

    def __init__(self) -> None:
        mcp = FastMCP("guess")

        @mcp.tool()
        def guess(number: int) -> str:
            """Guess the secret number.

            Args:
                number: Your guess, an integer between 1 and 20.
            """
            self._guesses += 1
            if number == self._secret:
                self._found = True
                return "correct"
            return "higher" if number < self._secret else "lower"

        super().__init__(mcp)
        self._secret, self._guesses, self._found = 0, 0, False
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self._secret = random.Random(seed).randint(LOW, HIGH)
        self._guesses, self._found = 0, False
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(prompt=f"I am thinking of a number between {LOW} and {HIGH}. Find it with the guess "
                                       f"tool; you have {MAX_GUESSES} guesses.")

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            done = self._found or self._guesses >= MAX_GUESSES
            obs.done, obs.reward = done, (1.0 if self._found else 0.0) if done else None
        return obs

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return State(episode_id=self._state.episode_id, step_count=self._state.step_count, guesses=self._guesses,
                     success=self._found)


app = create_app(GuessEnvironment, CallToolAction, CallToolObservation, env_name="guess", max_concurrent_envs=64)
