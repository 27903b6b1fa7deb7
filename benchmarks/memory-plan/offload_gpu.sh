#!/usr/bin/env bash
# --offload optimizer on one H200 (issue #57 item 7), one call, from the repo root with
# data/shakespeare_bytes carried (no network). Every run goes through benchmarks/speed/fit_gpu.py, which
# drives braidtrain's Trainer for a few steps and saves no checkpoint (an 8B checkpoint is 96 GB, the
# machine's disk 64 GB); it prints tokens/s, MFU, the GPU peak (torch's), the host peak (the
# process's max RSS), the host update's seconds a step (offload_update_s) and how much of it stayed exposed
# (offload_s: the main thread's waits for it in the next step's forward).
#   0. exact mode: a small llama with and without --offload optimizer, the same weights_sha256?
#   a. llama3.1-8b -t 2048 -d 65536 --offload optimizer --compile, -b 1, no --recompute
#   b. llama3.1-8b -t 2048 -d 262144, the same
#   c. llama3.2-3b -b 2 -t 2048 -d 4096 (one micro-step) --compile, with and without offload
# The no-offload llama3.1-8b row (ZeRO-0 -b 4 --recompute --compile, 9,172 tokens/s) is issue #57's,
# measured on the same machine; it is not run again here (device time).
# Usage: bash benchmarks/memory-plan/offload_gpu.sh [0 a b c]   SMOKE=1: the same on the CPU at tiny sizes
# Order: a, c, 0, b (each skipped, saying so, when too little of BUDGET is left)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
parts=" ${*:-0 a b c} "
OUT=${OUT:-/tmp/offload_gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/offload_gpu.log") 2>&1
WIDE=data/shakespeare_128k
if [ "${SMOKE:-0}" = 1 ]; then
  dev="--device cpu"; m3=llama3-tiny; m8=llama3-tiny; t=64; b8="-b 2"; d8a=512; d8b=1024; d3=128; c=""; fs="--steps 3 --warmup 1"
  WIDE=data/shakespeare_bytes
else
  dev=""; m3=llama3.2-3b; m8=llama3.1-8b; t=2048; b8="-b 1"; d8a=65536; d8b=262144; d3=4096; c="--compile"; fs="--steps 3 --warmup 1"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  free -g | head -2
fi
{ cat COMMIT 2>/dev/null || git log -1 --format='commit %h %s'; } 2>/dev/null; date -u  # (a carried copy: its COMMIT file)
if [ ! -f $WIDE/shakespeare_val_000000.bin ]; then  # Llama-3's 128,256 ids (as llama_gpu.sh builds them)
  python - <<'PY'
import numpy as np
from pathlib import Path
from braidtrain.io.data import LLAMA3_VOCAB, read_bin, write_bin
src, dst = Path("data/shakespeare_bytes"), Path("data/shakespeare_128k")
dst.mkdir(parents=True, exist_ok=True)
for split in ("train", "val"):
    b = np.concatenate([np.asarray(read_bin(f)) for f in sorted(src.glob(f"*_{split}_*.bin"))]).astype(np.int64)
    pairs = b[: len(b) // 2 * 2].reshape(-1, 2) @ np.array([256, 1])
    write_bin(dst / f"shakespeare_{split}_000000.bin", (pairs * (LLAMA3_VOCAB - 1) // 65535).astype(np.uint32), LLAMA3_VOCAB)
PY
fi
fit() { local name=$1; shift; echo "== $name: $*"; timeout 420 python benchmarks/speed/fit_gpu.py --json "$OUT/$name.json" "$@" || echo "($name failed: exit $?)"; }
# a part runs when the time left of BUDGET (seconds, default 480) covers what it needs (estimates for an H200)
BUDGET=${BUDGET:-480}
fits() { local left=$((BUDGET - SECONDS)); [ "$left" -ge "$1" ] && return 0; echo "(skipped: $left s left, it needs ~$1 s)"; return 1; }

[[ $parts == *" a "* ]] && fits 150 && fit a --model $m8 -i $WIDE $b8 -t $t -d $d8a --offload optimizer $c $dev $fs
if [[ $parts == *" c "* ]] && fits 120; then
  fit c-offload --model $m3 -i $WIDE -b 2 -t $t -d $d3 --offload optimizer $c $dev $fs
  fit c-device --model $m3 -i $WIDE -b 2 -t $t -d $d3 $c $dev $fs
fi
if [[ $parts == *" 0 "* ]] && fits 60; then
  echo "== 0. exact mode, with and without --offload optimizer (llama3-tiny widened, 8 steps)"
  for off in "" "--offload optimizer"; do
    o=$(mktemp -d); python -m braidtrain train --model llama3-tiny --n-layer 4 --n-embd 256 --n-head 4 --n-kv-heads 2 \
      -i data/shakespeare_bytes -b 4 -t 256 -d 4096 -x 8 --exact --val-every 0 --sample-tokens 0 --no-progress $dev $off \
      --out "$o" > "$o.log" 2>&1 || tail -3 "$o.log"
    python -c "import json; s = json.load(open('$o/summary.json')); print('exact ${off:-(device)}:', s['weights_sha256'])"
    rm -rf "$o" "$o.log"
  done
fi
[[ $parts == *" b "* ]] && fits 160 && fit b --model $m8 -i $WIDE $b8 -t $t -d $d8b --offload optimizer $c $dev --steps 2 --warmup 1
echo "done in $SECONDS s"
