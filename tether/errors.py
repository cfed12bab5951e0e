"""``ConfigError``: a configuration that cannot be used, raised by every layer (the config's loader, a secret whose
variable is missing, a metrics sink whose package is not installed). It sits at the bottom so that the modules
below ``tether.config`` (``tether.secrets``, ``tether.metrics``) raise it without importing the config;
``tether.config`` re-exports it."""

from __future__ import annotations


class ConfigError(Exception):
    """A config that cannot be used; the message names the key, the file and what is allowed."""


class StopRun(RuntimeError):
    """An environment's fault that its config says must stop the run (e.g. ``environment.openenv.on_server_death:
    stop``): the rollouter neither retries nor counts it as one failed episode, it ends the run; the message names
    the cause."""
