#!/usr/bin/env bash
# braidtrain against torchtitan on one H200, issue #58 (from the repo root; data/shakespeare_bytes
# carried (or data/shakespeare_128k already built from it), data/shakespeare_gpt2 for part h, and .whl/ holding torchtitan 0.2.2, tyro, docstring_parser,
# typeguard and torchao 0.17.0: `bench train --torch titan` needs them, the machine has no network).
# Every Llama trains on Llama-3's 128,256-id vocabulary (data/shakespeare_128k, built here as
# llama_gpu.sh builds it). Each part is one `bench train` of the pair (braidtrain's layout, torchtitan's
# yardstick) in one call, 8 timed steps after 4 untimed:
#   a  llama3.2-1b -b 4 -t 2048, one micro-step: -z 0 --compile --cuda-graph against titan (bf16)
#   f  the same in FP8 tensorwise: --fp8 tensorwise against titan-fp8
#   g  a at four micro-steps (-d 32768)
#   b  llama3.2-3b -b 2 -t 2048: --compile and --compile --fp8 tensorwise against titan (bf16)
#   3  b's bf16 pair alone: --compile against titan
#   x  mixtral-small -b 8 -t 1024: --compile --cuda-graph and --compile against titan (its llama4 MoE)
#   q  finemoe-small (64 experts, top 8: a fine-grained Qwen3-MoE shape) as x
#   p  profile_step.py of a's braidtrain step and of titan's
#   h  gpt2's exact bits: --config gpt2 -b 16 -t 1024 -d 131072 -x 3 --exact --compile (weights_sha256)
# LEVER="FLAGS": every braidtrain layout is also run with FLAGS added (the lever measured beside).
# EXTRA_PATH: folders put on PYTHONPATH after .whl's (flash4_gpu.sh's flash-attn-4).
# BUDGET (seconds, default 100000): a part is skipped, saying so, when less is left than its estimate
# (one H200, torch 2.11, no compile cache: a 110 s, f 150, 3 150, b 220, g 150, p 100, h 90, x q 300).
# Usage: bash benchmarks/speed/titan_gpu.sh a f p     (parts in the order given; default: a f b x)
# Writes the log and each part's JSON to $OUT (default /tmp/titan_gpu).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/titan_gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/titan_gpu.log") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site${EXTRA_PATH:+:$EXTRA_PATH} || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
python -c "import torch, torchtitan; print('torch', torch.__version__, 'torchtitan', torchtitan.__version__)"
cat COMMIT 2>/dev/null || git log -1 --format='commit %h %s'  # (a carried copy: COMMIT, written beside it)
WIDE=data/shakespeare_128k
python benchmarks/corpus/llama3_ids.py  # data/shakespeare_128k: Llama-3's ids from the bytes (offline)
steps="--steps 12 --warmup 4"
BUDGET=${BUDGET:-100000}
fits() { local left=$((BUDGET - SECONDS)); [ "$left" -ge "$1" ] && return 0; echo "(part skipped: $left s left, it needs ~$1 s)"; return 1; }
declare -A need=([a]=110 [f]=150 [3]=150 [b]=220 [g]=150 [p]=100 [h]=90 [x]=300 [q]=300)
# pair PART MODEL "BENCH FLAGS" TORCH LAYOUT...: one bench train, each layout also with $LEVER
pair() {
  local part=$1 model=$2 flags=$3 yard=$4; shift 4
  local lays=()
  for l in "$@"; do lays+=(--layout "$l"); [ -n "${LEVER:-}" ] && lays+=(--layout "$l $LEVER"); done
  echo "== $part. $model $flags: ${*} against torch $yard ($SECONDS s)"
  python -m braidtrain bench train --model $model -i $WIDE $flags $steps "${lays[@]}" --torch $yard \
    --json "$OUT/$part.json" --loss-tol 0.1
  echo "($part: exit $?, $SECONDS s)"
}
for part in ${*:-a f b x}; do
  fits "${need[$part]:-0}" || continue
  case $part in
    a) pair a llama3.2-1b "-b 4 -t 2048 -d 8192" titan "-z 0 --compile --cuda-graph" ;;
    f) pair f llama3.2-1b "-b 4 -t 2048 -d 8192" titan-fp8 "-z 0 --compile --cuda-graph --fp8 tensorwise" ;;
    g) pair g llama3.2-1b "-b 4 -t 2048 -d 32768" titan "-z 0 --compile --cuda-graph" ;;
    b) pair b llama3.2-3b "-b 2 -t 2048 -d 4096" titan "-z 0 --compile" "-z 0 --compile --fp8 tensorwise" ;;
    3) pair 3 llama3.2-3b "-b 2 -t 2048 -d 4096" titan "-z 0 --compile" ;;
    x) pair x mixtral-small "-b 8 -t 1024 -d 8192" titan "-z 0 --compile --cuda-graph" "-z 0 --compile" ;;
    q) pair q finemoe-small "-b 8 -t 1024 -d 8192" titan "-z 0 --compile --cuda-graph" "-z 0 --compile" ;;
    p) echo "== p. profile of one step, llama3.2-1b -b 4 -t 2048 -d 8192 ($SECONDS s)"
       python benchmarks/profile/profile_step.py --model llama3.2-1b -i $WIDE -b 4 -t 2048 -d 8192 -z 0 --compile \
         --cuda-graph --out /tmp/titan_prof 2>&1 | tee "$OUT/p_braidtrain.txt" | head -70
       rm -rf /tmp/titan_prof
       python benchmarks/profile/profile_step.py --torch titan --model llama3.2-1b -i $WIDE -b 4 -t 2048 -d 8192 \
         2>&1 | tee "$OUT/p_titan.txt" | head -70 ;;
    h) echo "== h. gpt2 --exact --compile, 3 steps ($SECONDS s)"
       python -m braidtrain train --config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072 -x 3 --exact --compile \
         --val-every 0 --sample-tokens 0 --no-progress --out /tmp/g_exact 2>&1 | grep -iE "error" | head -5
       python -c "import json; print('gpt2 exact weights_sha256', json.load(open('/tmp/g_exact/summary.json'))['weights_sha256'])" ;;
    *) echo "unknown part $part" ;;
  esac
done
echo "done in $SECONDS s"
