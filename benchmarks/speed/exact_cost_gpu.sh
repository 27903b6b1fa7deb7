#!/usr/bin/env bash
# Exact mode's cost on one H200 (issue #58 item 4) and its bits (#57 item 5), from the repo root with
# data/shakespeare_128k (Llama-3's ids; offload_gpu.sh says how it is built from shakespeare_bytes),
# data/shakespeare_bytes and data/shakespeare_gpt2 carried. Parts, in the order given:
#   k  the one-pass exact AdamW kernel (parallel/exact_kernels.py) bit for bit against optim.exact_adamw on
#      100M elements, on the GPU and on the host, and the three updates' times at 1.24 B
#      elements (benchmarks/kernels/exact_adamw_gpu.py); tests/test_exact_kernels.py's GPU test (~30 s)
#   n  the exact norm's one-pass chunk sums (exact_kernels.chunk_squares) bit for bit against
#      norm.chunk_squares on 100M elements, and their times at 1.24 B elements against the torch
#      kernels and the default norm (benchmarks/kernels/exact_norm_gpu.py); the GPU test (~30 s)
#   c  the cost: bench train llama3.2-1b -b 4 -t 2048 -d 16384, --compile against --compile --exact,
#      8 timed steps after 4 (no checkpoint written; ~150 s), and the exact/default step-time ratio
#   o  the bits against the code before the tree's first level was folded into the backward
#      (parallel/exact.py; OLD: a folder holding that commit's braidtrain/ package, e.g.
#      `git archive d35b270 braidtrain | tar -x -C .old`, carried): the same small exact runs through
#      both trees -- a small llama at 4 micro-steps, 5 (the last leaf with no sibling), 4 with
#      --compile; a small GPT (its head tied) at 4 and 3 -- and their weights_sha256, which must be
#      equal (~200 s)
#   a  with OLD: the exact step's time before and after the fold, llama3.2-1b as in c, two rounds
#      each tree (before_after.sh; ~300 s)
#   p  where the time goes: profile_step.py of the same step, default and --exact, eager
#   b  the bits, three checks run in the background while the parts above run (none of them is
#      timed): gpt2's exact weights_sha256 (--config gpt2 -b 16 -t 1024 -d 131072 -x 3 --exact
#      --compile); --exact with and without --offload optimizer (offload_gpu.sh's part 0: a small
#      llama, the update on the host against the kernel on the GPU); and that run with --cuda-graph
#      (the kernel captured and replayed) -- the same weights_sha256 as without
# Usage: [OLD=.old] OUT=/tmp/x bash benchmarks/speed/exact_cost_gpu.sh [b k n c p o a]
# (default: b k n c p, and o with OLD set; b starts first)
# BUDGET (seconds, default 100000): a part is skipped, saying so, when less is left than its estimate.
# Writes exact_cost_gpu.log, kernel.json, norm.json and bench.json to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/exact_cost}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/exact_cost_gpu.log") 2>&1
OLD=${OLD:-}
parts=" ${*:-b k n c p${OLD:+ o}} "
BUDGET=${BUDGET:-100000}
fits() { local left=$((BUDGET - SECONDS)); [ "$left" -ge "$1" ] && return 0; echo "(skipped: $left s left, it needs ~$1 s)"; return 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
{ cat COMMIT 2>/dev/null || git log -1 --format='commit %h %s'; } 2>/dev/null; date -u
q="--val-every 0 --sample-tokens 0 --no-progress"
hash() { python -c "import json; print('$1 weights_sha256', json.load(open('$2/summary.json'))['weights_sha256'])" \
  || echo "($1: no summary)"; }
small="--model llama3-tiny --n-layer 4 --n-embd 256 --n-head 4 --n-kv-heads 2 -i data/shakespeare_bytes -b 4 -t 256 -d 4096 -x 8 --exact $q"

if [[ $parts == *" b "* ]]; then
  ( python -m braidtrain train --config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072 -x 3 --exact --compile $q \
      --out /tmp/g_exact > /tmp/g_exact.log 2>&1; hash "gpt2 --exact --compile" /tmp/g_exact ) &
  ( OUT=/tmp/off0 BUDGET=300 bash benchmarks/memory-plan/offload_gpu.sh 0 > /tmp/offload0.log 2>&1; grep "^exact" /tmp/offload0.log ) &
  ( python -m braidtrain train $small --cuda-graph --out /tmp/s_graph > /tmp/s_graph.log 2>&1
    hash "small --exact --cuda-graph" /tmp/s_graph; grep -iE "error|Traceback" /tmp/s_graph.log | head -3 ) &
fi
if [[ $parts == *" k "* ]] && fits 30; then
  echo "== k. the kernel against exact_adamw ($SECONDS s)"
  python benchmarks/kernels/exact_adamw_gpu.py --json "$OUT/kernel.json"
  python -m pytest -q -p no:cacheprovider tests/test_exact_kernels.py -k gpu 2>&1 | tail -2  # the test, compiled
fi
if [[ $parts == *" n "* ]] && fits 30; then
  echo "== n. the exact norm's chunk sums against norm.chunk_squares ($SECONDS s)"
  python benchmarks/kernels/exact_norm_gpu.py --json "$OUT/norm.json"
  python -m pytest -q -p no:cacheprovider tests/test_exact_kernels.py -k gpu 2>&1 | tail -2  # both kernels, compiled
fi
if [[ $parts == *" c "* ]] && fits 150; then
  echo "== c. llama3.2-1b, --compile against --compile --exact ($SECONDS s)"
  python -m braidtrain bench train --model llama3.2-1b -i data/shakespeare_128k -b 4 -t 2048 -d 16384 --steps 12 --warmup 4 \
    --nproc 1 --torch '' --loss-tol 0.05 --layout='--compile --no-save' --layout='--compile --exact --no-save' \
    --json "$OUT/bench.json" 2>&1 | grep -vE "^\[|Warning|warn"
  python - "$OUT/bench.json" <<'EOF'
import json, sys
tps = {r["variant"]: r.get("tokens_per_s") for r in json.load(open(sys.argv[1]))}
dv = next(v for k, v in tps.items() if "--exact" not in k)
xv = next(v for k, v in tps.items() if "--exact" in k)
print(f"exact/default step time: {dv / xv:.4f}x ({xv:,.0f} against {dv:,.0f} tokens/s)" if dv and xv else f"(failed: {tps})")
EOF
fi
if [[ $parts == *" o "* ]] && fits 200; then
  echo "== o. the exact bits against the tree before the fold, OLD=$OLD ($SECONDS s)"
  if [ -z "$OLD" ] || [ ! -d "$OLD/braidtrain" ]; then
    echo "(skipped: OLD=$OLD holds no braidtrain/: git archive d35b270 braidtrain | tar -x -C .old)"
  else
    old=$(cd "$OLD" && pwd); root=$(pwd)
    common="-i $root/data/shakespeare_bytes -b 4 -t 256 -x 8 --exact $q"
    llama="--model llama3-tiny --n-layer 4 --n-embd 256 --n-head 4 --n-kv-heads 2 $common"
    gpt="--model tiny --n-layer 4 --n-embd 256 --n-head 4 $common"  # GPT-2's shape: the head tied (tied.py's tree)
    cases=("llama-m4:$llama -d 4096" "llama-m5:$llama -d 5120" "llama-m4-compile:$llama -d 4096 --compile"
           "gpt-m4:$gpt -d 4096" "gpt-m3:$gpt -d 3072")
    for v in new old; do
      dir=$root; [ $v = old ] && dir=$old
      (cd "$dir" && PYTHONPATH= python -c "import braidtrain; print('$v:', braidtrain.__file__)")
      for c in "${cases[@]}"; do
        (cd "$dir" && PYTHONPATH= python -m braidtrain train ${c#*:} --out /tmp/o_${v}_${c%%:*} > /tmp/o_${v}_${c%%:*}.log 2>&1) \
          || tail -3 /tmp/o_${v}_${c%%:*}.log
      done
    done
    for c in "${cases[@]}"; do
      c=${c%%:*}
      python - /tmp/o_new_$c /tmp/o_old_$c $c <<'EOF'
import json, os, sys
sha = [json.load(open(f"{d}/summary.json"))["weights_sha256"] if os.path.exists(f"{d}/summary.json") else None
       for d in sys.argv[1:3]]
print(f"{sys.argv[3]}: new {sha[0]}  old {sha[1]}  ->", "SAME" if sha[0] and sha[0] == sha[1] else "DIFFER")
EOF
    done
  fi
fi
if [[ $parts == *" a "* ]] && [ -z "$OLD" ]; then
  echo "(a skipped: no OLD)"
elif [[ $parts == *" a "* ]] && fits 300; then
  echo "== a. the exact step before and after the fold, llama3.2-1b, OLD=$OLD ($SECONDS s)"
  OUT="$OUT/before_after" bash benchmarks/speed/before_after.sh "$OLD" "1 2" --model llama3.2-1b \
    -i "$(pwd)/data/shakespeare_128k" -b 4 -t 2048 -d 16384 --nproc 1 --loss-tol 0.05 \
    --layout='--compile --exact --no-save' 2>&1 | grep -vE "Warning|warn"
fi
if [[ $parts == *" p "* ]] && fits 80; then
  for mode in "" "--exact"; do
    echo "== p. profile_step.py llama3.2-1b ${mode:-default}, eager ($SECONDS s)"
    python benchmarks/profile/profile_step.py --model llama3.2-1b -i data/shakespeare_128k -b 4 -t 2048 -d 16384 $mode \
      2>&1 | grep -vE "^\[|Warning|warn"
  done
fi
# part b's checks; a bare `wait` would also wait for the log's tee (bash 5.1+ counts a process
# substitution), which ends only when this script does: the call that ran `n c` hung here to its limit
pids=$(jobs -p)
[ -n "$pids" ] && wait $pids
echo "done in $SECONDS s"
