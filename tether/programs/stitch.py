"""An episode's recorded calls → token-in/token-out segments.

A call whose prompt extends an open segment's whole sequence (its prompt and everything after it) continues that
segment: the prompt's new tokens (tool results, user replies, the template's turn markers) join it with mask 0,
the completion with mask 1 and its logprobs and weight versions. Any other call starts a segment of its own — a
program that rewrote its history (summarised, dropped, re-rendered a message differently), a side conversation
(a sub-agent, a summariser), or a second choice of the same prompt (``n > 1``). Among several open segments a call
continues the one whose sequence is the longest prefix of its prompt. Segments are ordered by their first call;
nothing is re-tokenised: every id is one the engine was given or produced.
"""

from __future__ import annotations

from tether.agent.chat import TokenBuffer
from tether.programs.recording import Call


def stitch(calls: list[Call]) -> list[TokenBuffer]:
    """The segments of ``calls`` (in the order they finished), first call's segment first."""
    segments: list[TokenBuffer] = []
    for call in calls:
        prompt, out = call.prompt_ids, call.result
        best: TokenBuffer | None = None
        for seg in segments:
            n = len(seg)
            if n <= len(prompt) and (best is None or n > len(best)) and prompt[:n] == seg.ids:
                best = seg
        if best is None:
            best = TokenBuffer(list(prompt))
            segments.append(best)
        else:
            best.add_context_tokens(list(prompt[len(best):]))
        best.add_model_tokens(list(out.token_ids), list(out.logprobs), list(out.versions))
    return segments
