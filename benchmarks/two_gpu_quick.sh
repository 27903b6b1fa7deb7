#!/usr/bin/env bash
# One short call on the two-GPU machine (nvidia-h200-x2): exact mode on 1 and on 2 H200s (same
# losses, same weights_sha256?), then bench train on both GPUs: ZeRO-0/1 --compile against torch
# DDP + compile. Usage (repo root, data/shakespeare_gpt2 carried): bash benchmarks/two_gpu_quick.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
common="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 32768 -x 4 --val-every 0 --sample-tokens 0 --no-progress --exact --compile"
timeout 100 python -m torch.distributed.run --standalone --nproc-per-node 2 -m braidtrain train $common --out /tmp/e2 > "$OUT/e2.log" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 60 python -m braidtrain train $common --out /tmp/e1 > "$OUT/e1.log" 2>&1
for r in e1 e2; do
  echo "$r losses: $(python -c "import json; print([json.loads(l)['loss'] for l in open('/tmp/$r/metrics.jsonl')])" 2>&1)"
  echo "$r sha: $(python -c "import json; print(json.load(open('/tmp/$r/summary.json'))['weights_sha256'])" 2>&1)"
done
timeout 170 python -m braidtrain bench train -i data/shakespeare_gpt2 --nproc 2 --steps 8 --warmup 3 --torch ddp-compile \
  --layout "-z 1 --compile" --layout "-z 0 --compile" --json "$OUT/bench2.json"
