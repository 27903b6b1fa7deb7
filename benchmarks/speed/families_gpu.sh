#!/usr/bin/env bash
# One call on one GPU for issues #39 and #40 (from the repo root, data/shakespeare_gpt2 and
# data/shakespeare_bytes carried):
#   1. GPT-2's exact bits on this GPU: --config gpt2 -b 16 -t 1024 -d 131072 -x 3 --exact --compile
#      (on an H200 with torch 2.11: 6c5770d7f6b0b497... from before the model protocol to 2026-12-02;
#      f58d1ce944463aba... since exact mode's update became optim.exact_adamw, 2026-12-03)
#   2. a run directory belongs to one run: a second run into a working run's directory, and then
#      into the finished run's, each stop in one line (exit 2); --start-over moves it aside and trains
#   3. Llama-3 on one GPU (llama3.2-1b's shape on the byte corpus): eager, --compile, --cuda-graph,
#      --recompute and --exact a few steps each, and plan --check of it (estimated against peak memory)
# Usage: bash benchmarks/speed/families_gpu.sh [1|2|3 ...]   (default: all three)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
parts=${*:-1 2 3}
q="--val-every 0 --sample-tokens 0 --no-progress"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
last() { python -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1] + '/metrics.jsonl')][-1]; \
print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('step', 'loss', 'tokens_per_s', 'mfu', 'mem_gb', 'host_s', 'step_s')})" "$1"; }

if [[ " $parts " == *" 1 "* ]]; then
  echo "== 1. gpt2 --exact --compile, 3 steps"
  python -m braidtrain train --config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072 -x 3 --exact --compile $q \
    --out /tmp/g_exact 2>&1 | grep -iE "error" | head -5
  python -c "import json; print('gpt2 exact weights_sha256', json.load(open('/tmp/g_exact/summary.json'))['weights_sha256'])"
fi

if [[ " $parts " == *" 2 "* ]]; then
  echo "== 2. one run a directory"
  R=/tmp/rdir
  g="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 16384 $q --out $R"
  python -m braidtrain train $g -x 30 --ckpt-every 2 > /tmp/first.log 2>&1 &
  first=$!
  for _ in $(seq 120); do [ -s $R/metrics.jsonl ] && break; sleep 1; done
  python -m braidtrain train $g -x 30 --ckpt-every 2 --resume auto; echo "a second run while the first works: exit $?"
  wait $first; echo "the first run: exit $? ($(ls $R/checkpoints | tr '\n' ' '))"
  python -m braidtrain train $g -x 4; echo "a new run into the finished run's directory: exit $?"
  python -m braidtrain train $g -x 4 --start-over > /tmp/over.log 2>&1; echo "--start-over: exit $?"
  grep -E "start-over|error" /tmp/over.log
  ls -d /tmp/rdir.replaced-*; ls $R/checkpoints
fi

if [[ " $parts " == *" 3 "* ]]; then
  echo "== 3. llama3.2-1b's shape, byte vocabulary, b 4 t 2048"
  l="--model llama3.2-1b -i data/shakespeare_bytes -b 4 -t 2048 -d 8192 $q"
  for run in "eager" "compile --compile" "graph --compile --cuda-graph" "recompute --recompute" "exact --exact"; do
    set -- $run
    name=$1; shift
    python -m braidtrain train $l -x 8 "$@" --out /tmp/l_$name 2>&1 | grep -iE "error|Traceback" | head -5
    echo "$name: $(last /tmp/l_$name)"
  done
  python -m braidtrain plan --model llama3.2-1b --gpus 1 --gpu-mem 141 -t 2048 -d 8192 --check 0,4 \
    --data data/shakespeare_bytes 2>&1 | tail -4
fi
