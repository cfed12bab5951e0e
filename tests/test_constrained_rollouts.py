"""``agent_loop.constrained_tool_calls``: rollouts decoded under a grammar of free text or schema-valid tool calls.

The flip runs the configured agent loop (``Runtime.build`` → ``Runtime.loop``: the engine, tokenizer and tools a
training run uses) over 40 episodes of the customer-service environment with the untrained tiny model, with the key
off and on. The untrained model opens a ``<tool_call>`` now and then and writes noise after it; under the grammar
every call it opens names one of the episode's tools and carries a JSON object of arguments.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

import pytest

from tests.conftest import SMALL_RUN
from tether.config import ConfigError, load_config
from tether.runtime import Runtime

pytest.importorskip("xgrammar")

_CALL = re.compile(r'<tool_call>\n\{"name": ("[^"]*"), "arguments": \{')


def episodes(tiny_model, tmp_path, flag: bool) -> tuple[list, set[str]]:
    (tmp_path / "run.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "run.yaml"], [f"model.path={tiny_model}", "engine.max_tokens=256",
                                                "trainer.deterministic=true",
                                                f"agent_loop.constrained_tool_calls={str(flag).lower()}"])
    rt = Runtime.build(cfg)
    try:
        loop = rt.loop()
        tools = {s["function"]["name"] for s in rt.make_env().tool_schemas()}

        async def run() -> list:
            return [await loop.run(task, rt.make_env(), seed=i)
                    for i, task in enumerate(rt.tasks("train")[:20] * 2)]
        return asyncio.run(run()), tools
    finally:
        rt.close()


def opened_calls(trajs, tokenizer) -> tuple[int, int]:
    """(calls opened, calls opened as '<tool_call>\\n{"name": "<a tool>", "arguments": {') over the model's text."""
    texts = [tokenizer.decode([t for t, m in zip(tr.response_ids, tr.response_mask) if m], skip_special_tokens=False)
             for tr in trajs]
    opened = sum(text.count("<tool_call>") for text in texts)
    return opened, sum(1 for text in texts for m in _CALL.finditer(text))


def test_constrained_tool_calls_flip_what_the_rollouts_call(tiny_model, tmp_path):
    from tether.learner.model import load_model_and_tokenizer

    tokenizer = load_model_and_tokenizer(tiny_model)[1]
    free, tools = episodes(tiny_model, tmp_path, False)
    bound, _ = episodes(tiny_model, tmp_path, True)
    free_opened, free_named = opened_calls(free, tokenizer)
    bound_opened, bound_named = opened_calls(bound, tokenizer)
    texts = [tokenizer.decode(t.response_ids, skip_special_tokens=False) for t in bound]
    names = {json.loads(m.group(1)) for text in texts for m in _CALL.finditer(text)}
    parsed = [sum(t.num_tool_calls for t in trajs) for trajs in (free, bound)]
    print(f"opened / well-formed openings: free {free_opened} / {free_named}, constrained {bound_opened} / "
          f"{bound_named}; calls parsed {parsed[0]} vs {parsed[1]}")
    assert free_opened >= 5 and free_named == 0  # measured 10 / 0 and 0 calls parsed
    assert bound_opened >= 5 and bound_named == bound_opened and names <= tools  # measured 9 / 9, 2 calls parsed
    # the untrained model's argument strings run on: most constrained calls are cut by max_tokens, a few complete
    assert parsed[1] > parsed[0] == 0


@pytest.mark.parametrize("override, other", [("engine.type=remote", "engine.type"),
                                             ("tool_parser.name=pythonic", "tool_parser.name"),
                                             ("engine.min_tokens=2", "engine.min_tokens")])
def test_what_the_grammar_cannot_work_with_is_refused_naming_both_keys(override, other):
    with pytest.raises(ConfigError) as err:
        load_config([], ["agent_loop.constrained_tool_calls=true", override])
    assert "agent_loop.constrained_tool_calls" in str(err.value) and other in str(err.value)


def test_without_xgrammar_the_key_is_refused_when_the_loop_is_built(tiny_model, tmp_path, monkeypatch):
    (tmp_path / "run.yaml").write_text(SMALL_RUN)
    cfg = load_config([tmp_path / "run.yaml"], [f"model.path={tiny_model}", "agent_loop.constrained_tool_calls=true"])
    rt = Runtime.build(cfg)
    try:
        monkeypatch.setitem(sys.modules, "xgrammar", None)
        with pytest.raises(ConfigError, match=r"agent_loop.constrained_tool_calls.*tether\[grammar\]"):
            rt.loop()
    finally:
        rt.close()
