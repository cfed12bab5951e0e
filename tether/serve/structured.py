"""A chat request's output constraint: ``tool_choice``, strict tools and ``response_format`` → a grammar.

What each field asks for, and the grammar (``tether.engine.grammar``) the engine then decodes under:

- ``tool_choice: "required"``: one tool call of one of ``tools`` (several, one after another, unless
  ``parallel_tool_calls: false``), nothing else; a named function ``{"type": "function", "function": {"name"}}``:
  calls of that tool only. The calls are hermes blocks (the served model's format, read back by the ``hermes``
  parser), each call's ``arguments`` valid under its tool's ``parameters`` (no properties the schema does not
  name), whether or not the tool says ``strict``.
- ``tool_choice: "auto"`` (or absent) with at least one tool whose function says ``strict: true``: the model writes
  free text or calls as it likes, but a call it opens must be a call of one of ``tools``, and a strict tool's
  arguments must be valid under its schema (the others' any JSON object). Without a strict tool, nothing is
  constrained, as before.
- ``response_format: {"type": "json_object"}``: one JSON object; ``{"type": "json_schema", "json_schema":
  {"schema", "strict"}}``: a JSON document valid under ``schema``; ``strict: true`` also refuses properties the
  schema does not name (OpenAI's strict mode), without it JSON Schema's default allows them.

What the grammar does not change: ``max_tokens`` still ends a generation, inside a call or an object if it comes
first (``finish_reason: length``, the text as written); a stop string the request gives still cuts the text where it
matches; logprobs and ``top_logprobs`` are the unmasked model's (``tether.engine.base``), so an alternative listed
may be one the grammar did not allow.

A schema the grammar library cannot compile is a 400 naming the field (``response_format`` or
``tools.<i>.function.parameters``), as is a named tool that is not among ``tools``, a ``response_format`` together
with a forced or strict tool call, and constrained tool calls under a tool parser that does not read hermes blocks.
"""

from __future__ import annotations

from typing import Any

from tether.engine.grammar import Grammar, GrammarError, Grammars, GrammarUnavailable, ToolSpec
from tether.serve.generation import APIError

HERMES_PARSERS = ("hermes", "function_call_parser")  # the tool parsers that read hermes blocks


def chat_constraint(req: Any, tools: list[Any] | None, grammars: Grammars, *, parser: str) -> Grammar | None:
    """The grammar ``req`` asks for (None: unconstrained); ``tools``: the request's tools unless tool_choice is
    "none". Compiles (milliseconds, cached per schema): call it in a worker thread. A server installed without the
    ``grammar`` extra answers a constrained request 400 naming the extra and the field that asked for it."""
    try:
        return _constraint(req, tools, grammars, parser)
    except GrammarUnavailable as e:
        kind = (req.response_format or {}).get("type", "text")
        raise APIError(400, str(e), param="response_format" if kind != "text" else "tool_choice") from None


def _constraint(req: Any, tools: list[Any] | None, grammars: Grammars, parser: str) -> Grammar | None:
    choice = req.tool_choice
    named = None if choice is None or isinstance(choice, str) else choice.function.name
    forced = choice == "required" or named is not None
    strict = not forced and any(t.function.strict for t in tools or [])
    kind = (req.response_format or {}).get("type", "text")
    if kind != "text" and (forced or strict):
        what = "tool_choice 'required' or a named tool" if forced else "a tool with strict: true"
        raise APIError(400, f"response_format {kind!r} cannot be combined with {what}: the output is either tool "
                            f"calls or that format", param="response_format")
    if kind != "text":
        return _response_format(req.response_format, grammars)
    if not (forced or strict):
        return None
    if not tools:
        raise APIError(400, f"tool_choice {'required' if named is None else repr(named)} needs tools",
                       param="tool_choice")
    if parser not in HERMES_PARSERS:
        raise APIError(400, f"constrained tool calls are written in the hermes format; this server's tool parser is "
                            f"{parser!r}", param="tool_choice")
    indexed = list(enumerate(tools))
    if named is not None:
        indexed = [(i, t) for i, t in indexed if t.function.name == named]
        if not indexed:
            raise APIError(400, f"tool_choice names the function {named!r}, which is not among the tools "
                                f"{[t.function.name for t in tools]}", param="tool_choice")
    specs = [ToolSpec(t.function.name, t.function.parameters if forced or t.function.strict else None)
             for _, t in indexed]
    try:
        return grammars.tool_calls(specs, required=forced, parallel=req.parallel_tool_calls is not False)
    except GrammarError as e:
        where = next((f"tools.{i}.function.parameters" for i, t in indexed if t.function.name == e.tool), "tools")
        raise APIError(400, f"{where}: {e}", param=where) from None


def _response_format(fmt: dict[str, Any], grammars: Grammars) -> Grammar:
    kind = fmt.get("type")
    try:
        if kind == "json_object":
            return grammars.json_object()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError(400, "response_format json_schema needs 'json_schema': {'name', 'schema': {...}, "
                                    "'strict'}", param="response_format")
            return grammars.json_schema(spec["schema"], strict=spec.get("strict") is True)
    except GrammarError as e:
        raise APIError(400, f"response_format: the schema cannot be enforced: {e}", param="response_format") from None
    raise APIError(400, f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                   param="response_format")
