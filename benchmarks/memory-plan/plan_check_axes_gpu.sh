#!/usr/bin/env bash
# Issue #22 on one GPU: plan --check (estimated against measured peak memory, two training steps)
# for a layout with recompute and for a mixture of experts (with and without recompute), then
# `train --layout auto` for two steps (the layout it takes, printed).
# Usage (repo root, data/shakespeare_gpt2 carried): bash benchmarks/memory-plan/plan_check_axes_gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1
MOE="--moe-experts 8 --moe-top-k 2"
while read -r name b flags; do
  [ -z "$name" ] && continue
  echo "== $name"
  python -m braidtrain plan --model gpt2 $flags --gpus 1 --gpu-mem 141 -t 1024 -d $((b * 1024)) -b "$b" \
      --data data/shakespeare_gpt2 --json > "$OUT/check_$name.json" 2> "$OUT/err_$name.txt"
  python - "$OUT/check_$name.json" <<'PY' || tail -3 "$OUT/err_$name.txt"
import json, sys
r = json.load(open(sys.argv[1]))
e = r["estimate"]
print(f"estimated {r['estimated_gb']:.3f} GB, measured {r['measured_gb']:.3f} GB, error {100 * r['rel_error']:+.1f}%")
print("  terms:", {k: round(v, 3) for k, v in e["mem_gb"].items()}, {k: round(v, 3) for k, v in e["activations_gb"].items()})
PY
done <<LIST
gpt2-recompute 16 -z 0 --recompute --check
gpt2-moe 8 -z 0 --no-recompute $MOE --check
gpt2-moe-recompute 8 -z 0 --recompute $MOE --check
LIST
echo "== train --layout auto (gpt2, -d 65536, 2 steps)"
python -m braidtrain train --config gpt2 --layout auto -d 65536 -x 2 --val-every 0 --sample-tokens 0 --no-progress \
    --out "$OUT/auto" 2>&1 | grep -E "layout auto|parameters|error" | head -5
