#!/usr/bin/env bash
# One call on the GPU machine: `braidtrain bench train` for gpt2 124M (-b 16 -t 1024, 8 micro-steps
# a rank) on every local GPU -- braidtrain's default layouts against torch DDP (eager, compiled) and
# FSDP2 -- then the table. Extra arguments go to bench train (e.g. --layout '-z 1 --compile').
# Usage (repo root, data/shakespeare_gpt2 carried): bash benchmarks/speed/bench_train_gpu.sh [ARGS]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python -m braidtrain bench train -i data/shakespeare_gpt2 --steps 12 --warmup 4 --json "$OUT/bench_train.json" "$@"
