"""Tools: a function with an OpenAI-format schema, an enforced timeout and optional simulated latency.

A ``Tool`` is generic (nothing customer-service specific): a name, a description, its parameters, a
callable (sync or async) and the ``timeout_ms`` / ``latency_ms`` of the action-space config. A
``ToolBox`` holds the tools one episode offers (``Task.tools`` restricts them) and turns every call into a
``ToolResult``. Every failure — unknown tool, params that are not an object, missing / unexpected /
non-string / out-of-enum params, a timeout, a ``ToolError`` or any other exception raised by the
function — becomes an error result (``error=True``) with a short message for the model, never an
exception out of ``call`` and never a silent empty result.

Timeouts are enforced with ``asyncio.wait_for`` around simulated latency + the call. The simulated
latency (lognormal around ``median``, capped at ``max``) is an ``asyncio.sleep``, so that thousands of
concurrent episodes can be dominated by waiting without blocking the event loop, and a call whose latency
exceeds its timeout never runs (its side effects do not happen). A sync function runs inline (it must be
fast); mark a slow, blocking one ``blocking=True`` to run it in a worker thread, where the timeout still
answers on time but the thread finishes in the background.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence


class ToolError(Exception):
    """Raised by a tool function for bad input (e.g. an unknown id); the message is shown to the model."""


def to_text(value: Any) -> str:
    """The text the model sees for a tool's return value: strings as they are, anything else short JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def error_text(message: str) -> str:
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
        get = spec.get if isinstance(spec, Mapping) else lambda k, d=None: getattr(spec, k, d)
        return cls(float(get("median")), float(get("sigma", 0.0) or 0.0), get("max", None))


@dataclass(frozen=True)
class Param:
    name: str
    description: str
    enum: tuple[str, ...] | None = None  # allowed values; the check is case-insensitive


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    fn: Callable[..., Any]  # called with the params as keyword arguments (all strings)
    timeout_ms: float
    latency: Latency | None = None
    blocking: bool = False  # run a sync fn in a worker thread

    def schema(self) -> dict[str, Any]:
        """OpenAI function-calling format; every parameter is a required string."""
        props: dict[str, Any] = {}
        for p in self.params:
            props[p.name] = {"type": "string", "description": p.description}
            if p.enum:
                props[p.name]["enum"] = list(p.enum)
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": [p.name for p in self.params],
                    "additionalProperties": False,
                },
            },
        }

    def check_params(self, params: Any) -> str | None:
        """The error message for bad params, or None when they are fine."""
        if not isinstance(params, Mapping):
            return f"arguments of {self.name} must be a JSON object, got {type(params).__name__}"
        names = [p.name for p in self.params]
        missing = [n for n in names if n not in params]
        extra = sorted(k for k in params if k not in names)
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if extra:
            problems.append(f"unexpected {', '.join(map(str, extra))}")
        if problems:
            return f"{self.name} takes ({', '.join(names)}): {'; '.join(problems)}"
        for p in self.params:
            value = params[p.name]
            if not isinstance(value, str):
                return f"{self.name}: {p.name} must be a string, got {type(value).__name__}"
            if p.enum and value.strip().lower() not in {e.lower() for e in p.enum}:
                return f"{self.name}: {p.name} must be one of {', '.join(p.enum)}"
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
    except (asyncio.TimeoutError, TimeoutError):
        return done(error_text(f"tool {tool.name} timed out after {tool.timeout_ms:g} ms"), True, latency=latency)
    except ToolError as e:
        return done(error_text(str(e)), True, latency=latency)
    except Exception as e:  # a broken tool is an observation for the model, counted as a tool error
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
            msg = f"unknown tool {name!r}; available: {', '.join(self._by_name)}"
            return ToolResult(str(name), params, error_text(msg), True)
        return await run_tool(tool, params, rng)


def parse_action(action: Any) -> tuple[Any, Any, str | None]:
    """``(name, params, error)`` of an action ``{"name", "params"}``; ``arguments`` (OpenAI) and a JSON
    string of params are accepted too. ``error`` is a message when the action itself is malformed."""
    if not isinstance(action, Mapping) or "name" not in action:
        return None, None, 'an action is {"name": tool, "params": {...}}'
    params = action.get("params", action.get("arguments", {}))
    if isinstance(params, str):
        try:
            params = json.loads(params) if params.strip() else {}
        except json.JSONDecodeError as e:
            return action["name"], params, f"arguments are not valid JSON: {e.msg}"
    return action["name"], params, None
