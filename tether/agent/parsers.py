"""Tool-call parsers: the model's decoded text → tool calls, behind a small registry.

``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5 / Hermes-2-Pro
format, as verl's and vLLM's ``hermes`` parsers do). ``function_call_parser`` (the seed's name) accepts the
same blocks and, when there are none, an OpenAI-style function call written as bare or fenced JSON
(``{"name": ..., "arguments": ...}``, ``"parameters"`` accepted for ``"arguments"``).

A malformed call is never an exception: it is returned as a ``ParseError`` that the agent loop turns into
an error observation for the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_UNCLOSED = re.compile(r"<tool_call>(?!.*</tool_call>)(.*)$", re.DOTALL)
_FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass
class ParseError:
    raw: str
    reason: str


@dataclass
class ParsedTurn:
    content: str  # the text with the tool-call blocks removed, stripped
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)


ToolParser = Callable[[str], ParsedTurn]
_PARSERS: dict[str, ToolParser] = {}


def register_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    def deco(fn: ToolParser) -> ToolParser:
        if name in _PARSERS:
            raise ValueError(f"tool parser {name!r} is already registered")
        _PARSERS[name] = fn
        return fn

    return deco


def get_parser(name: str) -> ToolParser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool_parser.name {name!r}; registered: {sorted(_PARSERS)}") from None


def _call_from_json(raw: str) -> ToolCall | ParseError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ParseError(raw, f"invalid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict):
        return ParseError(raw, "a tool call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseError(raw, "missing string field 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit arguments as a JSON string (OpenAI wire format)
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ParseError(raw, f"'arguments' is a string that is not valid JSON ({e.msg})")
    if not isinstance(args, dict):
        return ParseError(raw, "'arguments' must be a JSON object")
    return ToolCall(name=name, arguments=args)


def _collect(parsed: list[ToolCall | ParseError], content: str) -> ParsedTurn:
    turn = ParsedTurn(content=content.strip())
    for item in parsed:
        if isinstance(item, ToolCall):
            item.id = f"call_{len(turn.calls)}"
            turn.calls.append(item)
        else:
            turn.errors.append(item)
    return turn


@register_parser("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    parsed: list[ToolCall | ParseError] = [_call_from_json(m.strip()) for m in _TOOL_CALL.findall(text)]
    content = _TOOL_CALL.sub("", text)
    unclosed = _UNCLOSED.search(content)
    if unclosed:  # generation stopped (max_tokens) inside a call
        parsed.append(ParseError(unclosed.group(0), "unterminated <tool_call> block"))
        content = content[: unclosed.start()]
    return _collect(parsed, content)


@register_parser("function_call_parser")
def parse_function_call(text: str) -> ParsedTurn:
    turn = parse_hermes(text)
    if turn.calls or turn.errors:
        return turn
    stripped = text.strip()
    candidates = [m.group(1) for m in _FENCED.finditer(stripped)]
    if not candidates and stripped.startswith("{") and stripped.endswith("}"):
        candidates = [stripped]
    parsed = [_call_from_json(c) for c in candidates]
    content = _FENCED.sub("", stripped) if candidates and candidates[0] != stripped else ""
    if not candidates:
        content = stripped
    return _collect(parsed, content)
