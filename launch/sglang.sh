#!/usr/bin/env bash
# Rollouts from SGLang servers on some GPUs of this machine, training on the others.
#
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct SERVER_GPUS="0 1" TRAIN_GPUS=2,3,4,5,6,7 bash launch/sglang.sh data.path=train.jsonl
#
# One SGLang server per GPU in SERVER_GPUS (ports BASE_PORT, BASE_PORT+1, ...); the trainer runs with
# ACCELERATE_CONFIG (default ZeRO-3) on TRAIN_GPUS and pushes weights to every server over NCCL after each batch.
# SERVER_FLAGS go to every server (default --enable-deterministic-inference, without which SGLang ignores the
# trainer's sampling_seed and rollouts are not reproducible; SERVER_FLAGS="" trades that for speed).
# Servers on other machines: skip this script and pass rollout.urls=[http://host:port,...] and
# weight_sync.master_address=<an address of training rank 0 that the servers reach> to launch/train.py.
# DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MODEL:?set MODEL to a Hugging Face model id or folder}"
server_gpus=(${SERVER_GPUS:-0})
train_gpus=${TRAIN_GPUS:-1}
base_port=${BASE_PORT:-30000}
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
address=${MASTER_ADDRESS:-127.0.0.1}
server_flags=(${SERVER_FLAGS---enable-deterministic-inference})
run() { if [ -n "${DRY_RUN:-}" ]; then echo "$*"; else "$@"; fi; }

urls=()
pids=()
for i in "${!server_gpus[@]}"; do
  port=$((base_port + i))
  urls+=("http://127.0.0.1:$port")
  if [ -n "${DRY_RUN:-}" ]; then
    echo "CUDA_VISIBLE_DEVICES=${server_gpus[$i]} $python -m sglang.launch_server --model-path $MODEL ${server_flags[*]} --port $port"
  else
    CUDA_VISIBLE_DEVICES=${server_gpus[$i]} "$python" -m sglang.launch_server --model-path "$MODEL" "${server_flags[@]}" --port "$port" &
    pids+=($!)
  fi
done
[ ${#pids[@]} -eq 0 ] || trap 'kill "${pids[@]}" 2>/dev/null' EXIT
url_list=$(IFS=,; echo "${urls[*]}")
num_train=$(awk -F, '{print NF}' <<<"$train_gpus")
CUDA_VISIBLE_DEVICES=$train_gpus run "$python" -m accelerate.commands.launch \
  --config_file "${ACCELERATE_CONFIG:-accelerate_configs/zero3.yaml}" --num_processes "$num_train" \
  launch/train.py model.name_or_path="$MODEL" rollout.backend=sglang "rollout.urls=[$url_list]" \
  weight_sync.method=distributed weight_sync.master_address="$address" "$@"
