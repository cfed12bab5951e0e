"""Agent programs as rollouts (``agent_loop.name: program``): a user's agent — any code calling
``chat.completions`` with tools through the official ``openai`` SDK, LangChain or plain HTTP — plays episodes
against a per-episode endpoint of the rollout engine, and tether trains on exactly what it generated.

``episode.py`` (what the program is handed), ``gateway.py`` (the per-episode endpoints: tether serve's app over a
recording engine), ``recording.py`` (each call's prompt and completion ids, logprobs, weight versions; the run's
sampling and limits enforced), ``stitch.py`` (calls → token-in/token-out segments), ``loop.py`` (the agent loop),
``verifiers.py`` (verifiers tasksets as an environment and an agent program; imported only by name: it needs the
``verifiers`` extra).
"""

from tether.programs.episode import Episode, Observation
from tether.programs.loop import ProgramAgentLoop

__all__ = ["Episode", "Observation", "ProgramAgentLoop"]
