#!/usr/bin/env bash
# One call on the GPU machine: gpt2 124M, a few steps in default mode at ZeRO 0, 1 and 3, and in
# exact mode; prints the last metrics line of each.
# Usage (from the repo root, data/shakespeare_gpt2 carried): bash benchmarks/gpu_smoke.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
common="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072 -x 12 --val-every 0 --sample-tokens 0 --no-progress"
for run in "default -z 0" "zero1 -z 1" "zero3 -z 3" "exact -z 0 --exact"; do
  set -- $run
  name=$1; shift
  python -m torch.distributed.run --standalone --nproc-per-node 1 -m braidtrain train $common "$@" --out $OUT/$name 2>&1 | grep -E "error|Error" | head -5
  echo "== $name: $(tail -n 1 $OUT/$name/metrics.jsonl)"
done
