"""Tools: a function with an OpenAI-format schema, an enforced timeout and optional simulated latency.

A ``Tool`` is generic (nothing customer-service specific): a name, a description, its parameters, a
callable (sync or async) and the ``timeout_ms`` / ``latency_ms`` of the action-space config. A
``ToolBox`` holds the tools one episode offers (``Task.tools`` restricts them) and turns every call into a
``ToolResult``. A tool's parameters are ``Param`` strings or, for a tool built from a function
(``tether.env.plugin.functions``), the JSON Schema of its signature. Every failure — unknown tool, params that
are not an object, missing / unexpected / wrongly typed / out-of-enum params, a timeout, a ``ToolError`` or any
other exception raised by the function — becomes an error result (``error=True``) with a short message for the
model, never an exception out of ``call`` and never a silent empty result.

Timeouts are enforced with ``asyncio.wait_for`` around simulated latency + the call. The simulated
latency (lognormal around ``median``, capped at ``max``) is an ``asyncio.sleep``, so that thousands of
concurrent episodes can be dominated by waiting without blocking the event loop, and a call whose latency
exceeds its timeout never runs (its side effects do not happen). A sync function runs inline (it must be
fast); mark a slow, blocking one ``blocking=True`` to run it in a worker thread, where the timeout still
answers on time but the thread finishes in the background.

Arguments are untrusted model output. ``ArgumentLimits`` bounds what any call may carry (nesting depth, size,
number length, characters that cannot be encoded); ``argument_problem`` checks a value against them without
recursion, so that no argument — however deep, big or strange — can raise inside the environment. The
parser applies the same limits to the model's text (``tether.agent.parsers``) and ``parse_action`` applies
them again at the environment's door, for callers that build actions themselves.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ArgumentLimits:
    """What one tool call may carry. Python's own limits are far above these and fail with an exception
    (``json`` and ``dataclasses.asdict`` recurse ~1000 / ~500 levels; ``int()`` refuses 4300 digits);
    these fail with a message the model can act on."""

    max_depth: int = 32  # nesting of objects/arrays inside the arguments (the arguments object is level 1)
    max_chars: int = 65_536  # characters of one call's JSON text, and of the arguments' strings and keys
    max_number_chars: int = 100  # characters of one number literal (digits, sign, exponent)
    max_name_chars: int = 128  # characters of a tool name


LIMITS = ArgumentLimits()
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def text_problem(text: str, what: str) -> str | None:
    """Why ``text`` cannot be passed on (a lone surrogate cannot be encoded; NUL truncates C strings)."""
    bad = _SURROGATE.search(text)
    if bad:
        return f"{what} contains an invalid Unicode character (lone surrogate U+{ord(bad.group()):04X})"
    if "\x00" in text:
        return f"{what} contains a NUL character (\\u0000)"
    return None


def argument_problem(value: Any, limits: ArgumentLimits = LIMITS) -> str | None:
    """Why ``value`` (a call's arguments) exceeds ``limits`` or is not plain JSON, or None. Iterative:
    a deep or cyclic value ends the walk at ``max_depth`` rather than blowing the stack."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    size = 0
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limits.max_depth:
                return f"arguments are nested deeper than {limits.max_depth} levels"
            size += len(item)
            if size > limits.max_chars:
                return f"arguments are larger than {limits.max_chars} characters"
            if isinstance(item, dict):
                for k, v in item.items():
                    if not isinstance(k, str):
                        return f"argument names must be strings, got {type(k).__name__}"
                    size += len(k)
                    problem = text_problem(k, "an argument name")
                    if problem:
                        return problem
                    stack.append((v, depth + 1))
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            size += len(item)
            problem = text_problem(item, "an argument")
            if problem:
                return problem
        elif isinstance(item, bool) or item is None:
            size += 1
        elif isinstance(item, int):  # bit_length: never convert a huge int to text (4300-digit limit)
            if item.bit_length() > 3.33 * limits.max_number_chars:
                return f"a number in the arguments has more than {limits.max_number_chars} digits"
            size += 1
        elif isinstance(item, float):
            if not math.isfinite(item):
                return "numbers in the arguments must be finite (no NaN or Infinity)"
            size += 1
        else:
            return f"arguments must be JSON values, got {type(item).__name__}"
        if size > limits.max_chars:
            return f"arguments are larger than {limits.max_chars} characters"
    return None


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


_JSON_SPECIAL = re.compile(r'[\[\]{}"\\]')


def json_depth(text: str, stop_above: int | None = None) -> int:
    """The deepest ``[``/``{`` nesting of JSON ``text`` (brackets inside strings do not count), in one
    linear pass and without parsing — so that too-deep text is refused before ``json`` recurses into it."""
    depth = deepest = 0
    in_string, skip_to = False, -1
    for m in _JSON_SPECIAL.finditer(text):
        i, c = m.start(), m.group()
        if i < skip_to:
            continue
        if in_string:
            if c == "\\":
                skip_to = i + 2  # the escaped character, whatever it is
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if stop_above is not None and deepest > stop_above:
                break
        elif c in "]}":
            depth -= 1
    return deepest


class _Refused(ValueError):
    pass


def loads_arguments(text: str, limits: ArgumentLimits = LIMITS, *, depth: int | None = None) -> tuple[Any, str | None]:
    """``json.loads`` for untrusted text under ``limits``: ``(value, None)`` or ``(None, why)``; never
    raises. ``depth`` is the nesting allowed for the whole text (default ``limits.max_depth``; a call
    object wrapping its arguments needs one more)."""
    if len(text) > limits.max_chars:
        return None, f"{len(text)} characters of JSON; a call may have at most {limits.max_chars}"
    allowed = limits.max_depth if depth is None else depth
    if json_depth(text, stop_above=allowed) > allowed:
        return None, f"JSON nested deeper than {limits.max_depth} levels"

    def number(kind: type) -> Callable[[str], Any]:
        def parse(literal: str) -> Any:
            if len(literal) > limits.max_number_chars:
                raise _Refused(f"a number longer than {limits.max_number_chars} characters")
            return kind(literal)
        return parse

    def constant(name: str) -> Any:
        raise _Refused(f"{name} is not a JSON number")

    try:
        return json.loads(text, parse_int=number(int), parse_float=number(float), parse_constant=constant), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at char {e.pos})"
    except _Refused as e:
        return None, str(e)
    except (ValueError, RecursionError) as e:  # not expected within the limits above; still never raised
        return None, f"invalid JSON ({type(e).__name__})"


class ToolError(Exception):
    """Raised by a tool function for bad input (e.g. an unknown id); the message is shown to the model."""


def to_text(value: Any) -> str:
    """The text the model sees for a tool's return value: strings as they are, anything else short JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


MAX_ERROR_CHARS = 500  # an error shown to the model; messages that echo an argument are clipped to it


def error_text(message: str) -> str:
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return json.dumps({"error": message}, ensure_ascii=False)


@dataclass(frozen=True)
class Latency:
    """Simulated latency in ms: ``median * exp(sigma * N(0, 1))``, capped at ``max``."""

    median: float
    sigma: float = 0.0
    max: float | None = None

    def sample(self, rng: random.Random) -> float:
        ms = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if self.sigma > 0 else self.median
        return min(ms, self.max) if self.max is not None else ms

    @classmethod
    def from_spec(cls, spec: Any) -> Latency | None:
        """From a config ``LatencySpec`` (or a dict with median/sigma/max); None stays None."""
        if spec is None:
            return None
        get: Callable[..., Any] = spec.get if isinstance(spec, Mapping) else lambda k, d=None: getattr(spec, k, d)
        return cls(float(get("median")), float(get("sigma", 0.0) or 0.0), get("max", None))


@dataclass(frozen=True)
class Param:
    name: str
    description: str
    enum: tuple[str, ...] | None = None  # allowed values; the check is case-insensitive


_JSON_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {  # JSON Schema type -> (its name, check)
    "string": ("a string", lambda v: isinstance(v, str)),
    "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "boolean": ("a boolean", lambda v: isinstance(v, bool)),
    "array": ("an array", lambda v: isinstance(v, list)),
    "object": ("an object", lambda v: isinstance(v, Mapping)),
    "null": ("null", lambda v: v is None),
}


def _type_problem(tool: str, name: str, prop: Mapping[str, Any], value: Any) -> str | None:
    """Why ``value`` does not fit the top-level JSON Schema ``prop`` (type, nullable, enum), or None."""
    if value is None and prop.get("nullable"):
        return None
    kinds = prop.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    known = [k for k in kinds if k in _JSON_TYPES]
    if known and not any(_JSON_TYPES[k][1](value) for k in known):
        wanted = " or ".join(_JSON_TYPES[k][0] for k in known)
        return f"{tool}: {name} must be {wanted}, got {type(value).__name__}"
    enum = prop.get("enum")
    if enum:
        # Strings are compared case-insensitively (a model's "damaged" for DAMAGED is not an error); the function
        # receives the value as sent.
        fold = [e.lower() if isinstance(e, str) else e for e in enum]
        if (value.strip().lower() if isinstance(value, str) else value) not in fold:
            return f"{tool}: {name} must be one of {', '.join(str(e) for e in enum)}"
    return None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    fn: Callable[..., Any]  # called with the params as keyword arguments
    timeout_ms: float
    latency: Latency | None = None
    blocking: bool = False  # run a sync fn in a worker thread
    # The parameters' JSON Schema when the tool is built from a function's signature (``tether.env.plugin.functions``);
    # None: every ``params`` entry is a required string.
    parameters: Mapping[str, Any] | None = None

    def parameters_schema(self) -> dict[str, Any]:
        """The ``parameters`` object of the OpenAI schema."""
        if self.parameters is not None:
            return dict(self.parameters)
        props: dict[str, Any] = {}
        for p in self.params:
            props[p.name] = {"type": "string", "description": p.description}
            if p.enum:
                props[p.name]["enum"] = list(p.enum)
        return {"type": "object", "properties": props, "required": [p.name for p in self.params],
                "additionalProperties": False}

    def schema(self) -> dict[str, Any]:
        """OpenAI function-calling format."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters_schema()}
        return {"type": "function", "function": fn}

    def check_params(self, params: Any) -> str | None:
        """The error message for bad params, or None when they are fine."""
        if not isinstance(params, Mapping):
            return f"arguments of {self.name} must be a JSON object, got {type(params).__name__}"
        schema = self.parameters_schema()
        props: Mapping[str, Any] = schema.get("properties", {})
        names = list(props)
        missing = [n for n in schema.get("required", []) if n not in params]
        extra = sorted(k for k in params if k not in names)
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if extra:
            shown = [_clip(str(k), 40) for k in extra[:5]] + ([f"{len(extra) - 5} more"] if len(extra) > 5 else [])
            problems.append(f"unexpected {', '.join(shown)}")
        if problems:
            return f"{self.name} takes ({', '.join(names)}): {'; '.join(problems)}"
        for name, prop in props.items():
            if name in params:
                problem = _type_problem(self.name, name, prop, params[name])
                if problem:
                    return problem
        return None


@dataclass
class ToolResult:
    name: str
    params: Any
    text: str  # what the model sees
    error: bool
    value: Any = None  # the function's raw return value (None on error)
    latency_ms: float = 0.0  # simulated latency drawn for this call
    elapsed_ms: float = 0.0  # wall time of the call


async def run_tool(tool: Tool, params: Any, rng: random.Random | None = None) -> ToolResult:
    """Validate, wait the simulated latency and call ``tool`` under its timeout; never raises."""
    t0 = time.perf_counter()

    def done(text: str, error: bool, value: Any = None, latency: float = 0.0) -> ToolResult:
        return ToolResult(tool.name, params, text, error, value, latency, (time.perf_counter() - t0) * 1e3)

    problem = tool.check_params(params)
    if problem is not None:
        return done(error_text(problem), True)
    latency = tool.latency.sample(rng or random.Random(0)) if tool.latency else 0.0

    async def call() -> Any:
        if latency > 0:
            await asyncio.sleep(latency / 1e3)
        if inspect.iscoroutinefunction(tool.fn):
            return await tool.fn(**params)
        if tool.blocking:
            return await asyncio.to_thread(tool.fn, **params)
        return tool.fn(**params)

    try:
        value = await asyncio.wait_for(call(), timeout=tool.timeout_ms / 1e3)
    except TimeoutError:
        return done(error_text(f"tool {tool.name} timed out after {tool.timeout_ms:g} ms"), True, latency=latency)
    except ToolError as e:
        return done(error_text(str(e)), True, latency=latency)
    except Exception as e:  # noqa: BLE001 — a broken tool is an observation for the model, counted as a tool error
        return done(error_text(f"tool {tool.name} failed: {type(e).__name__}: {e}"), True, latency=latency)
    return done(to_text(value), False, value, latency)


@dataclass
class ToolBox:
    """The tools of one episode, optionally restricted to ``allowed`` names (per-task tool selection)."""

    tools: Sequence[Tool]
    allowed: Sequence[str] | None = None
    _by_name: dict[str, Tool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {t.name: t for t in self.tools if self.allowed is None or t.name in self.allowed}
        if self.allowed is not None:
            unknown = sorted(set(self.allowed) - {t.name for t in self.tools})
            if unknown:
                raise ValueError(f"task selects tools {unknown} that this environment does not have; "
                                 f"available: {[t.name for t in self.tools]}")

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self._by_name.values()]

    async def call(self, name: Any, params: Any, rng: random.Random | None = None) -> ToolResult:
        tool = self._by_name.get(name) if isinstance(name, str) else None
        if tool is None:
            shown = repr(_clip(name, LIMITS.max_name_chars)) if isinstance(name, str) else f"<{type(name).__name__}>"
            msg = f"unknown tool {shown}; available: {', '.join(self._by_name)}"
            return ToolResult(name if isinstance(name, str) else shown, params, error_text(msg), True)
        return await run_tool(tool, params, rng)


def parse_action(action: Any, limits: ArgumentLimits = LIMITS) -> tuple[Any, Any, str | None]:
    """``(name, params, error)`` of an action ``{"name", "params"}``; ``arguments`` (OpenAI) and a JSON
    string of params are accepted too. ``error`` is a message when the action itself is malformed; then
    ``name`` and ``params`` are safe to record (a name or params beyond ``limits`` are replaced by a short
    placeholder, so that nothing downstream — memory, anti-hacking, the verifier — has to handle them)."""
    if not isinstance(action, Mapping) or "name" not in action:
        return None, None, 'an action is {"name": tool, "params": {...}}'
    name = action["name"]
    if not isinstance(name, str):
        return f"<{type(name).__name__}>", None, f"a tool name must be a string, got {type(name).__name__}"
    if len(name) > limits.max_name_chars:
        return name[: limits.max_name_chars] + "...", None, f"a tool name is at most {limits.max_name_chars} characters"
    problem = text_problem(name, "the tool name")
    if problem:
        return _SURROGATE.sub("\ufffd", name).replace("\x00", "\ufffd"), None, problem
    params = action.get("params", action.get("arguments", {}))
    if isinstance(params, str):
        params, problem = loads_arguments(params, limits) if params.strip() else ({}, None)
        if problem:
            return name, None, f"arguments are not valid JSON: {problem}"
    problem = argument_problem(params, limits)
    if problem:
        return name, None, problem
    return name, params, None
