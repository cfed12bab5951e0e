"""DetachActorWorker's save to CPU memory and restore, alone: seconds and GB/s per model size.

For each model (random Qwen2-architecture weights built from a config): ``save(slot)`` (parameters → CPU
copies; the first save allocates them, later saves reuse them), ``restore(slot)`` (CPU copies → parameters,
in place), and ``offload`` / ``reload`` of weights + AdamW moments (the moments made by one real optimizer
step). Medians of ``--repeats``; on a GPU the CPU copies are pinned. One save + one restore per trainer step
is what π_prox across a sync window costs (tether/learner/detach.py).

    python benchmarks/detach_save_restore.py [--sizes tiny,small,qwen2-0.5b] [--repeats 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.learner.detach import DetachActorWorker  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048),  # the tiny preset's shape
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000),
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),
}


def measure(name: str, device: torch.device, repeats: int) -> dict[str, float]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES[name], tie_word_embeddings=True, max_position_embeddings=512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, SIZES[name]["vocab_size"], (1, 16), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    worker = DetachActorWorker(model, optimizer)
    first_save = worker.save("sync")
    saves = [worker.save("sync") for _ in range(repeats)]
    restores = [worker.restore("sync") for _ in range(repeats)]
    offloads, reloads = [], []
    for _ in range(repeats):
        offloads.append(worker.offload())
        reloads.append(worker.reload())
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"params_m": sum(p.numel() for p in model.parameters()) / 1e6, "gb": n_bytes / 1e9,
            "first_save_s": first_save, "save_s": statistics.median(saves), "restore_s": statistics.median(restores),
            "offload_s": statistics.median(offloads), "reload_s": statistics.median(reloads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,small", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"DetachActorWorker on {device} (torch {torch.__version__}, {torch.get_num_threads()} threads), "
          f"median of {args.repeats}")
    print(f"{'model':<12}{'params':>9}{'fp32 GB':>9}{'1st save':>10}{'save s':>9}{'restore s':>11}{'GB/s':>7}"
          f"{'offload s':>11}{'reload s':>10}")
    for name in args.sizes.split(","):
        r = measure(name.strip(), device, args.repeats)
        moves = (f"{r['offload_s']:>11.4f}{r['reload_s']:>10.4f}" if device.type != "cpu"
                 else f"{'n/a':>11}{'n/a':>10}")  # on a CPU the weights are already in CPU memory: nothing moves
        print(f"{name:<12}{r['params_m']:>8.1f}M{r['gb']:>9.3f}{r['first_save_s']:>10.4f}{r['save_s']:>9.4f}"
              f"{r['restore_s']:>11.4f}{r['gb'] / max(r['restore_s'], 1e-9):>7.1f}{moves}", flush=True)


if __name__ == "__main__":
    main()
