"""tether: agentic reinforcement learning for tool-using LLMs."""

__version__ = "0.1.0"
