#!/usr/bin/env bash
# One call on the GPU machine: gpt2 124M, a few steps each in default, ZeRO-1 and exact mode.
# Usage (from the repo root, data/shakespeare_gpt2 carried): bash benchmarks/gpu_smoke.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
common="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072 -x 12 --val-every 0 --sample-tokens 0 --no-progress"
python -m braidtrain train $common --out $OUT/default 2>&1 | tail -3
python -m braidtrain train $common --exact --out $OUT/exact 2>&1 | tail -3
for r in default exact; do echo "== $r"; tail -n 2 $OUT/$r/metrics.jsonl; done
