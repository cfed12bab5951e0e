"""Tools from plain Python functions: the OpenAI schema from type hints and a Google-style docstring.

The schema is transformers' ``get_json_schema`` (``transformers.utils``), not a home-made one; tether then
keeps the parameters the config's ``action_space`` entry lists, in its order, drops ``return`` (the model
never sees it), puts each property's ``description`` right after its ``type`` and states
``additionalProperties: false`` (the environment refuses unexpected arguments anyway, so the schema says so).

    def lookup(state: dict, sku_id: str) -> dict:
        \"\"\"Get the stock level of a product.

        Args:
            sku_id: Product id, e.g. SKU-123.
        \"\"\"
        return state["stock"][sku_id]

A parameter named ``state`` is the episode's state, passed in by the environment and never shown to the model
(it needs neither a type hint nor a docstring line). A function may be sync or ``async``.

``bind(functions, action_space)`` checks the config's ``action_space`` (``name``, ``params``, ``timeout_ms``,
``latency_ms``) against the functions' signatures — every entry names a function, lists only its parameters
and every parameter without a default — and raises ``ValueError`` naming ``environment.action_space[i]``
otherwise. A parameter with a default that the entry does not list is not offered to the model.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether.env.tools import Latency, Tool

STATE = "state"  # the parameter the environment fills with the episode's state


Fn = Callable[..., Any]


def tool_functions(tools: Sequence[Fn] | Mapping[str, Fn]) -> dict[str, Fn]:
    """``{name: function}``: a list is named by each function's ``__name__``; a mapping names them itself."""
    if isinstance(tools, Mapping):
        return dict(tools)
    out: dict[str, Callable[..., Any]] = {}
    for fn in tools:
        name = getattr(fn, "__name__", None)
        if not isinstance(name, str) or name in out:
            what = "unnamed" if name is None else "a duplicate"
            raise ValueError(f"tool functions need distinct names; {fn!r} is {what}"
                             " (give tools as a mapping {name: function} to name them)")
        out[name] = fn
    return out


def parameters_of(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The parameters the model may fill (``state`` excluded)."""
    return {n: p for n, p in inspect.signature(fn).parameters.items() if n != STATE}


def function_schema(fn: Fn, params: Sequence[str] | None = None, *, name: str | None = None) -> dict[str, Any]:
    """The OpenAI tool schema of ``fn`` offering ``params`` (default: every parameter but ``state``), in that order.

    Raises ``ValueError`` with transformers' reason when a parameter lacks a type hint or a docstring line."""
    from transformers.utils import get_json_schema  # noqa: PLC0415 — keeps `tether --help` free of transformers

    sig = parameters_of(fn)
    order = list(sig) if params is None else list(params)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 — an annotation that does not resolve in the function's module
        raise ValueError(f"tool {name or fn.__name__}: cannot read its type hints ({type(e).__name__}: {e})") from None
    # A stand-in with only the offered parameters, so that get_json_schema neither sees ``state`` nor hidden ones.
    def stand_in() -> None: ...

    stand_in.__name__ = name or fn.__name__
    stand_in.__doc__ = inspect.getdoc(fn)
    stand_in.__signature__ = inspect.Signature([sig[p] for p in order])  # type: ignore[attr-defined]
    stand_in.__annotations__ = {p: hints[p] for p in order if p in hints}
    try:
        raw = get_json_schema(stand_in)["function"]
    except Exception as e:  # noqa: BLE001 — transformers' TypeHintParsingException / DocstringParsingException
        raise ValueError(f"tool {stand_in.__name__}: {e}") from None
    props = raw["parameters"].get("properties", {})
    ordered = {}
    for p in order:
        prop = dict(props[p])
        head = {k: prop.pop(k) for k in ("type", "description") if k in prop}
        ordered[p] = {**head, **prop}
    required = [p for p in order if sig[p].default is inspect.Parameter.empty]
    return {"type": "function", "function": {
        "name": stand_in.__name__, "description": raw.get("description", ""),
        "parameters": {"type": "object", "properties": ordered, "required": required, "additionalProperties": False}}}


@dataclass(frozen=True)
class BoundTool:
    """One ``action_space`` entry bound to its function: the schema is built once, the state per episode."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout_ms: float
    latency: Latency | None
    takes_state: bool

    def tool(self, state: Any = None) -> Tool:
        """The ``Tool`` of one episode (``state`` passed to the function when it takes one)."""
        fn = functools.partial(self.fn, **{STATE: state}) if self.takes_state else self.fn
        f = self.schema["function"]
        return Tool(self.name, f["description"], (), fn, self.timeout_ms, self.latency, parameters=f["parameters"])


def bind(functions: Mapping[str, Callable[..., Any]], action_space: Sequence[Any],
         elsewhere: Collection[str] = ()) -> list[BoundTool]:
    """The ``action_space`` entries (config ``ToolSpec``s) bound to ``functions``; see the module docstring. Entries
    naming a tool in ``elsewhere`` (an MCP server's, ``tether.env.mcp``) are another's to read and skipped."""
    out, seen = [], set()
    for i, spec in enumerate(action_space):
        key = f"environment.action_space[{i}]"
        if spec.name in seen:
            raise ValueError(f"{key}: tool {spec.name!r} is listed twice")
        seen.add(spec.name)
        if spec.name in elsewhere:
            continue
        fn = functions.get(spec.name)
        if fn is None:
            raise ValueError(f"{key}: tool {spec.name!r} is not a tool of this environment; "
                             f"its tools: {list(functions)}")
        sig = parameters_of(fn)
        unknown = [p for p in spec.params if p not in sig]
        missing = [p for p, v in sig.items() if v.default is inspect.Parameter.empty and p not in spec.params
                   and v.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        if unknown or missing:
            why = "; ".join(x for x in (unknown and f"not parameters of it: {', '.join(unknown)}",
                                        missing and f"required and not listed: {', '.join(missing)}") if x)
            raise ValueError(f"{key}: {spec.name} takes params {list(sig)}, "
                             f"the config lists {list(spec.params)} ({why})")
        try:
            schema = function_schema(fn, spec.params, name=spec.name)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        out.append(BoundTool(spec.name, fn, schema, spec.timeout_ms, Latency.from_spec(spec.latency_ms),
                             STATE in inspect.signature(fn).parameters))
    return out
