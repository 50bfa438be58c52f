#!/usr/bin/env bash
# Multi-node launch: run this on every machine with the same MAIN_ADDR / MAIN_PORT and its own MACHINE_RANK.
#
#   MAIN_ADDR=10.0.0.1 MACHINE_RANK=0 NUM_MACHINES=2 PROCS_PER_MACHINE=8 bash launch/multinode.sh [key=value ...]
#   MAIN_ADDR=10.0.0.1 MACHINE_RANK=1 NUM_MACHINES=2 PROCS_PER_MACHINE=8 bash launch/multinode.sh [key=value ...]
#
# ACCELERATE_CONFIG picks the stage (default accelerate_configs/multi_node.yaml, ZeRO-2). Every machine needs the
# same checkout and, for output_dir, a path it can write (rank 0 writes TensorBoard and summaries).
#
# MAX_RESTARTS=N (default 0) makes the job come back by itself, up to N times, when a rank or a machine's launcher
# dies: every machine's launcher then ends (its ranks lose their peers), this script starts it again after
# RESTART_DELAY seconds (default 5), the launchers meet again (c10d rendezvous at MAIN_ADDR:MAIN_PORT, held by
# machine 0; the node count is fixed under accelerate launch) and the workers resume from the newest complete
# checkpoint (checkpoint.resume=auto is added first, so a value given here wins). A machine that never comes back
# ends the job after the rendezvous's wait (join_timeout, 600 s) on each attempt: requeue it (launch/slurm.sbatch)
# on the machines there are; the checkpoint resumes on any number of processes.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MAIN_ADDR:?set MAIN_ADDR to the address of machine 0}"
: "${MACHINE_RANK:?set MACHINE_RANK to the index of this machine, 0 .. NUM_MACHINES-1}"
num_machines=${NUM_MACHINES:-2}
procs=${PROCS_PER_MACHINE:-1}
restarts=${MAX_RESTARTS:-0}
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
launch=("$python" -m accelerate.commands.launch
  --config_file "${ACCELERATE_CONFIG:-accelerate_configs/multi_node.yaml}"
  --num_machines "$num_machines" --num_processes $((num_machines * procs)) --machine_rank "$MACHINE_RANK"
  --main_process_ip "$MAIN_ADDR" --main_process_port "${MAIN_PORT:-29500}")
if [ "$restarts" -eq 0 ]; then
  exec "${launch[@]}" launch/train.py "$@"
fi
for ((attempt = 0; attempt <= restarts; attempt++)); do
  if [ "$attempt" -gt 0 ]; then
    echo "multinode.sh: the launcher on machine $MACHINE_RANK ended; starting it again in ${RESTART_DELAY:-5} s ($attempt of $restarts)" >&2
    sleep "${RESTART_DELAY:-5}"
  fi
  # a fresh launcher on every machine each time: torch's in-launcher restart (--max_restarts) did not meet again here
  # after a machine's launcher was killed (each side waited 60 s for the other's keys of the new round)
  if "${launch[@]}" --rdzv_backend c10d --rdzv_conf "is_host=$([ "$MACHINE_RANK" -eq 0 ] && echo 1 || echo 0)" \
      launch/train.py checkpoint.resume=auto "$@"; then
    exit 0
  fi
done
exit 1
