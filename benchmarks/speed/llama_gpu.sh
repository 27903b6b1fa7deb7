#!/usr/bin/env bash
# Llama on one GPU against the model a user would otherwise train: one call on one H200 (from the
# repo root, data/shakespeare_bytes carried; no network). Every model trains on Llama-3's 128,256-id
# vocabulary: the Shakespeare bytes two at a time, spread over the ids (built here, data/shakespeare_128k).
#   a. llama3.2-1b at -b 4 -t 2048: braidtrain --compile --cuda-graph and --compile side by side with
#      transformers' LlamaForCausalLM under torch.compile (bench train --torch hf-compile; target >= 1.10x)
#   b. llama3.2-3b and llama3.1-8b: the layout plan picks for one H200, with --compile: tokens/s, MFU,
#      measured peak memory against plan's estimate (benchmarks/speed/fit_gpu.py: no checkpoint, as an 8B's
#      96 GB would not fit the disk); a layout that fails is followed by the next leaner one
#   c. the loss at the 128k vocabulary: loss.py's fused head against the transformers model's (its
#      lm_head in bf16, fp32 logits, cross-entropy; eager and torch.compile), time and memory
#   d. where the time goes: benchmarks/profile/profile_step.py of braidtrain's --compile step and of hf-compile's
# Usage: bash benchmarks/speed/llama_gpu.sh [a b c d]   (default: all; a part is skipped, saying so, when
#        fewer seconds are left of BUDGET (default 540) than it needs)
#        SMOKE=1 bash benchmarks/speed/llama_gpu.sh   the same steps on the CPU at tiny sizes (checks this script)
# A_COMPILE=1: part a runs braidtrain's --compile layout too (without it, its best: --cuda-graph).
# Writes its log and each part's JSON to $OUT (default /tmp/llama_gpu); deletes every run directory.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
parts=" ${*:-a b c d} "
OUT=${OUT:-/tmp/llama_gpu}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/llama_gpu.log") 2>&1
WIDE=data/shakespeare_128k
if [ "${SMOKE:-0}" = 1 ]; then  # tiny shapes, eager, on the CPU
  dev="--device cpu"; m1=llama3-tiny; m3=llama3-tiny; m8=llama3-tiny; bt="-b 2 -t 64"; d1=256; steps="--steps 3 --warmup 1"; fsteps=$steps
  graph="-z 0"; comp="-z 1"; yard=hf; c=""; fit3="-b 2"; lean3="-b 1"; fit8="-b 2 --recompute"; lean8="-b 1 --recompute"
  d3=256; d8=256; loss="--smoke"; BUDGET=100000
else
  dev=""; m1=llama3.2-1b; m3=llama3.2-3b; m8=llama3.1-8b; bt="-b 4 -t 2048"; d1=32768; steps="--steps 10 --warmup 4"; fsteps="--steps 6 --warmup 3"
  graph="-z 0 --compile --cuda-graph"; comp="-z 0 --compile"; yard=hf-compile; c="--compile"
  fit3="-b 8"; lean3="-b 4"; fit8="-b 2 --recompute"; lean8="-b 1 --recompute"  # plan's picks, and the next leaner
  d3=32768; d8=8192; loss="--tokens 8192 --width 2048 --vocab 128256"
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
fi
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null
t=$([ "${SMOKE:-0}" = 1 ] && echo 64 || echo 2048)
# a part runs when the time left covers what it needs (seconds: estimates for an H200, not yet measured)
fits() { local left=$((BUDGET - SECONDS)); [ "$left" -ge "$1" ] && return 0; echo "(skipped: $left s left, it needs ~$1 s)"; return 1; }

python benchmarks/corpus/llama3_ids.py  # data/shakespeare_128k: Llama-3's ids from the bytes (offline)

if [[ $parts == *" a "* ]]; then
  echo "== a. $m1 $bt -d $d1: braidtrain against transformers' LlamaForCausalLM + torch.compile"
  fits 250 && python -m braidtrain bench train --model $m1 -i $WIDE $bt -d $d1 $steps $dev \
    --layout "$graph" ${A_COMPILE:+--layout "$comp"} --torch $yard --json "$OUT/a_bench.json"
  echo "(a: exit $?, $SECONDS s)"
fi

if [[ $parts == *" b "* ]]; then
  for spec in "$m3 $d3 $fit3|$lean3" "$m8 $d8 $fit8|$lean8"; do
    read -r model d rest <<< "$spec"
    echo "== b. $model on one GPU, -t $t -d $d: $(python -m braidtrain plan --model $model --gpus 1 --gpu-mem 141 \
      -t $t -d $d --data $WIDE | tail -1)"
    IFS='|' read -r first second <<< "$rest"
    for lay in "$first" "$second"; do
      fits 130 || break
      rm -f "$OUT/b_${model}.json"
      python benchmarks/speed/fit_gpu.py $fsteps --json "$OUT/b_${model}.json" --model $model -i $WIDE -t $t -d $d \
        -z 0 $lay $c $dev 2>&1 | tail -4
      [ -s "$OUT/b_${model}.json" ] && break
      echo "($model $lay did not run: the next leaner layout)"
    done
    echo "($SECONDS s)"
  done
fi

if [[ $parts == *" c "* ]]; then
  echo "== c. the loss at the 128k vocabulary: $loss"
  # (on the CPU its Triton kernel runs in Triton's interpreter: set for this command only, or
  # braidtrain's training above would take that slow path too)
  fits 45 && env $([ "${SMOKE:-0}" = 1 ] && echo TRITON_INTERPRET=1) python benchmarks/kernels/loss_gpu.py $loss
  echo "(c: exit $?, $SECONDS s)"
fi

if [[ $parts == *" d "* ]]; then
  echo "== d. profile of one step, $m1 $bt -d $d1: braidtrain ${comp}"
  if fits 100; then
    python benchmarks/profile/profile_step.py --model $m1 -i $WIDE $bt -d $d1 $comp $dev --out /tmp/llama_prof \
      2>&1 | tee "$OUT/d_braidtrain.txt" | head -60
    rm -rf /tmp/llama_prof
  fi
  echo "== d. profile of one step: torch $yard"
  fits 130 && python benchmarks/profile/profile_step.py --torch $yard --model $m1 -i $WIDE $bt -d $d1 $dev \
    2>&1 | tee "$OUT/d_$yard.txt" | head -60
  echo "(d: $SECONDS s)"
fi
echo "done in $SECONDS s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
