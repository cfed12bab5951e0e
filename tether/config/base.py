"""Shared pieces of the typed config: errors, the ``Section`` base and the constrained number types every section
uses. ``Secret`` and ``${VAR}`` interpolation live in ``tether.secrets`` (one module for every layer), re-exported
here."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from tether.errors import ConfigError  # noqa: F401 — re-exported
from tether.secrets import Secret, interpolate, looks_secret  # noqa: F401 — re-exported


class CrossFieldError(ValueError):
    """A rule between several keys; ``values`` maps each key (relative to the model) to its value, so
    that the loader can name the full key paths and the files that set them."""

    def __init__(self, rule: str, values: dict[str, Any]):
        super().__init__(rule)
        self.rule = rule
        self.values = values


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
            if looks_secret(name) and info.annotation in (str, str | None):
                raise TypeError(f"{cls.__name__}.{name} looks like a secret: annotate it as Secret")


def _check(ok: bool, rule: str, **values: Any) -> None:
    if not ok:
        raise CrossFieldError(rule, values)


