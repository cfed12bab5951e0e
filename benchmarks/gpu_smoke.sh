#!/usr/bin/env bash
# GPU smoke test: FSDP2 + the local engine on a 0.5B-parameter Qwen2-architecture model built from its config
# (random weights, no download), a few RL steps; prints tokens/s, step time and weight-sync time.
#
#   benchmarks/gpu_smoke.sh                 one NVIDIA GPU (needs a CUDA build of torch in $PYTHON's environment)
#   benchmarks/gpu_smoke.sh --tiny          CPU, a 2-layer model (CI runs this: tests/test_gpu_smoke.py)
#   benchmarks/gpu_smoke.sh --steps 8 --prompts 16 --max-tokens 256
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
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
else
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
export TOKENIZERS_PARALLELISM=false
exec "$python" "$here/benchmarks/gpu_smoke.py" "$@"
