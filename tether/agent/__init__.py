"""The agent loop: multi-turn generation with tool calls, assembled token-in/token-out."""
