"""Weight-sync size and time through ``tether serve``: a LoRA adapter vs the full weights.

What a training run's ``WeightSync`` sends to an ``engine.type: remote`` server at every sync: with ``model.lora``
the adapter's A and B alone (``RemoteEngine.update_adapter`` → ``POST /update_lora_adapter_from_tensor``, merged into
the served weights by the server), else the whole state dict (``update_weights`` → ``/update_weights_from_tensor``).
Both through a real ``tether serve`` app (uvicorn in this process, loopback HTTP, a ``LocalEngine``), on two shapes
built from a config in code (random weights; nothing is downloaded):

- ``demo``: the demo's model's shape (the tiny-sft preset, ``Recipe().model``: 4 layers, hidden 128, MLP 384);
- ``wide``: the same with hidden size and MLP ×4 (512, 1536).

LoRA: rank 16, the default targets (q, k, v, o, gate, up, down), alpha 32. A sync is timed from the call to the
server's answer (serialisation, HTTP, the server's check, merge and load, the engine's swap at a step boundary); the
first push of each kind is a warm-up (the server keeps its copy of the base then) and the median of ``--repeats``
after it is printed. Sync bytes: the tensors' bytes (``perf/weight_sync_mb``) and the HTTP body's.

    python benchmarks/lora_sync.py [--repeats 5] [--rank 16] [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tether.config.sections import LoraConfig
from tether.engine.local import LocalEngine
from tether.engine.remote import RemoteEngine
from tether.learner import lora
from tether.learner.model import TINY_DEFAULTS, TINY_VOCAB_SIZE, cast_copy
from tether.learner.tiny import builtin_corpus, train_tokenizer
from tether.llm import LLMClient
from tether.serve import ServerThread, make_app
from tether.warmstart.tiny_sft import Recipe

DEMO = Recipe().model  # the demo's model: tiny-sft's shape
SHAPES = {"demo": DEMO, "wide": {**DEMO, "hidden_size": 4 * DEMO["hidden_size"],
                                 "intermediate_size": 4 * DEMO["intermediate_size"]}}
MiB = 1 << 20


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def timed(push, remote: RemoteEngine, repeats: int) -> float:
    """Median seconds of ``push(remote, version)`` over ``repeats`` calls after one warm-up."""
    push(remote, 1)
    times = []
    for v in range(2, repeats + 2):
        t = time.perf_counter()
        push(remote, v)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(shape: str, tokenizer, *, rank: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    config = Qwen2Config(**{**TINY_DEFAULTS, **SHAPES[shape]}, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    full = {k: v.detach().to(dtype, copy=True) for k, v in model.state_dict().items()}  # as the learner sends
    policy = lora.wrap(copy.deepcopy(model), LoraConfig(rank=rank))
    with torch.no_grad():  # a trained adapter: B away from its zero start (the bytes and the work are the same)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    adapter, scaling = lora.adapter_for_engine(policy, dtype), lora.scaling(policy)
    out: dict[str, float] = {"params": sum(p.numel() for p in model.parameters()),
                             "lora_bytes": nbytes(adapter), "full_bytes": nbytes(full)}
    pushes = {"lora": lambda remote, v: remote.update_adapter(adapter, scaling, v),
              "full": lambda remote, v: remote.update_weights(full, v)}
    for kind, push in pushes.items():  # a fresh server each: the adapter's merge does not see the full pushes
        engine = LocalEngine(cast_copy(model, dtype))
        app = make_app(engine, tokenizer, model_name="policy", weight_updates=True)
        with ServerThread(app) as server:
            remote = RemoteEngine(LLMClient(server.base_url + "/v1", model="policy", max_retries=0))
            out[f"{kind}_s"] = timed(push, remote, repeats)
            out[f"{kind}_body"] = remote.stats["weight_update_bytes"] / remote.stats["weight_updates"]
            assert remote.server_version() == repeats + 1
            remote.close()
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed pushes of each kind after a warm-up")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the engine's (model.dtype; the demo's is float32)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(builtin_corpus(), vocab_size=TINY_VOCAB_SIZE)
    rows = {shape: measure(shape, tokenizer, rank=args.rank, dtype=dtype, repeats=args.repeats) for shape in SHAPES}
    print(f"weight sync through tether serve (RemoteEngine → in-process server on loopback), {args.dtype}, LoRA rank "
          f"{args.rank} on q,k,v,o,gate,up,down; median of {args.repeats} pushes after a warm-up\n")
    print(f"{'shape':<6} {'params':>8} | {'LoRA MiB':>9} {'full MiB':>9} {'bytes ×':>8} | "
          f"{'LoRA s':>8} {'full s':>8} {'time ×':>7} | {'LoRA body':>10} {'full body':>10}")
    for shape, r in rows.items():
        print(f"{shape:<6} {r['params'] / 1e6:>7.1f}M | {r['lora_bytes'] / MiB:>9.2f} {r['full_bytes'] / MiB:>9.2f} "
              f"{r['full_bytes'] / r['lora_bytes']:>7.1f}× | {r['lora_s']:>8.4f} {r['full_s']:>8.4f} "
              f"{r['full_s'] / r['lora_s']:>6.1f}× | {r['lora_body'] / MiB:>9.2f}M {r['full_body'] / MiB:>9.2f}M")
    print(f"\nMiB: the tensors' bytes (perf/weight_sync_mb); body: the HTTP request's (safetensors, header included). "
          f"Wall {time.perf_counter() - t0:.0f} s.")
    print("full weights / LoRA per sync through tether serve: " + "; ".join(
        f"{shape} {r['full_bytes'] / r['lora_bytes']:.1f}x the bytes, {r['full_s'] / r['lora_s']:.1f}x the time "
        f"({1e3 * r['full_s']:.0f} vs {1e3 * r['lora_s']:.0f} ms)" for shape, r in rows.items()))


if __name__ == "__main__":
    main()
