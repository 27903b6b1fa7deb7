#!/usr/bin/env bash
# One call on the GPU machine: the same `bench train` layouts through two versions of braidtrain,
# side by side -- OLD (a folder holding the braidtrain/ package of the commit before a change, e.g.
# `git archive COMMIT braidtrain | tar -x -C .old`) and this working tree -- for each round both
# (every other round in the other order, so that running first or last falls on each alike), then
# per layout each version's tokens/s over the rounds, their medians and the new/old ratio.
# Usage (repo root; data/shakespeare_gpt2 and OLD carried):
#   bash benchmarks/speed/before_after.sh OLD "1 2 3" [bench train args, e.g. --layout '-z 1 --compile']
# DATA: the training data, relative to the repo root or absolute (default data/shakespeare_gpt2); a
# Llama on Llama-3's 128,256 ids: DATA=data/shakespeare_128k (benchmarks/corpus/llama3_ids.py builds it
# offline) with --model llama3.2-1b -b 4 -t 2048 -d 8192 --layout '-z 0 --compile --cuda-graph'.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
unset PYTHONPATH  # each version imports its own braidtrain, from the folder it runs in
OLD=$(cd "$1" && pwd); ROUNDS=$2; shift 2
ROOT=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-data/shakespeare_gpt2}; [[ $DATA = /* ]] || DATA=$ROOT/$DATA
for r in $ROUNDS; do
  if (( r % 2 )); then order="old new"; else order="new old"; fi
  for v in $order; do
    dir=$ROOT; [ "$v" = old ] && dir=$OLD
    echo "== round $r: $v ($dir)"
    (cd "$dir" && python -m braidtrain bench train -i "$DATA" --torch "" --steps 12 --warmup 4 \
       --json "$OUT/$v-r$r.json" "$@" 2>&1 | grep -v "^\[")
  done
done
python - "$OUT" <<'EOF'
import glob, json, statistics, sys
runs = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/*-r*.json")):
    version = path.rsplit("/", 1)[1].split("-r")[0]
    for row in json.load(open(path)):
        runs.setdefault(row["variant"], {}).setdefault(version, []).append(row.get("tokens_per_s"))
print(f"{'layout':<44}{'old tokens/s (rounds)':>34}{'new tokens/s (rounds)':>34}{'new/old':>9}")
for variant, by in runs.items():
    old, new = ([x for x in by.get(k, []) if x] for k in ("old", "new"))
    fmt = lambda xs: " ".join(f"{x:,.0f}" for x in xs) or "-"
    ratio = statistics.median(new) / statistics.median(old) if old and new else float("nan")
    print(f"{variant:<44}{fmt(old):>34}{fmt(new):>34}{ratio:>9.3f}")
EOF
