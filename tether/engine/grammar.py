"""Grammar-constrained decoding: a compiled grammar per request shape, a matcher per request, a token mask per step.

The machinery is xgrammar's (the ``grammar`` extra: ``pip install 'tether[grammar]'``), imported on first use so that
tether runs without it; a constrained request on an install without it fails naming the extra. ``Grammars`` compiles
for one tokenizer (xgrammar caches the compiled grammars of each schema); a ``Grammar`` is immutable and shared by
every request that uses it (``SamplingParams.constraint``); the engine makes each request its own ``Matcher``, fills
the logits of the tokens the grammar does not allow next with -inf before sampling, and advances it with each token
drawn. The grammar ends at one of the request's stop ids: a finished grammar allows nothing else, so the request
stops there.

Three grammars, as OpenAI's chat API asks for them (``tether.serve.structured`` maps the request's fields to them):
- ``json_object``: any JSON object (``response_format: {"type": "json_object"}``);
- ``json_schema``: a JSON document valid under a schema (``response_format: {"type": "json_schema"}``); ``strict``
  is xgrammar's strict mode: objects take no properties the schema does not name (OpenAI's strict semantics), and
  without it they may take more where the schema does not forbid them (JSON Schema's own default);
- ``tool_calls``: the hermes tool-call blocks of the tiny template and Qwen2.5/3 (``tether.agent.parsers``),
  ``<tool_call>\\n{"name": "<a tool>", "arguments": <JSON valid under that tool's schema>}\\n</tool_call>``, one or
  (``parallel``) several; ``required`` = nothing but the calls, else free text with a call wherever the model opens
  one (the text cannot hold a ``<tool_call>`` that is not a valid call).

JSON is compact, with json.dumps' separators (``{"a": 1, "b": [2, 3]}``): how the chat template renders the
arguments a policy is trained on, and a bound on what an untrained or weak model writes (xgrammar's any-whitespace
mode lets it pad with newlines until ``max_tokens``). Schema features xgrammar cannot compile (an unknown type, a
``$ref`` that resolves nowhere) raise ``GrammarError`` naming the problem; xgrammar accepts and ignores the
annotation keywords (``format`` on a string among them), so those are not enforced.

Measured on the tiny model's 2,048-token vocabulary, 2 CPU threads (``benchmarks/grammar_cost.py``): 16 µs per token
to fill and apply a mask, 0.7 µs to accept a token; the first compile for a tokenizer ~60 ms (it reads the
vocabulary), a schema after that 1-3 ms, then cached.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

EXTRA = "grammar"  # pyproject's extra that installs xgrammar
CACHE_BYTES = 256 << 20  # compiled grammars kept per tokenizer (a server's clients send any number of schemas)


class GrammarError(ValueError):
    """A schema or tool definition the grammar library cannot compile; the message says what, ``tool`` whose."""

    def __init__(self, message: str, tool: str | None = None):
        super().__init__(message)
        self.tool = tool


class GrammarUnavailable(RuntimeError):
    """xgrammar is not installed; the message names the extra that installs it."""


def _xgrammar() -> Any:
    try:
        import xgrammar  # noqa: PLC0415 — an optional extra, imported when a constrained request first arrives
    except ImportError as e:
        raise GrammarUnavailable(f"constrained decoding (tool_choice 'required' or a named tool, a strict tool, "
                                 f"response_format json, agent_loop.constrained_tool_calls) needs xgrammar: "
                                 f"pip install 'tether[{EXTRA}]' ({e})") from None
    return xgrammar


def check_available() -> None:
    """Raise ``GrammarUnavailable`` now rather than at the first constrained request."""
    _xgrammar()


@dataclass(frozen=True)
class ToolSpec:
    """A tool the grammar may call: its name and the JSON schema of its arguments (None: any JSON object)."""

    name: str
    parameters: dict[str, Any] | None


class Matcher:
    """One request's position in its grammar. Used by the engine's worker thread only."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32, reused every step

    def mask(self, logits: Any) -> None:
        """Set the logits [1, V] of the tokens the grammar does not allow next to -inf, in place."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask.to(logits.device))

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop id accepted: nothing more may be generated."""
        return bool(self._matcher.is_terminated())


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar for one tokenizer (``Grammars``); shared by the requests that use it."""

    compiled: Any
    vocab_size: int  # the logits' width it masks
    description: str  # e.g. "json_schema", "tool_calls(required)": for errors and logs

    def matcher(self, stop_token_ids: tuple[int, ...]) -> Matcher:
        """A new request's matcher; the grammar ends at one of ``stop_token_ids`` (at least one)."""
        if not stop_token_ids:
            raise ValueError(f"a {self.description} constraint needs stop_token_ids: the grammar ends at one of them")
        return Matcher(_xgrammar(), self.compiled, self.vocab_size, stop_token_ids)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class Grammars:
    """Compiles grammars for one tokenizer; xgrammar is imported, and the tokenizer read, at the first compile."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()  # compiles arrive from several worker threads

    def _compile(self, description: str, build: Any) -> Grammar:
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)
            try:
                compiled = build(xgr, self._compiler)
            except GrammarError:
                raise
            except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's schema errors are RuntimeErrors
                raise GrammarError(_short(e)) from None
        return Grammar(compiled, self.vocab_size, description)

    def json_object(self) -> Grammar:
        return self.json_schema({"type": "object"}, strict=False, description="json_object")

    def json_schema(self, schema: dict[str, Any], *, strict: bool, description: str = "json_schema") -> Grammar:
        text = _schema_text(schema)
        return self._compile(description, lambda xgr, c: c.compile_json_schema(
            text, any_whitespace=False, strict_mode=strict))

    def tool_calls(self, tools: list[ToolSpec], *, required: bool, parallel: bool, strict: bool = True) -> Grammar:
        """Hermes tool-call blocks of ``tools`` (module docstring); ``required``: calls only, at least one."""
        if not tools:
            raise GrammarError("a tool-call grammar needs at least one tool")

        def build(xgr: Any, compiler: Any) -> Any:
            from xgrammar.structural_tag import (  # noqa: PLC0415 — the optional extra (see _xgrammar)
                GrammarFormat,
                StructuralTag,
                TagFormat,
                TagsWithSeparatorFormat,
                TriggeredTagsFormat,
            )

            tags = []
            for tool in tools:
                schema = _schema_text(tool.parameters if tool.parameters is not None else {"type": "object"})
                try:
                    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
                except RuntimeError as e:
                    raise GrammarError(f"the parameters of tool {tool.name!r}: {_short(e)}", tool.name) from None
                tags.append(TagFormat(begin=f'{_OPEN}\n{{"name": {json.dumps(tool.name)}, "arguments": ',
                                      content=GrammarFormat(grammar=ebnf), end=f"}}\n{_CLOSE}"))
            if required:
                fmt: Any = TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                                   stop_after_first=not parallel)
            else:
                fmt = TriggeredTagsFormat(triggers=[_OPEN], tags=tags, stop_after_first=not parallel)
            return compiler.compile_structural_tag(StructuralTag(format=fmt))

        return self._compile(f"tool_calls({'required' if required else 'auto'})", build)


def _schema_text(schema: Any) -> str:
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"the schema is not JSON: {e}") from None


def _short(e: Exception) -> str:
    """xgrammar's message without its C++ location prefix ("[time] /path/file.cc:123: ")."""
    text = str(e).strip()
    head, sep, rest = text.partition(".cc:")
    if sep and head.startswith("["):
        text = rest.partition(": ")[2] or text
    return text.splitlines()[0] if text else type(e).__name__
