"""The tiny model runs the full agent loop on 64 tasks at once; the trajectory's tokens, mask and
behaviour logprobs are checked against a teacher-forced forward pass of the same model."""

import asyncio
import itertools

import pytest
import torch

from tether.agent.loop import LoopLimits, make_agent_loop
from tether.algo import logprobs_from_logits
from tether.config import EnvironmentConfig
from tether.engine.base import SamplingParams
from tether.engine.local import LocalEngine
from tether.env.customer_service import CustomerServiceEnv, example_texts, tasks
from tether.learner.model import build_tiny, load_model_and_tokenizer
from tether.pipeline.rollouter import Rollouter

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), corpus=example_texts(200), num_hidden_layers=2,
                      hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    model, tok = load_model_and_tokenizer(path)
    engine = LocalEngine(model, version=7)
    loop = make_agent_loop("tool_agent", engine=engine, tokenizer=tok,
                           sampling=SamplingParams(temperature=TEMPERATURE, max_tokens=24),
                           limits=LoopLimits(max_user_turns=3, max_assistant_turns=4, max_parallel_calls=2))
    rollouter = Rollouter(loop, lambda: CustomerServiceEnv(EnvironmentConfig()), max_concurrent=64)
    try:
        groups = asyncio.run(rollouter.groups(tasks("train")[:16], group_size=4, seed=1))
    finally:
        engine.close()
    return model, tok, [t for g in groups for t in g.trajectories]


def test_64_concurrent_rollouts_finish_with_consistent_arrays(rollouts):
    _, tok, trajs = rollouts
    assert len(trajs) == 64
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for tr in trajs:
        tr.check()
        assert tr.num_assistant_turns >= 1 and tr.termination
        assert sum(tr.response_mask) > 0
        # policy versions and logprobs only on model tokens
        assert {v for v, m in zip(tr.versions, tr.response_mask) if m} == {7}
        assert all(lp == 0.0 and v == -1 for lp, v, m in zip(tr.logprobs, tr.versions, tr.response_mask) if not m)
        # every model segment ends with <|im_end|> (stop) or is closed by a mask-0 <|im_end|> (cut by max_tokens)
        runs = [(m, [t for t, _ in grp]) for m, grp in itertools.groupby(zip(tr.response_ids, tr.response_mask),
                                                                        key=lambda x: x[1])]
        for i, (m, ids) in enumerate(runs):
            if m == 1:
                nxt = runs[i + 1][1] if i + 1 < len(runs) else None
                assert ids[-1] == im_end or (nxt is not None and nxt[0] == im_end) or i == len(runs) - 1
            else:
                text = tok.decode(ids)
                assert text.startswith(("\n<|im_start|>user\n", "<|im_end|>")), text[:60]
                assert text.endswith("<|im_start|>assistant\n") or i == len(runs) - 1, text[-60:]
    # different seeds within a group explore differently
    assert len({tuple(t.response_ids) for t in trajs}) > 32


def test_behaviour_logprobs_match_a_forward_pass(rollouts):
    model, _, trajs = rollouts
    worst = 0.0
    with torch.inference_mode():
        for tr in trajs:
            ids = torch.tensor([tr.prompt_ids + tr.response_ids])
            logits = model(input_ids=ids).logits[:, :-1]
            logp = logprobs_from_logits(logits, ids[:, 1:], TEMPERATURE)[0, len(tr.prompt_ids) - 1:]
            mask = torch.tensor(tr.response_mask, dtype=torch.bool)
            diff = (logp[mask] - torch.tensor(tr.logprobs)[mask]).abs().max().item()
            worst = max(worst, diff)
    print(f"max |engine logprob - forward logprob| over 64 trajectories: {worst:.2e}")
    assert worst < 1e-4
