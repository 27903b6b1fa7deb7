#!/bin/bash
# Live recovery (--live-recovery): one process per rank, each started by hand (-pi tcp), so that no
# launcher stops the others when one fails -- torchrun's agent would end them all. When a rank dies
# or freezes, the others go on in the same processes (docs/fault-tolerance.md, "Live recovery").
#   NPROC=4 scripts/live.sh [braidtrain train flags]          e.g. -i data/shakespeare_bytes --exact
# Rank 0 hosts the rendezvous store, so its loss is the one live recovery cannot survive: the others
# then exit 75 (the checkpoint restart path), and with RESTARTS=K this script starts the job again,
# up to K times, with --resume auto (from the newest checkpoint: give --ckpt-every).
# Several nodes: run it on each, with NPROC the ranks of all nodes, PER_NODE this node's count,
# FIRST this node's first rank and HOST rank 0's address (reachable from every node; PORT fixed).
# Under Slurm: srun --kill-on-bad-exit=0 ... python -m braidtrain train -pi tcp -ps HOST:PORT
# -pn $SLURM_NTASKS -pr $SLURM_PROCID --live-recovery (srun must not end the job when one task fails).
set -uo pipefail
NPROC=${NPROC:-4}
PER_NODE=${PER_NODE:-$NPROC}
FIRST=${FIRST:-0}
HOST=${HOST:-127.0.0.1}
PYTHON=${PYTHON:-python3}
PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
extra=()
for attempt in $(seq 0 "${RESTARTS:-0}"); do
  pids=()
  for ((r = FIRST; r < FIRST + PER_NODE; r++)); do
    "$PYTHON" -m braidtrain train "$@" "${extra[@]}" --live-recovery -pi tcp -ps "$HOST:$PORT" -pn "$NPROC" -pr "$r" &
    pids+=($!)
    echo "live.sh: rank $r: pid $!" >&2
  done
  rc=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    code=$?
    echo "live.sh: rank $((FIRST + i)) (pid ${pids[$i]}) exited $code" >&2
    if ((FIRST + i == 0)); then rc=$code; fi
  done
  # rank 0 lost (killed: 128 + signal) or the others' fallback (75): today's restart, from the checkpoint;
  # not a stop by SIGINT or SIGTERM (130, 143: the job saved its last step and stopped, as asked)
  if ((FIRST != 0 || (rc != 75 && rc < 128) || rc == 130 || rc == 143)); then exit "$rc"; fi
  extra=(--resume auto)
  unset BRAIDTRAIN_FAULT  # (the tests' fault hook fires on the first attempt only, as under torchrun)
done
exit "$rc"
