#!/usr/bin/env bash
# Whether a change keeps exact mode's bits on the GPU: the same 3-step exact gpt2 run on an older
# tree's braidtrain/ and on this one, each run's weights_sha256 printed.
#   git archive OLD braidtrain | tar -x -C build/old   # then, from the repo root on the GPU machine:
#   bash benchmarks/exact_bits_gpu.sh build/old         # (the device tool: carry data/shakespeare_gpt2 and build)
set -u
old=${1:?usage: exact_bits_gpu.sh OLD_TREE (a folder holding an older braidtrain/)}
out=${OUT:-out/exact_bits}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
root=$PWD
for tree in "$old" .; do
  name=$([ "$tree" = . ] && echo new || echo old)
  (cd "$tree" && PYTHONPATH=$PWD python -m braidtrain train --config gpt2 -i "$root/data/shakespeare_gpt2" -b 16 -t 1024 \
     -d 131072 -x 3 --compile --exact --val-every 0 --sample-tokens 0 --no-progress --out "$root/$out/$name" \
     > "$root/$out/$name.log" 2>&1)
  echo "$name rc=$? $(python -c "import json,sys; print(json.load(open(sys.argv[1]))['weights_sha256'])" "$out/$name/summary.json" 2>&1)"
done
