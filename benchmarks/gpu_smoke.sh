#!/usr/bin/env bash
# GPU acceptance run (≤ 8 minutes on one GPU): a 0.5B-parameter Qwen2-architecture model built from its config
# (random weights, nothing downloaded or installed) in bf16: engine decode tokens/s at batch 1, 64 and 256 beside HF
# generate and the memory-bandwidth limit, prefill tokens/s, learner tokens/s and MFU beside a measured matmul, a few
# RL steps with their weight-sync time, peak memory. One markdown table on stdout (figures and how each is computed:
# benchmarks/gpu_smoke.py's docstring), progress with timestamps on stderr; exit 1 when a figure is missing or not
# finite, 2 without a GPU.
#
#   benchmarks/gpu_smoke.sh 2>&1 | tee gpu_smoke.log   one NVIDIA GPU (a CUDA build of torch in $PYTHON's environment)
#   benchmarks/gpu_smoke.sh --tiny          CPU, a 2-layer model, fp32 (CI runs this: tests/test_gpu_smoke.py)
#   benchmarks/gpu_smoke.sh --tiny --dtype bfloat16
#   benchmarks/gpu_smoke.sh --batches 1,64 --steps 2 --budget-s 300
#
# PYTHON overrides the interpreter (default: .venv/bin/python of this checkout, else python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python="python3"; fi
fi
tiny=0
for arg in "$@"; do [[ "$arg" == "--tiny" ]] && tiny=1; done
if [[ $tiny == 0 ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "gpu_smoke: no NVIDIA GPU found (nvidia-smi -L failed); on a CPU run: $0 --tiny" >&2
        exit 2
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # Every module the run imports, named at once (nothing is installed here: a machine without them fails now, not
    # half-way); with the versions the table's figures depend on.
    "$python" - <<'PY' || exit 2
import importlib.util, sys
need = ["torch", "transformers", "tokenizers", "safetensors", "pydantic", "yaml", "jinja2", "numpy", "httpx"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_smoke: {sys.executable} lacks {', '.join(missing)} (tether's dependencies; nothing is installed)")
import torch, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, available: "
      f"{torch.cuda.is_available()}), transformers {transformers.__version__}", flush=True)
PY
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
else
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
export TOKENIZERS_PARALLELISM=false
exec "$python" "$here/benchmarks/gpu_smoke.py" "$@"
