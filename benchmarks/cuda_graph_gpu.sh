#!/usr/bin/env bash
# One call on the GPU machine: --cuda-graph checked, then measured.
# 1. Exact mode with and without the graph (gpt2, 2 micro-steps, 6 steps: the capture at step 3,
#    then replays) must log the same losses and end with the same weights_sha256; --recompute
#    with the graph must train too.
# 2. bench train: the graph against the eager-launched step, default and exact, and torch
#    DDP + compile. Extra arguments go to bench train.
# Usage (repo root, data/shakespeare_gpt2 carried): bash benchmarks/cuda_graph_gpu.sh check|bench [ARGS]
# (two calls: each part takes most of a device call's ten minutes)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
part=${1:-check}; shift
if [ "$part" = check ]; then
common="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 32768 -x 6 --val-every 0 --sample-tokens 0 --no-progress"
run() {  # name, flags...
  local name=$1; shift
  python -m braidtrain train $common "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1 || { echo "== $name FAILED"; tail -20 "$OUT/$name.log"; }
}
run exact --compile --exact
run exact_graph --compile --exact --cuda-graph
run recompute_graph --compile --recompute --cuda-graph
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def read(name):
    try:
        steps = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
        return [r["loss"] for r in steps], json.load(open(f"{out}/{name}/summary.json"))["weights_sha256"]
    except OSError as e:
        return None, str(e)
(a, sa), (b, sb), (c, _) = read("exact"), read("exact_graph"), read("recompute_graph")
print("exact losses      ", a)
print("exact+graph losses", b)
print("recompute+graph   ", c)
print("exact: graph and eager bitwise equal:", a == b and sa == sb, sa[:12], sb[:12])
PY
else
python -m braidtrain bench train -i data/shakespeare_gpt2 --steps 12 --warmup 4 --json "$OUT/bench_train.json" \
  --torch ddp-compile --layout "-z 0 --compile" --layout "-z 0 --compile --cuda-graph" \
  --layout "-z 0 --compile --exact" --layout "-z 0 --compile --exact --cuda-graph" "$@"
fi
