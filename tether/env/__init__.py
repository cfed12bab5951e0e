"""Environments: the Env protocol, tools, memory, termination, the hybrid verifier and anti-hacking."""
