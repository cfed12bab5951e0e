"""``benchmarks/reason_codes.py``: p(reason code) at the first check_refund_policy call is the softmax, over the six
codes, of each call's log-likelihood from its first differing token to its closing tag — checked here against the
same quantity computed from the rendered text of each whole call, scored token by token."""

from __future__ import annotations

import importlib.util
import math

import torch

from conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("reason_codes", REPO / "benchmarks" / "reason_codes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_probabilities_score_each_calls_own_tokens(tiny_model):
    from tether.config import load_config
    from tether.env.customer_service import CustomerServiceEnv
    from tether.learner import load_model_and_tokenizer

    bench = _bench()
    env = CustomerServiceEnv(load_config([bench.DEMO], ["environment.num_train_tasks=16"]))
    model, tokenizer = load_model_and_tokenizer(tiny_model)
    task = next(t for t in env.tasks("train") if t.data.get("intent") == "refund" and t.data.get("order_stated"))
    probs = bench.code_probabilities(model, tokenizer, env, task)
    assert list(probs) == list(bench.CODES) and math.isclose(sum(probs.values()), 1.0, rel_tol=1e-5)

    # the same from text: the prompt (with the generation header) rendered once, each call's text after it
    prompt = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": task.data["opening"]}]
    schemas = [s for s in env.tool_schemas() if s["function"]["name"] in task.tools]
    head = tokenizer.apply_chat_template(prompt, tools=schemas, add_generation_prompt=True, tokenize=False)
    scores = []
    for code in bench.CODES:
        before = ('<tool_call>\n{"name": "check_refund_policy", "arguments": {"order_id": "'
                  f'{task.data["order_id"]}", "reason_code": "')
        ids = tokenizer(head + before + code + '"}}\n', add_special_tokens=False)["input_ids"]
        shared = len(tokenizer(head + before, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        scores.append(sum(logp[i - 1, ids[i]].item() for i in range(shared, len(ids))))
    expected = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0).tolist()
    assert all(math.isclose(probs[c], e, rel_tol=1e-3, abs_tol=1e-6) for c, e in zip(bench.CODES, expected)), \
        (probs, expected)
    env.close()
