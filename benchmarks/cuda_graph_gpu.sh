#!/usr/bin/env bash
# One call on the GPU machine: --cuda-graph changes no bits. Exact mode with and without the graph
# (gpt2, 2 micro-steps, 6 steps: the capture at step 3, then replays; validation and a checkpoint
# every 2 steps, around the capture) must log the same losses and end with the same
# weights_sha256, at ZeRO 0 and 1; --recompute with the graph must train too.
# (Its speed: bash benchmarks/bench_train_gpu.sh, whose default layouts include the graph; two GPUs: two_gpu.sh graph.)
# Usage (repo root, data/shakespeare_gpt2 carried): bash benchmarks/cuda_graph_gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
common="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 32768 -x 6 --val-every 2 --val-steps 2 --ckpt-every 2 --sample-tokens 0 --no-progress"
run() {  # name, flags...
  local name=$1; shift
  python -m braidtrain train $common "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1 || { echo "== $name FAILED"; tail -20 "$OUT/$name.log"; }
}
run exact --compile --exact
run exact_graph --compile --exact --cuda-graph
run exact_graph_z1 --compile --exact --cuda-graph -z 1
run recompute_graph --compile --recompute --cuda-graph
rm -rf "$OUT"/*/checkpoints
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def read(name):
    try:
        steps = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
        return [(r["loss"], r.get("val_loss")) for r in steps], json.load(open(f"{out}/{name}/summary.json"))["weights_sha256"]
    except OSError as e:
        return None, str(e)
ref = read("exact")
print("exact (eager)     ", ref)
for name in ("exact_graph", "exact_graph_z1"):
    got = read(name)
    print(f"{name:<18}", got)
    print(f"{name}: bitwise equal to eager:", got == ref)
print("recompute_graph   ", read("recompute_graph"))
PY
