"""The teacher must read the student's token ids as the student does: one tokenizer, checked at start.

The teacher scores the ids the student sampled, never a re-tokenised text, so an id must name the same token
on both sides. A local teacher's tokenizer is compared with the student's directly (vocabulary, added tokens,
special-token ids). A remote teacher's tokenizer is not visible over the API, so it is probed: a text rendered
with the student's chat template (roles, a tool call, digits, non-ASCII) is sent as text and the ids the server
read back (``prompt_token_ids``) must equal the student's; then the student's largest id is sent as a prompt,
which a server with a smaller vocabulary refuses. The error names what differs.
"""

from __future__ import annotations

from typing import Any

from tether.config import ConfigError
from tether.llm import BadRequest

_PROBE_MESSAGES = [
    {"role": "system", "content": "You are a support agent. Tools: get_order_status."},
    {"role": "user", "content": "Where is my order O-3410? I paid 129.99 € on 2024-05-17 — café «Ærø» 你好."},
    {"role": "assistant", "content": '<tool_call>\n{"name": "get_order_status", "arguments": {"order_id": "O-3410"}}'
                                     "\n</tool_call>"},
]


def tokenizer_differences(student: Any, teacher: Any, limit: int = 3) -> list[str]:
    """What differs between two HF tokenizers, in words (empty when they read ids alike)."""
    out = []
    if len(student) != len(teacher):
        out.append(f"vocabulary size {len(student)} (student) vs {len(teacher)} (teacher)")
    sv, tv = student.get_vocab(), teacher.get_vocab()
    moved = [f"{tok!r}: id {i} vs {tv.get(tok)}" for tok, i in sorted(sv.items(), key=lambda kv: kv[1])
             if tv.get(tok) != i]
    if moved:
        out.append(f"{len(moved)} tokens have another id or are missing in the teacher, e.g. "
                   + "; ".join(moved[:limit]))
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        s, t = getattr(student, name, None), getattr(teacher, name, None)
        if s != t:
            out.append(f"{name} {s} (student) vs {t} (teacher)")
    return out


def check_local(student: Any, teacher: Any, *, where: str) -> None:
    """ConfigError naming what differs when ``teacher`` (loaded from ``where``) is not the student's tokenizer."""
    diffs = tokenizer_differences(student, teacher)
    if diffs:
        raise ConfigError(f"`teacher.path` {where}: the teacher's tokenizer differs from the student's: "
                          f"{'; '.join(diffs)}. The teacher scores the student's token ids, so both must share one "
                          "tokenizer: pick a teacher of the student's family (same vocabulary)")


def probe_text(student: Any) -> str:
    """A text that exercises the student's chat template and vocabulary."""
    try:
        text = student.apply_chat_template(_PROBE_MESSAGES, tokenize=False)
    except Exception:  # noqa: BLE001 — a tokenizer without a template: the messages as plain text
        text = "\n".join(m["content"] for m in _PROBE_MESSAGES)
    return str(text)


async def check_remote(client: Any, student: Any) -> None:
    """Probe the teacher server's tokenizer (module docstring); ConfigError naming the first difference."""
    where = f"`teacher.remote` ({client.base_url}, model {client.model!r})"
    text = probe_text(student)
    mine = list(student.encode(text, add_special_tokens=False))
    answer = await client.completions(text, max_tokens=1, temperature=0.0, return_token_ids=True)
    choice = answer["choices"][0]
    theirs = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
    if not isinstance(theirs, list):
        raise ConfigError(f"{where}: the server did not return `prompt_token_ids` for a text prompt, so the "
                          "teacher's tokenizer cannot be checked against the student's; use a server that does "
                          "(tether serve, vLLM >= 0.10.2 with return_token_ids)")
    bos = getattr(student, "bos_token_id", None)
    if bos is not None and theirs[:1] == [bos] and mine[:1] != [bos]:
        theirs = theirs[1:]  # a server that adds the BOS token to text prompts (vLLM's default)
    if theirs != mine:
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        shown = student.decode(mine[max(0, at - 3): at + 3])
        raise ConfigError(f"{where}: the teacher's tokenizer differs from the student's: the probe text reads as "
                          f"{len(mine)} ids for the student and {len(theirs)} for the teacher, first differing at "
                          f"position {at} (student id {mine[at] if at < len(mine) else None}, teacher id "
                          f"{theirs[at] if at < len(theirs) else None}, around {shown!r}). The teacher scores the "
                          "student's token ids, so both must share one tokenizer")
    top = len(student) - 1
    try:
        await client.completions([top], max_tokens=1, temperature=0.0)
    except BadRequest as e:
        raise ConfigError(f"{where}: the server refused the student's largest token id {top} ({e}); the teacher's "
                          f"vocabulary is smaller than the student's {len(student)} tokens") from None
