"""Demonstrations for a supervised warm start, as Trajectories with the agent loop's exact token layout.

Two sources:

- **an environment's scripted expert**, each train task played by the expert and replayed through the real
  ``tool_agent`` loop (``tether.agent.replay.demonstrate``), so SFT sees the tokens RL will generate;
- **a JSONL file of conversations**, one JSON object per line (blank lines are skipped)::

      {"messages": [
         {"role": "system", "content": "You are a customer service agent. ..."},          # optional
         {"role": "user", "content": "Is SKU-136 in stock?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function":
             {"name": "query_inventory", "arguments": "{\\"sku_id\\": \\"SKU-136\\"}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "{\\"sku_id\\": \\"SKU-136\\", \\"stock\\": 4}"},
         {"role": "assistant", "content": "SKU-136 has 4 in stock."},
         {"role": "user", "content": "Thanks, that solves it."}],
       "tools": [...]}                                                                   # optional

  OpenAI chat format: roles ``system`` (at most one, first), ``user``, ``assistant``, ``tool``; an
  assistant turn has ``content`` and/or ``tool_calls`` (``function.arguments`` a JSON object or a string
  holding one). As in the agent loop, an assistant's plain text is what it says to the user. Without a
  system message the environment's system prompt is used, and without ``tools`` the environment's tools,
  so the prompt is the one the agent sees at RL time. The first message after the system prompt must be
  the user's; messages after the last assistant turn are ignored (nothing there is trained on).

A conversation from a file is laid out as the agent loop lays out a rollout (``tether.agent.chat``): the
prompt rendered by the model's chat template, each assistant turn as the text the template gives it,
tokenised the way an engine's output is (``ScriptedEngine``: the text's ids, then end-of-turn), mask 1,
and the tool results and user replies in between as template suffixes, mask 0. Only the assistant text is
tokenised from text — which is what a model generating it would have produced; an expert conversation
written out as JSONL loads back to the very ids of its replay (a test).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from tether.agent.chat import ChatAssembler
from tether.agent.loop import LoopLimits
from tether.agent.replay import demonstrate
from tether.env.base import Action, Env, Observation
from tether.env.customer_service import ScriptedExpert
from tether.types import Task, Trajectory
from tether.warmstart.imperfect_expert import ImperfectExpert

ROLES = ("system", "user", "assistant", "tool")
_ANCHOR = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


class DemoError(ValueError):
    """A demonstration file that cannot be used; the message names the file and line."""


# -- experts ---------------------------------------------------------------------------------------------

def _customer_service_expert(mistake_rate: float, rng: random.Random) -> Callable[[Observation], Action]:
    return (ImperfectExpert(mistake_rate, rng) if mistake_rate > 0 else ScriptedExpert()).act


# environment.name -> expert(mistake_rate, rng) -> a fresh policy for one episode
EXPERTS: dict[str, Callable[[float, random.Random], Callable[[Observation], Action]]] = {
    "customer_service_agent": _customer_service_expert,
}


def expert_demos(env_name: str, make_env: Callable[[], Env], tasks: Sequence[Task], tokenizer: Any, *,
                 limits: LoopLimits, parser: str = "hermes", mistake_rate: float = 0.0, seed: int = 0,
                 max_tokens: int = 256) -> list[Trajectory]:
    """One demonstration per task by ``env_name``'s scripted expert, replayed through the agent loop.

    With ``mistake_rate`` > 0 the expert makes its systematic mistakes in that fraction of episodes (see
    ``imperfect_expert.py``), drawn from ``seed``."""
    try:
        expert = EXPERTS[env_name]
    except KeyError:
        raise ValueError(f"environment {env_name!r} has no scripted expert; known: {sorted(EXPERTS)}. "
                         f"Give demonstrations as a JSONL file instead (tether sft --demos FILE.jsonl)") from None
    rng = random.Random(seed)

    async def collect() -> list[Trajectory]:
        return await asyncio.gather(*(
            demonstrate(t, make_env, expert(mistake_rate, random.Random(rng.random())), tokenizer,
                        limits=limits, max_tokens=max_tokens, parser=parser) for t in tasks))

    return asyncio.run(collect())


# -- JSONL conversations ---------------------------------------------------------------------------------

def read_conversations(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, {"messages": [...], "tools": [...] | None}) for each conversation of a JSONL file,
    checked against the format in the module docstring; raises DemoError naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DemoError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DemoError(f"{path}: cannot read it ({e})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, _check_conversation(json.loads(line))))
        except json.JSONDecodeError as e:
            raise DemoError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        except ValueError as e:
            raise DemoError(f"{path}:{n}: {e}") from None
    if not out:
        raise DemoError(f"{path}: no conversations in it (one JSON object per line: {{\"messages\": [...]}})")
    return out


def _check_conversation(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise ValueError('expected a JSON object with a "messages" list')
    unknown = set(obj) - {"messages", "tools"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; allowed: messages, tools")
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError('"tools" must be a list of OpenAI tool schemas')
    messages = [_check_message(i, m) for i, m in enumerate(obj["messages"])]
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if not body or body[0]["role"] != "user":
        raise ValueError("the conversation must start with a user message (after an optional system message)")
    if any(m["role"] == "system" for m in body):
        raise ValueError("a system message may only come first")
    if not any(m["role"] == "assistant" for m in body):
        raise ValueError("no assistant message: nothing to learn from")
    return {"messages": messages, "tools": tools}


def _check_message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ValueError(f"{where}: expected an object with role one of {list(ROLES)}")
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError(f"{where}: content must be a string")
    msg: dict[str, Any] = {"role": m["role"], "content": content or ""}
    if m["role"] == "tool" and "tool_call_id" in m:
        msg["tool_call_id"] = m["tool_call_id"]
    calls = m.get("tool_calls")
    if calls:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise ValueError(f"{where}: tool_calls must be a list, on an assistant message")
        msg["tool_calls"] = [_check_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return msg


def _check_call(where: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f'{where}: expected {{"function": {{"name": ..., "arguments": ...}}}}')
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: arguments is not valid JSON") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}: arguments must be a JSON object")
    return {"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def assistant_ids(tokenizer: Any, message: dict[str, Any], end_of_turn_id: int) -> list[int]:
    """The ids an engine would have produced for ``message``: the text the chat template gives the
    assistant turn, tokenised, then the end-of-turn token."""
    head = tokenizer.apply_chat_template(_ANCHOR, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*_ANCHOR, message], add_generation_prompt=False, tokenize=False)
    eot = tokenizer.convert_ids_to_tokens(end_of_turn_id)
    if not full.startswith(head) or eot not in full[len(head):]:
        raise ValueError("the chat template does not render an assistant turn after its generation prompt, "
                         "ended by its end-of-turn token")
    body = full[len(head):]
    return tokenizer.encode(body[: body.rindex(eot)], add_special_tokens=False) + [end_of_turn_id]


def conversation_trajectory(messages: list[dict[str, Any]], tools: list[dict] | None, tokenizer: Any, *,
                            task_id: str = "demo") -> Trajectory:
    """A checked conversation (see ``read_conversations``) laid out as the agent loop lays out a rollout."""
    asm = ChatAssembler(tokenizer, tools)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    traj = Trajectory(task_id=task_id, prompt_ids=asm.prompt(messages[:first]), messages=list(messages[: last + 1]))
    i = first
    while i <= last:
        ids = assistant_ids(tokenizer, messages[i], asm.end_of_turn_id)
        traj.response_ids += ids
        traj.response_mask += [1] * len(ids)
        traj.logprobs += [0.0] * len(ids)
        traj.versions += [0] * len(ids)
        j = i + 1
        while j <= last and messages[j]["role"] != "assistant":
            j += 1
        if j <= last:  # what the environment said before the next assistant turn, then its generation prompt
            suffix = asm.suffix_after_assistant({"role": "assistant", "content": "a"}, messages[i + 1: j])
            traj.response_ids += suffix
            traj.response_mask += [0] * len(suffix)
            traj.logprobs += [0.0] * len(suffix)
            traj.versions += [-1] * len(suffix)
        traj.num_assistant_turns += 1
        i = j
    traj.check()
    return traj


def jsonl_demos(path: str | Path, tokenizer: Any, *, system_prompt: str | None = None,
                tools: list[dict] | None = None,
                conversations: list[tuple[int, dict[str, Any]]] | None = None) -> list[Trajectory]:
    """Trajectories of every conversation of a JSONL file. ``system_prompt`` and ``tools`` (the
    environment's) fill in what a conversation leaves out; ``conversations`` skips re-reading the file."""
    out = []
    for n, conv in conversations if conversations is not None else read_conversations(path):
        messages = conv["messages"]
        if messages[0]["role"] != "system" and system_prompt is not None:
            messages = [{"role": "system", "content": system_prompt}, *messages]
        try:
            out.append(conversation_trajectory(messages, conv["tools"] or tools, tokenizer, task_id=f"{path}:{n}"))
        except (ValueError, TypeError, KeyError, TemplateError) as e:  # the template failed on this line
            raise DemoError(f"{path}:{n}: cannot lay out the conversation with this model's chat template ({e})") from e
    return out
