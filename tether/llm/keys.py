"""Where the API key comes from, read only when a request is made, and the 401 diagnosis that depends on it.

A key is given as ``None`` (no ``Authorization`` header), a string (a literal or ``${VAR}`` references) or a
``tether.secrets.Secret`` (what a config holds: ``get()`` resolves at use time, ``redacted()`` shows ``${VAR}`` or
``***``); a string is made a ``Secret`` here, so one interpolator reads every key. It is read from the environment
at each request, so a key exported after the client was built is used, and a worker process started without the
variable fails with ``MissingKey`` naming it and the key path it came from (``reward.judge_client.api_key``).
"""

from __future__ import annotations

import os
from typing import Any

from tether.llm.errors import MalformedKey, MissingKey
from tether.secrets import REDACTED, Secret

PLACEHOLDER = REDACTED
"""What a dumped config (a run's config.yaml) writes for a literal key."""


class KeySource:
    def __init__(self, api_key: Any, key_path: str | None = None):
        self._secret: Secret | None
        if api_key is None:
            self._secret = None
        elif isinstance(api_key, str):
            self._secret = Secret(api_key)
        elif isinstance(api_key, Secret):
            self._secret = api_key
        else:
            raise TypeError(f"api_key must be None, a string or a Secret, not {type(api_key).__name__}")
        self.key_path = key_path or (self._secret.key_path if self._secret else "") or "llm_client.api_key"
        """The config key the key came from, named in every message."""
        self._shown: str | None = self._secret.redacted() if self._secret is not None else None
        self.variables: list[str] = self._secret.variables() if self._secret is not None else []
        """The environment variables the key is read from (empty for a literal key)."""

    @property
    def given(self) -> bool:
        return self._shown is not None

    def describe(self) -> str:
        if not self.given:
            return f"no key ({self.key_path} is not set)"
        if self.variables:
            return f"the key from environment variable{'s' if len(self.variables) > 1 else ''} " \
                   f"{', '.join(self.variables)}"
        return f"the literal key written in the config ({self.key_path})"

    def read(self) -> str | None:
        """The key now, from the environment; ``MissingKey`` / ``MalformedKey`` before anything is sent."""
        if not self.given:
            return None
        missing = [v for v in self.variables if v not in os.environ]
        if missing:
            raise MissingKey(
                f"{self.key_path} is {self._shown}, but environment variable {missing[0]} is not set in this "
                f"process (pid {os.getpid()}), so no request was sent. Export it before starting; a worker "
                f"process (a Ray actor, a subprocess, a service) does not always inherit its parent's "
                f"environment: pass the variable to it explicitly (for Ray: runtime_env={{'env_vars': "
                f"{{'{missing[0]}': ...}}}}).")
        assert self._secret is not None  # given
        try:
            key = self._secret.get()
        except Exception as e:  # noqa: BLE001 — a resolution error names the variable, never a value
            raise MissingKey(f"{self.key_path}: {e}") from None
        if key != key.strip() or any(c.isspace() for c in key):
            where = f"environment variable {self.variables[0]}" if self.variables else self.key_path
            what = "a newline" if ("\n" in key or "\r" in key) else "whitespace"
            raise MalformedKey(
                f"the key in {where} contains {what} (at its {_where_space(key)}), so no request was sent: "
                f"keys have none, it was most likely copied with it. Strip it, e.g. "
                f"export {self.variables[0] if self.variables else 'VAR'}=\"$(printf %s \"$"
                f"{self.variables[0] if self.variables else 'VAR'}\" | tr -d '[:space:]')\".")
        if not key:
            where = f"environment variable {self.variables[0]}" if self.variables else self.key_path
            raise MissingKey(f"the key in {where} is empty, so no request was sent: set it to the endpoint's key.")
        return key

    def auth_checks(self) -> list[str]:
        """What to check when the endpoint answered 401/403, for this key source (the source document's three
        checks: the variable reached this process, no stray whitespace, no doubled /v1)."""
        if not self.given:
            return [f"no key was sent ({self.key_path} is not set) and the endpoint wants one: set "
                    f"{self.key_path}: ${{VAR}} in the config (or `tether ping --api-key-env VAR`)"]
        checks = []
        if not self.variables and self._secret is not None and self._secret.get() == PLACEHOLDER:
            checks.append(f"the key is the placeholder `{PLACEHOLDER}`: this config was loaded from a dump (a "
                          f"run's config.yaml) whose literal key was redacted; give {self.key_path} as ${{VAR}}")
        if self.variables:
            checks.append(f"{self.describe()} is set in this process (pid {os.getpid()}) but the endpoint refused "
                          f"it: is it this endpoint's key, and current? In a worker process, is it the same "
                          f"value as where you tested it (curl -H \"Authorization: Bearer "
                          f"${self.variables[0]}\")?")
        else:
            checks.append(f"{self.describe()} was refused: is it this endpoint's key, and current? Prefer "
                          f"{self.key_path}: ${{VAR}}, read from the environment")
        checks.append("the key has no stray whitespace or newline (checked: none)")
        return checks


def _where_space(key: str) -> str:
    if key[-1:].isspace():
        return "end"
    if key[:1].isspace():
        return "start"
    return "middle"
