"""Secrets: ``${VAR}`` references, the ``Secret`` value and redaction — one module, one rule.

A secret config value (``llm_client.api_key``, ``reward.judge_client.api_key``,
``environment.user_llm.client.api_key``, ``teacher.remote.api_key``: any field declared ``Secret``) is a literal or
a string of ``${VAR}`` references. It is resolved only when used (``Secret.get()``), so validating a file needs no
secret, and every way out of the process — a dump, ``repr``, a log line, metrics, a checkpoint — shows ``${VAR}``
(when the value is only references) or ``***``, never the value.

- ``interpolate(value, key_path)`` is the one interpolator (secrets, and the ``${VAR}`` of an endpoint's
  ``base_url`` and ``model``): each ``${VAR}`` read from the environment now; a missing variable is a
  ``ConfigError`` naming the variable and the key path the value came from.
- ``looks_secret(name)`` is the one name rule (``key``, ``*_key``, ``*token*``, ``*secret*``, ``*password*``, any
  case): a config field so named must be declared ``Secret``, and a string under such a key is redacted from dumps
  even where it is not one (``redact_by_name``).
- ``name_secrets(model)`` tells each ``Secret`` of a validated config its key path, and each endpoint section its
  own, so that an error names the key a secret came from (the judge's key, not ``llm_client.api_key``).

Layer: the bottom (it imports ``tether.errors`` only); ``tether.config``, ``tether.llm`` and the actors' environment
(``tether.distributed.envvars``) use it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pydantic import BaseModel
from pydantic_core import core_schema

from tether.errors import ConfigError

ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""One ``${VAR}`` reference; group 1 is the variable's name."""
_ONLY_REFS = re.compile(r"(?:\$\{[A-Za-z_][A-Za-z0-9_]*\})+")
_SECRET_NAME = re.compile(r"(^|_)key$|token|secret|password", re.IGNORECASE)
REDACTED = "***"
"""What every dump writes for a literal secret."""


def looks_secret(name: str) -> bool:
    """The one secret-name rule: ``key``, ``*_key``, ``*token*``, ``*secret*``, ``*password*`` (any case)."""
    return bool(_SECRET_NAME.search(name))


def interpolate(value: str, key_path: str) -> str:
    """Replace each ``${VAR}`` in ``value`` by ``os.environ[VAR]``; a missing variable is a ConfigError naming the
    variable and ``key_path``, the key the value came from (``reward.judge_client.base_url``)."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise ConfigError(f"`{key_path}` refers to environment variable {name}, which is not set; "
                              f"export {name}=... before running")
        return os.environ[name]

    return ENV_REF.sub(sub, value)


def variables(value: str) -> list[str]:
    """The environment variables ``value`` refers to (``${VAR}``), in order, each once."""
    return list(dict.fromkeys(ENV_REF.findall(value)))


def redacted(value: str) -> str:
    """How a secret is shown: itself when it is only ``${VAR}`` references, else ``***``."""
    return value if _ONLY_REFS.fullmatch(value) else REDACTED


class Secret:
    """A secret config value: a literal or a ``${VAR}`` reference, resolved by ``get()`` at use time."""

    __slots__ = ("_raw", "key_path")

    def __init__(self, raw: str, key_path: str = "") -> None:
        self._raw = raw
        self.key_path = key_path
        """Where the value came from, for error messages (set by ``name_secrets`` when a config is validated)."""

    def get(self) -> str:
        """The secret's value, with ``${VAR}`` references read from the environment now."""
        return interpolate(self._raw, self.key_path or "secret")

    def redacted(self) -> str:
        """``${VAR}`` when the value is only environment references, else ``***``."""
        return redacted(self._raw)

    def variables(self) -> list[str]:
        """The environment variables the value is read from (empty for a literal)."""
        return variables(self._raw)

    def __repr__(self) -> str:
        return f"Secret({self.redacted()!r})"

    __str__ = redacted

    def __eq__(self, other: object) -> bool:  # the key path is where it was found, not what it is
        return isinstance(other, Secret) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)

    @classmethod
    def _validate(cls, value: Any) -> Secret:
        if isinstance(value, Secret):
            return cls(value._raw, value.key_path)
        if not isinstance(value, str):
            raise ValueError("expected a string (a literal secret or a ${VAR} reference)")
        return cls(value)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        # Serialising (model_dump, to_yaml) always redacts: there is no dump that shows the value.
        return core_schema.no_info_plain_validator_function(
            cls._validate,
            serialization=core_schema.plain_serializer_function_ser_schema(lambda s: s.redacted()),
        )

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: Any) -> dict[str, Any]:
        return {"type": "string", "format": "password"}


def name_secrets(model: BaseModel, prefix: str = "") -> None:
    """Tell each ``Secret`` under ``model`` its key path (``teacher.remote.api_key``). A section whose class declares
    a ``_key_path`` private attribute (an endpoint, ``LLMClientConfig``) learns its own path too, for the errors of
    its other ``${VAR}`` values and of a key that is not set."""
    for name, info in type(model).model_fields.items():
        _name(getattr(model, name), f"{prefix}{info.alias or name}")


def _name(value: Any, path: str) -> None:
    if isinstance(value, Secret):
        value.key_path = path
    elif isinstance(value, BaseModel):
        if "_key_path" in type(value).__private_attributes__:
            value._key_path = path  # type: ignore[attr-defined]  # declared by that class
        name_secrets(value, path + ".")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _name(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            _name(item, f"{path}.{k}")


def redact_by_name(data: Any) -> Any:
    """Plain data (a dump) with every string under a secret-looking key redacted, even where it is not a
    ``Secret`` (belt and braces: a dict of a plugin's parameters, say)."""
    if isinstance(data, dict):
        return {k: redacted(v) if isinstance(v, str) and looks_secret(str(k)) else redact_by_name(v)
                for k, v in data.items()}
    if isinstance(data, list):
        return [redact_by_name(v) for v in data]
    return data
