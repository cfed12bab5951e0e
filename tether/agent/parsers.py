"""Tool-call parsers: the model's decoded text → tool calls, behind a small registry.

``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5 / Hermes-2-Pro
format, as verl's and vLLM's ``hermes`` parsers do). ``function_call_parser`` (the seed's name) accepts the
same blocks and, when there are none, an OpenAI-style function call written as bare or fenced JSON
(``{"name": ..., "arguments": ...}``, ``"parameters"`` accepted for ``"arguments"``). ``pythonic`` reads a turn
that is a Python list of keyword calls (``[name(arg="v")]``, the Llama-3.2/4 format, vLLM's ``pythonic``).

A malformed call is never an exception: it is returned as a ``ParseError`` that the agent loop turns into
an error observation for the model. The model's text is untrusted, so a call is also refused (a
``ParseError`` saying why) when it exceeds ``tether.env.tools.LIMITS``: more than 65 536 characters of JSON,
arguments nested deeper than 32 levels, a number literal longer than 100 characters, NaN/Infinity, a
string with a lone surrogate or a NUL character, or a tool name longer than 128 characters. Python's own
limits sit far above these and fail with exceptions (``json`` recursion at ~1000 levels, ``int()`` at 4300
digits). At most ``MAX_CALLS_PER_TURN`` blocks are read from one turn; the rest become one error. Every
registered parser runs behind a guard: lone surrogates in the text (which a remote engine's JSON escapes
can produce) are replaced by U+FFFD, and a parser that raises returns its failure as a ``ParseError``.

Blocks are found with ``str.find`` in one left-to-right pass: the regular expressions this replaced took
quadratic time on texts with many unclosed ``<tool_call>`` or ``` fences (80 s for 220 k characters).
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tether.env.tools import LIMITS, argument_problem, loads_arguments, text_problem

log = logging.getLogger(__name__)

MAX_CALLS_PER_TURN = 32  # tool-call blocks parsed from one assistant turn (the loop runs max_parallel_calls)
_OPEN, _CLOSE, _FENCE = "<tool_call>", "</tool_call>", "```"
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


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


def _guarded(name: str, fn: ToolParser) -> ToolParser:
    def parse(text: str) -> ParsedTurn:
        text = _LONE_SURROGATE.sub("\ufffd", text)  # cannot be encoded: the tokenizer would raise on it
        try:
            return fn(text)
        except Exception as e:  # noqa: BLE001 — a parser bug: recorded on the trajectory, seen by the model
            log.warning("tool parser %r failed on a %d-character turn", name, len(text), exc_info=True)
            return ParsedTurn(content="", errors=[ParseError(text[:200], f"the {name} parser failed: "
                                                                         f"{type(e).__name__}")])

    return parse


def register_parser(name: str) -> Callable[[ToolParser], ToolParser]:
    """Register ``fn`` under ``name``; ``get_parser`` returns it behind the guard described above."""

    def deco(fn: ToolParser) -> ToolParser:
        if name in _PARSERS:
            raise ValueError(f"tool parser {name!r} is already registered")
        _PARSERS[name] = _guarded(name, fn)
        return fn

    return deco


def get_parser(name: str) -> ToolParser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool_parser.name {name!r}; registered: {sorted(_PARSERS)}") from None


def _call_from_json(raw: str) -> ToolCall | ParseError:
    obj, problem = loads_arguments(raw, depth=LIMITS.max_depth + 1)  # + the call object around the arguments
    if problem:
        return ParseError(raw, problem)
    if not isinstance(obj, dict):
        return ParseError(raw, "a tool call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseError(raw, "missing string field 'name'")
    if len(name) > LIMITS.max_name_chars:
        return ParseError(raw, f"a tool name is at most {LIMITS.max_name_chars} characters")
    problem = text_problem(name, "the tool name")
    if problem:
        return ParseError(raw, problem)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit arguments as a JSON string (OpenAI wire format)
        args, problem = loads_arguments(args) if args.strip() else ({}, None)
        if problem:
            return ParseError(raw, f"'arguments' is a string that is not valid JSON ({problem})")
    if not isinstance(args, dict):
        return ParseError(raw, "'arguments' must be a JSON object")
    problem = argument_problem(args)
    if problem:
        return ParseError(raw, problem)
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


def _parse_blocks(blocks: list[str]) -> list[ToolCall | ParseError]:
    parsed: list[ToolCall | ParseError] = [_call_from_json(b.strip()) for b in blocks[:MAX_CALLS_PER_TURN]]
    if len(blocks) > MAX_CALLS_PER_TURN:
        extra = len(blocks) - MAX_CALLS_PER_TURN
        parsed.append(ParseError("", f"{extra} more tool calls were ignored (at most {MAX_CALLS_PER_TURN} per turn)"))
    return parsed


@register_parser("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    blocks, kept, pos = [], [], 0
    unclosed = None
    while (start := text.find(_OPEN, pos)) >= 0:
        kept.append(text[pos:start])
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:  # generation stopped (max_tokens) inside a call
            unclosed, pos = text[start:], len(text)
            break
        blocks.append(text[start + len(_OPEN):end])
        pos = end + len(_CLOSE)
    kept.append(text[pos:])
    parsed = _parse_blocks(blocks)
    if unclosed is not None:
        parsed.append(ParseError(unclosed, "unterminated <tool_call> block"))
    return _collect(parsed, "".join(kept))


def _fenced_objects(text: str) -> tuple[list[str], str]:
    """The ``` fenced JSON objects of ``text`` (an optional ``json`` tag after the fence) and the text
    without them."""
    found, kept, pos = [], [], 0
    while (start := text.find(_FENCE, pos)) >= 0:
        end = text.find(_FENCE, start + len(_FENCE))
        if end < 0:
            break
        body = text[start + len(_FENCE):end].strip()
        body = body[4:].lstrip() if body.startswith("json") else body
        if body.startswith("{") and body.endswith("}"):
            found.append(body)
            kept.append(text[pos:start])
            pos = end + len(_FENCE)
        else:  # not an object: its closing fence may open the next block
            kept.append(text[pos:end])
            pos = end
    kept.append(text[pos:])
    return found, "".join(kept)


@register_parser("function_call_parser")
def parse_function_call(text: str) -> ParsedTurn:
    turn = parse_hermes(text)
    if turn.calls or turn.errors:
        return turn
    stripped = text.strip()
    candidates, content = _fenced_objects(stripped)
    if not candidates:
        content = stripped
        if stripped.startswith("{") and stripped.endswith("}"):
            candidates, content = [stripped], ""
    return _collect(_parse_blocks(candidates), content)


def _literal(node: ast.expr) -> Any:
    return ast.literal_eval(node)  # strings, numbers, booleans, None, lists, dicts, tuples; anything else raises


def _pythonic_call(node: ast.expr) -> ToolCall | ParseError:
    raw = ast.unparse(node)[:200]
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ParseError(raw, "each element of a pythonic tool-call list must be a call name(arg=value, ...)")
    if node.args:
        return ParseError(raw, f"{node.func.id}(...): pass arguments by keyword (name=value)")
    try:
        args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return ParseError(raw, f"{node.func.id}(...): argument values must be literals (strings, numbers, lists, "
                               "dicts)")
    problem = argument_problem(args) or text_problem(node.func.id, "the tool name")
    if problem:
        return ParseError(raw, problem)
    return ToolCall(name=node.func.id, arguments=args)


@register_parser("pythonic")
def parse_pythonic(text: str) -> ParsedTurn:
    """Llama-3.2/4-style calls (vLLM's ``pythonic`` parser): the whole turn is a Python list of calls,
    ``[get_order(order_id="o-1"), query_inventory(sku_id="SKU-9")]``; any other text is content, not a call."""
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return ParsedTurn(content=stripped)
    if len(stripped) > LIMITS.max_chars:
        return ParsedTurn(content="", errors=[ParseError(stripped[:200], f"a tool-call list is at most "
                                                                         f"{LIMITS.max_chars} characters")])
    try:
        tree = ast.parse(stripped, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ParsedTurn(content=stripped)  # prose in brackets, not a call list
    if not isinstance(tree.body, ast.List):
        return ParsedTurn(content=stripped)
    return _collect([_pythonic_call(e) for e in tree.body.elts[:MAX_CALLS_PER_TURN]], "")
