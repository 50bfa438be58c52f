#!/usr/bin/env bash
# Checks that need a GPU; each prints its verdicts. Under 8 minutes each on one H100/H200 with a fast network.
#
#   bash launch/bench/gpu_check.sh bench [out.json]   # the benchmark on a ~0.5B built-in Llama in bf16 (no installs)
#   bash launch/bench/gpu_check.sh sglang             # real SGLang: install, serve SmolLM2-135M-Instruct, train, compare
#   bash launch/bench/gpu_check.sh gsm8k [out_dir]    # launch/configs/gsm8k.yaml for 30 batches (needs the hub, or
#                                               # MODEL=folder DATA=gsm8k-layout.jsonl; evaluation off)
#   bash launch/bench/gpu_check.sh shared             # the loss's forward+backward: padded vs shared prompts (4-D mask)
#   bash launch/bench/gpu_check.sh path [out_dir]     # issue 56's figures (launch/bench/gpu_path.py): generation (the
#                                               # embedded engine, generate, continuous batching), the training phase's
#                                               # MFU in bf16 + checkpointing, ZeRO-3's peak GPU memory; no installs
#                                               # beyond tensordict, deepspeed and google-crc32c (carry their wheels)
#
# sglang: makes .venv-sglang with sglang==${SGLANG_VERSION:-0.5.23} (it pins its own CUDA torch) and grpo_accel,
# converts SmolLM2-135M-Instruct (grpo-accel models), starts a server with
# --enable-deterministic-inference, runs a short GRPO job with rollout.backend=sglang, then
# launch/bench/check_sglang.py compares the server's release, weight version, weights (/get_weights_by_name: SmolLM2
# is a Llama) and greedy generations with the job's final weights. With 2+ GPUs the server gets GPU 1 and the
# weights go over NCCL (weight_sync.method=distributed); on one GPU NCCL cannot work (it needs one device per
# rank), so the same-node CUDA IPC path (method=tensor) runs instead and the NCCL verdict says SKIP. Then the
# colocated case: a server with --enable-memory-saver on GPU 0 beside the trainer, rollout.colocate=true.
# SGLANG_PYTHON=/path/to/python uses an existing SGLang install instead of making .venv-sglang.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-sglang}
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

if [ "$mode" = bench ]; then
  "$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
  exec "$python" launch/bench/bench.py --size 500m --dtype bfloat16 --steps 3 --warmup 1 --prompts 16 --group 8 \
    --max-new-tokens 128 --micro-batch 32 --fixed-length --out "${2:-gpu_bench.json}"
fi
if [ "$mode" = shared ]; then
  "$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
  exec "$python" launch/bench/shared_prompts_gpu.py
fi
if [ "$mode" = gsm8k ]; then
  "$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
  out=${2:-runs/gpu_check/gsm8k}
  "$python" -m accelerate.commands.launch --config_file accelerate_configs/single_process.yaml launch/train.py \
    --config launch/configs/gsm8k.yaml output_dir="$out" overwrite=true trainer.total_frames=3840 \
    eval.every_iterations=0 checkpoint.interval_frames=null trainer.progress_bar=false \
    ${MODEL:+model.name_or_path=$MODEL} ${DATA:+data.path=$DATA} ${DATA:+data.eval_split=null}
  exec "$python" -c "import json, sys; s = json.load(open(sys.argv[1])); print('PASS' if s['iterations'] == 30 else 'FAIL', \
    'gsm8k recipe:', s['iterations'], 'batches in', s['wall_time_s'], 's, reward', round(s['reward_first_mean'], 3), \
    '->', round(s['reward_last_mean'], 3))" "$out/summary.json"
fi
if [ "$mode" = path ]; then
  "$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
  out=${2:-runs/gpu_check/path}
  mkdir -p "$out"
  "$python" launch/bench/gpu_path.py generate --sizes 0.5b 1.5b
  "$python" launch/bench/gpu_path.py train --sizes 0.5b 1.5b
  for checkpointing in true false; do
    "$python" -m accelerate.commands.launch --config_file accelerate_configs/zero3.yaml --num_processes 1 \
      launch/bench/gpu_path.py memory --sizes 1.5b --folder "$out" --gradient-checkpointing "$checkpointing"
  done
  exit 0
fi
[ "$mode" = sglang ] || { echo "usage: bash launch/bench/gpu_check.sh bench|sglang|gsm8k|shared|path" >&2; exit 2; }

verdict() { printf '%-4s  %s\n' "$1" "$2"; }
gpus=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
[ "$gpus" -ge 1 ] || { verdict FAIL "no GPU (nvidia-smi lists none)"; exit 1; }
out=runs/gpu_check
mkdir -p "$out"
start=$SECONDS

sg=${SGLANG_PYTHON:-.venv-sglang/bin/python}
if [ -z "${SGLANG_PYTHON:-}" ] && [ ! -x "$sg" ]; then
  python3 -m venv .venv-sglang
  "$sg" -m pip install -q "sglang==${SGLANG_VERSION:-0.5.23}"
fi
"$sg" -m pip install -q -e . >/dev/null
verdict PASS "installed: $("$sg" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)') ($((SECONDS - start)) s)"

model=$out/smollm2-135m
[ -f "$model/config.json" ] || "$sg" -m grpo_accel.cli models smollm2-135m "$model"

port=${PORT:-30000}
if [ "$gpus" -ge 2 ]; then server_gpu=1; method=distributed; mem=0.8; else server_gpu=0; method=tensor; mem=0.4; fi
CUDA_VISIBLE_DEVICES=$server_gpu "$sg" -m sglang.launch_server --model-path "$model" --port "$port" \
  --enable-deterministic-inference --mem-fraction-static "$mem" >"$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { verdict FAIL "server did not start: tail $out/server.log"; exit 1; }
verdict PASS "server up on GPU $server_gpu ($((SECONDS - start)) s)"

run=$out/run_$method
rm -rf "$run"
CUDA_VISIBLE_DEVICES=0 "$sg" -m accelerate.commands.launch --config_file accelerate_configs/single_process.yaml \
  launch/train.py output_dir="$run" model.name_or_path="$model" rollout.backend=sglang \
  "rollout.urls=[http://127.0.0.1:$port]" weight_sync.method=$method weight_sync.backend=nccl \
  weight_sync.dtype=bfloat16 rollout.prompts_per_batch=8 rollout.group_size=4 rollout.max_new_tokens=32 \
  trainer.total_frames=96 trainer.micro_batch_completions=32 trainer.progress_bar=false \
  checkpoint.interval_frames=null >"$out/train_$method.log" 2>&1 \
  && verdict PASS "GRPO job with weight_sync.method=$method: $(grep -o '"iterations": [0-9]*' "$run/summary.json"), sync $(grep -o '"weight_sync_s": [0-9.]*' "$run/summary.json") s ($((SECONDS - start)) s)" \
  || { verdict FAIL "GRPO job with weight_sync.method=$method: tail $out/train_$method.log"; exit 1; }
[ "$method" = distributed ] || verdict SKIP "NCCL weight sync: one GPU (NCCL needs a device per rank); tensor path checked instead"
"$sg" launch/bench/check_sglang.py --url "http://127.0.0.1:$port" --run "$run"

# Colocated: a server with --enable-memory-saver on the trainer's own GPU (0), rollout.colocate=true: it frees its
# KV cache, weights and CUDA graphs while the trainer optimises; each push takes them back (CUDA IPC: same GPU).
kill $server 2>/dev/null; wait $server 2>/dev/null || true
CUDA_VISIBLE_DEVICES=0 "$sg" -m sglang.launch_server --model-path "$model" --port "$port" \
  --enable-deterministic-inference --enable-memory-saver --mem-fraction-static 0.3 >"$out/server_colocated.log" 2>&1 &
server=$!
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { verdict FAIL "colocated server did not start: tail $out/server_colocated.log"; exit 1; }
run=$out/run_colocated
rm -rf "$run"
CUDA_VISIBLE_DEVICES=0 "$sg" -m accelerate.commands.launch --config_file accelerate_configs/single_process.yaml \
  launch/train.py output_dir="$run" model.name_or_path="$model" rollout.backend=sglang rollout.colocate=true \
  "rollout.urls=[http://127.0.0.1:$port]" weight_sync.method=tensor weight_sync.dtype=bfloat16 \
  rollout.prompts_per_batch=8 rollout.group_size=4 rollout.max_new_tokens=32 trainer.total_frames=96 \
  trainer.micro_batch_completions=32 trainer.progress_bar=false checkpoint.interval_frames=null \
  >"$out/train_colocated.log" 2>&1 \
  && verdict PASS "colocated GRPO job (memory released and resumed around each push): $(grep -o '"iterations": [0-9]*' "$run/summary.json") ($((SECONDS - start)) s)" \
  || { verdict FAIL "colocated GRPO job: tail $out/train_colocated.log"; exit 1; }
"$sg" launch/bench/check_sglang.py --url "http://127.0.0.1:$port" --run "$run"
verdict PASS "done in $((SECONDS - start)) s"
