#!/bin/bash
# llm.c's mpirun shape (-pi mpi): mpirun starts every rank; MPI tells each its rank and world size,
# and rank 0 hands out the rendezvous address through MPI.
#   scripts/mpirun.sh [braidtrain train flags]        (needs mpi4py: pip install mpi4py)
# For a cluster change: NP to the number of GPUs in all, HOSTS to every node with its GPU count
# (node1:8,node2:8; leave it unset inside a Slurm/PBS allocation, which mpirun reads), MPIRUN_ARGS
# for your MPI (e.g. "-x PYTHONPATH -x NCCL_SOCKET_IFNAME=eth0"), and DATA / OUT / CONFIG (OUT on
# storage every node mounts). Every node needs braidtrain in $PYTHON at the same path.
# A SIGTERM or Ctrl-C to mpirun reaches the ranks after odls_base_sigkill_timeout seconds (Open MPI's
# default 1) and is followed by SIGKILL as long again: add "--mca odls_base_sigkill_timeout 12" to
# MPIRUN_ARGS for a stop to save its step (docs/fault-tolerance.md, "Preemption").
set -euo pipefail
read -ra extra <<< "${MPIRUN_ARGS:-}"
exec mpirun -np "${NP:-8}" ${HOSTS:+--host "$HOSTS"} "${extra[@]}" "${PYTHON:-python3}" -m braidtrain train \
    --config "${CONFIG:-gpt2}" -i "${DATA:-data/shakespeare_gpt2}" --out "${OUT:-runs/mpi-$(date +%Y%m%d-%H%M%S)}" \
    -pi mpi "$@"
