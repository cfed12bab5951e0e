"""What the demo's warm start leaves for RL to find: the probability of the right refund reason code, per stated reason.

    python benchmarks/reason_codes.py [MODEL ...] [--split train] [--sample K] [--copy]

The imperfect expert (``tether/warmstart/imperfect_expert.py``) files a LATE or NOT_NEEDED refund as DAMAGED in a
share ``mistake_rate`` of its episodes, meaning to leave the right code in the SFT model's distribution for RL to
find. For each refund task whose user states the order and the reason, this prints, per stated reason, the mean (and
least) probability the model gives the right code at the first ``check_refund_policy`` call: each of the six calls
scored teacher-forced from its first differing token to its closing tag after the system prompt, the task's tools
and the user's first message, normalised over the six (temperature 1). MODEL: HF folders (default: the ``tiny-sft``
preset of the demo config).

``--sample K``: K episodes per LATE-reason task, sampled at the demo's ``engine.temperature`` through the real agent
loop: how often the policy calls LATE, and how often such an episode succeeds — RL's signal on that decision.

``--copy``: the other thing a warm start must get right, copying entities: over the mistake-free expert's held-out
demonstrations, the share of entity tokens (order ids, SKUs, amounts, stock levels) in the model's own turns that
its argmax gets right, teacher-forced, by class, with the mean p(right entity).

Measured (session 21, 32 RL steps of the demo config from each build, `tether train … --set model.path=BUILD`):
- the demo's preset then (digit-coded entities, mistakes sampled, train entity pool, build seed 0): LATE 0.65,
  NOT_NEEDED 0.18 (greedy: LATE right, NOT_NEEDED wrong); after RL, seeds 0 / 1: LATE 0.95 / 0.95, NOT_NEEDED
  0.61 / 0.92, held-out 84.4 / 81.2 %; 8 of the 10 held-out failures of seed 0 are an entity copied wrong (an id
  or an amount), none a reason code.
- random entity codes, build seed 2 (a scratch recipe, not shipped): LATE 0.07, NOT_NEEDED 0.47; after RL (seed 0)
  NOT_NEEDED 0.84-0.94 while LATE stays 0.04-0.07 — also with no KL penalty, at lr 1e-4, at temperature 1.0 or
  without task selection — and every held-out LATE task fails (at step 20: 8 of the 10 failures, success 84.4 %);
  sampled (8 per train LATE task): 16 LATE calls in 272 episodes, 12 of them successes.
So the same ``mistake_rate`` (0.6) leaves the right code anywhere from 0.07 to 0.65 depending on the build's seed,
and below ~0.1 RL does not find it in 32 steps. ``--copy``: 0.891 of 165 entity tokens for that preset, 0.945 for the
random-code build (amounts the weakest class in both: 20 and 19 of 26).
Session 22: the preset's recipe now stratifies the mistakes (1 right and 2 wrong replays of each task) and swaps
among every entity of the database: LATE / NOT_NEEDED 0.36 / 0.33 (build seed 0), and held-out copy 1.000 (build
seeds 0 and 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, get_args

import torch

from tether.env.customer_service.env import ReasonCode

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "customer_service" / "config.yaml"
CODES: tuple[str, ...] = get_args(ReasonCode)  # the six codes check_refund_policy takes


def code_probabilities(model: Any, tokenizer: Any, env: Any, task: Any) -> dict[str, float]:
    """p(code) of the first check_refund_policy call of ``task`` (a refund with the order stated), over ``CODES``."""
    from tether.agent.chat import render_ids

    schemas = [s for s in env.tool_schemas() if s["function"]["name"] in task.tools]
    opening = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": task.data["opening"]}]
    seqs = {}
    for code in CODES:
        call = {"id": "call_0", "type": "function", "function": {
            "name": "check_refund_policy", "arguments": {"order_id": task.data["order_id"], "reason_code": code}}}
        seqs[code] = render_ids(tokenizer, [*opening, {"role": "assistant", "content": "", "tool_calls": [call]}],
                                schemas, add_generation_prompt=False)
    first = seqs[CODES[0]]
    start = min(next(i for i, (a, b) in enumerate(zip(first, s)) if a != b) for s in list(seqs.values())[1:])
    close = tokenizer.convert_tokens_to_ids("</tool_call>")
    scores = []
    with torch.no_grad():
        for ids in seqs.values():
            end = ids.index(close, start)  # the call's own closing tag (the system prompt shows one too)
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids[:end]])).logits[0].float(), -1)
            scores.append(sum(logp[i - 1, ids[i]] for i in range(start, end)))
    return dict(zip(CODES, torch.softmax(torch.stack(scores), 0).tolist()))


def probe(model_dir: str, split: str) -> dict[str, list[float]]:
    """Per stated reason, p(the right code) of every refund task of ``split`` that states its order."""
    from tether.config import load_config
    from tether.env.customer_service import CustomerServiceEnv
    from tether.learner import load_model_and_tokenizer

    env = CustomerServiceEnv(load_config([DEMO], []))
    model, tokenizer = load_model_and_tokenizer(model_dir)
    out: dict[str, list[float]] = defaultdict(list)
    for task in env.tasks(split):
        if task.data.get("intent") == "refund" and task.data.get("order_stated"):
            reason = task.data["reason_code"]
            out[reason].append(code_probabilities(model, tokenizer, env, task)[reason])
    env.close()
    return dict(sorted(out.items()))


def copy_accuracy(model_dir: str) -> dict[str, tuple[int, int, float]]:
    """Per entity class: (argmax right, entity tokens, mean p(right)) over the model's turns of the mistake-free
    expert's held-out demonstrations, teacher-forced (a model built with one token per entity: tiny-sft)."""
    from tether.agent.loop import LoopLimits
    from tether.config import load_config
    from tether.env.customer_service import CustomerServiceEnv
    from tether.learner import load_model_and_tokenizer
    from tether.warmstart.demos import expert_demos
    from tether.warmstart.entities import EntityVocab, world_entities

    cfg = load_config([DEMO], [])
    model, tokenizer = load_model_and_tokenizer(model_dir)
    class_of = {i: c for c, ids in EntityVocab.build(world_entities(cfg), tokenizer).ids.items() for i in ids}
    env = CustomerServiceEnv(cfg)
    demos = expert_demos("customer_service_agent", lambda: CustomerServiceEnv(cfg), env.tasks("eval"), tokenizer,
                         limits=LoopLimits.from_config(cfg.agent_loop, cfg.environment.state.context_window),
                         parser=cfg.tool_parser.name)
    env.close()
    right: Counter = Counter()
    probs: dict[str, list[float]] = defaultdict(list)
    with torch.no_grad():
        for d in demos:
            logits = model(input_ids=torch.tensor([d.prompt_ids + d.response_ids])).logits[0].float()
            for j, (token, own) in enumerate(zip(d.response_ids, d.response_mask)):
                if own and token in class_of:
                    row = logits[len(d.prompt_ids) + j - 1]
                    right[class_of[token]] += int(row.argmax().item() == token)
                    probs[class_of[token]].append(torch.softmax(row, -1)[token].item())
    return {c: (right[c], len(ps), statistics.mean(ps)) for c, ps in sorted(probs.items())}


def sample_late(model_dir: str, k: int) -> Counter:
    """(code called, success) over ``k`` sampled episodes of every LATE-reason train task."""
    from tether.config import load_config
    from tether.pipeline.rollouter import Rollouter
    from tether.runtime import Runtime

    cfg = load_config([DEMO], ["model.preset=null", f"model.path={model_dir}"])
    rt = Runtime.build(cfg, model_dir)
    try:
        tasks = [t for t in rt.tasks("train") if t.data.get("reason_code") == "LATE"]
        rollouter = Rollouter(rt.loop(greedy=False), rt.make_env, max_concurrent=64, rewards=rt.rewards)
        groups = asyncio.run(rollouter.groups(tasks, k, cfg.trainer.seed, keep_failed=True))
    finally:
        rt.close()
    seen: Counter = Counter()
    for traj in (t for g in groups for t in g.trajectories):
        calls = [c["function"]["arguments"] for m in traj.messages for c in m.get("tool_calls") or []
                 if c["function"]["name"] == "check_refund_policy"]
        code = calls[0].get("reason_code") if calls and isinstance(calls[0], dict) else None
        seen[(code, traj.success)] += 1
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="HF model folders (default: the demo's tiny-sft preset)")
    ap.add_argument("--split", default="train", choices=["train", "eval"])
    ap.add_argument("--sample", type=int, default=0, metavar="K", help="K sampled episodes per LATE-reason task")
    ap.add_argument("--copy", action="store_true", help="also the entity copy accuracy on held-out demonstrations")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = args.models
    if not models:
        from tether.config import load_config
        from tether.runtime import model_path

        models = [model_path(load_config([DEMO], []))]
    for model_dir in models:
        print(model_dir)
        for reason, ps in probe(model_dir, args.split).items():
            print(f"  {reason:10s} {len(ps):3d} tasks: p(right code) mean {statistics.mean(ps):.3f}, "
                  f"least {min(ps):.3f}")
        if args.copy:
            acc = copy_accuracy(model_dir)
            total = sum(r for r, _, _ in acc.values()), sum(n for _, n, _ in acc.values())
            print(f"  entity tokens copied right: {total[0]}/{total[1]} = {total[0] / total[1]:.3f}; "
                  + ", ".join(f"{c} {r}/{n} (p {p:.2f})" for c, (r, n, p) in acc.items()))
        if args.sample:
            seen = sample_late(model_dir, args.sample)
            print("  sampled LATE tasks (code called, success): "
                  + json.dumps({f"{c} {'ok' if s else 'fail'}": n for (c, s), n in sorted(seen.items(), key=str)}))


if __name__ == "__main__":
    main()
