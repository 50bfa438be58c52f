#!/usr/bin/env bash
# GPU check (installs nothing; needs torch with CUDA, transformers, accelerate, tensordict): the benchmark on a
# ~0.5B-parameter built-in Llama in bf16, one process. Prints the phase table, MFU and tokens/s; < 5 minutes.
#   bash launch/gpu_check.sh [out.json]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
exec "$python" -m grpo_accel.bench --size 500m --dtype bfloat16 --steps 3 --warmup 1 --prompts 16 --group 8 \
  --max-new-tokens 128 --micro-batch 32 --fixed-length --out "${1:-gpu_bench.json}"
