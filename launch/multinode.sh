#!/usr/bin/env bash
# Multi-node launch: run this on every machine with the same MAIN_ADDR / MAIN_PORT and its own MACHINE_RANK.
#
#   MAIN_ADDR=10.0.0.1 MACHINE_RANK=0 NUM_MACHINES=2 PROCS_PER_MACHINE=8 bash launch/multinode.sh [key=value ...]
#   MAIN_ADDR=10.0.0.1 MACHINE_RANK=1 NUM_MACHINES=2 PROCS_PER_MACHINE=8 bash launch/multinode.sh [key=value ...]
#
# ACCELERATE_CONFIG picks the stage (default accelerate_configs/multi_node.yaml, ZeRO-2). Every machine needs the
# same checkout and, for output_dir, a path it can write (rank 0 writes TensorBoard and summaries).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MAIN_ADDR:?set MAIN_ADDR to the address of machine 0}"
: "${MACHINE_RANK:?set MACHINE_RANK to the index of this machine, 0 .. NUM_MACHINES-1}"
num_machines=${NUM_MACHINES:-2}
procs=${PROCS_PER_MACHINE:-1}
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$python" -m accelerate.commands.launch \
  --config_file "${ACCELERATE_CONFIG:-accelerate_configs/multi_node.yaml}" \
  --num_machines "$num_machines" --num_processes $((num_machines * procs)) --machine_rank "$MACHINE_RANK" \
  --main_process_ip "$MAIN_ADDR" --main_process_port "${MAIN_PORT:-29500}" \
  launch/train.py "$@"
