"""Environments: the Env protocol, tools, memory, termination, the hybrid verifier and anti-hacking; ``plugin``:
the API users bring their own environments through (``docs/environments.md``)."""
