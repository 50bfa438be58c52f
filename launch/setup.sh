#!/usr/bin/env bash
# Set-up on a fresh machine: creates .venv/ and installs grpo_accel with its test extras.
# Without a GPU, torch==2.13.0 (CPU wheel) is installed first so that nothing pulls CUDA libraries;
# with a GPU, pip's default (CUDA) torch is used. An existing torch in .venv is kept. Re-running is cheap: once
# it has succeeded, it does nothing until pyproject.toml, this script or the checkout's folder change.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
stamp=.venv/.grpo_accel-setup
want=$( (pwd; cat pyproject.toml launch/setup.sh) | sha256sum | cut -d' ' -f1)
installed() { .venv/bin/python -c "import importlib.metadata as m; m.version('grpo_accel')" 2>/dev/null; }
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && installed; then
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then "${pip[@]}" torch; else "${pip[@]}" torch==2.13.0; fi
fi
"${pip[@]}" -e ".[dev]"
echo "$want" > "$stamp"
