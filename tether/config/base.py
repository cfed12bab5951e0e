"""Shared pieces of the typed config: errors, ``${VAR}`` interpolation, ``Secret``, the ``Section`` base
and the constrained number types every section uses."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import core_schema


class ConfigError(Exception):
    """A config that cannot be used; the message names the key, the file and what is allowed."""


class CrossFieldError(ValueError):
    """A rule between several keys; ``values`` maps each key (relative to the model) to its value, so
    that the loader can name the full key paths and the files that set them."""

    def __init__(self, rule: str, values: dict[str, Any]):
        super().__init__(rule)
        self.rule = rule
        self.values = values


# ----------------------------------------------------------------------------- ${VAR} and secrets

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ONLY_REFS = re.compile(r"(?:\$\{[A-Za-z_][A-Za-z0-9_]*\})+")
_SECRET_NAME = re.compile(r"(^|_)key$|token|secret|password")


def interpolate(value: str, key_path: str) -> str:
    """Replace each ``${VAR}`` in ``value`` by ``os.environ[VAR]``; a missing variable is a ConfigError
    naming the variable and the key path the value came from."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise ConfigError(
                f"`{key_path}` refers to environment variable {name}, which is not set; "
                f"export {name}=... before running"
            )
        return os.environ[name]

    return _ENV_REF.sub(sub, value)


class Secret:
    """A secret config value: a literal or a ``${VAR}`` reference, resolved by ``get()`` at use time."""

    __slots__ = ("_raw", "key_path")

    def __init__(self, raw: str, key_path: str = "") -> None:
        self._raw = raw
        self.key_path = key_path  # set by RunConfig after validation, for error messages

    def get(self) -> str:
        """The secret's value, with ``${VAR}`` references read from the environment now."""
        return interpolate(self._raw, self.key_path or "secret")

    def redacted(self) -> str:
        """``${VAR}`` when the value is only environment references, else ``***``."""
        return self._raw if _ONLY_REFS.fullmatch(self._raw) else "***"

    def __repr__(self) -> str:
        return f"Secret({self.redacted()!r})"

    __str__ = redacted

    def __eq__(self, other: object) -> bool:
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


# ----------------------------------------------------------------------------- shared pieces

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]
Unit = Annotated[float, Field(ge=0, le=1)]  # [0, 1]
OpenUnit = Annotated[float, Field(gt=0, lt=1)]  # (0, 1)
Weight = Annotated[float, Field(ge=0, le=10)]


class Section(BaseModel):
    """Base of every config model: unknown keys are errors, the docstring under a field is its doc."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name, info in cls.model_fields.items():
            if _SECRET_NAME.search(name) and info.annotation in (str, str | None):
                raise TypeError(f"{cls.__name__}.{name} looks like a secret: annotate it as Secret")


def _check(ok: bool, rule: str, **values: Any) -> None:
    if not ok:
        raise CrossFieldError(rule, values)


