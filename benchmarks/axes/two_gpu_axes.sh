#!/usr/bin/env bash
# Issues #26-#31 on two GPUs of one host (device kind nvidia-h200-x2): one part per device call,
# each within ten minutes. Usage (repo root, data/shakespeare_gpt2 carried):
#   bash benchmarks/axes/two_gpu_axes.sh PART
#   zero3  #26: plan gpt2-xl on 2 GPUs under a 20 GB cap (ZeRO-0 does not fit, ZeRO-3 does); ZeRO-0
#          failing with the one-line out-of-memory message; ZeRO-3 training 20 steps; plan --check
#          of that layout; bench train ZeRO-3 --compile against FSDP2 (+ compile)
#   tp     #27: bench train gpt2-medium: --tp 2, --tp 2 --sp, -z 1 (dp 2); --exact --tp 2 twice
#   pp     #28: bench train gpt2 and gpt2-medium: --pp 2 with each schedule at m = 8 and 16 against
#          -z 1 and torch's Schedule1F1B / ScheduleInterleaved1F1B; --exact --pp 2 vs one GPU per
#          schedule; plot --schedule of one 1f1b step
#   cp     #29: the longest -t on one GPU, a longer one at --cp 2; cp 2 ring / allgather against dp 2
#          at a length that fits both; --exact --cp 2 twice
#   ep     #30: bench train gpt2-moe: --ep 2 against ep 1 (dp 2), capacity 1.25 and dropless;
#          --exact --ep 2 against --exact at ep 1
#   speed  #31: bench train --repeat 3 gpt2: ZeRO 0/1/3 --compile (and the graph) against DDP +
#          compile and FSDP2 + compile; bench comm for the busbw the layouts' reductions reach
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null
D=data/shakespeare_gpt2
bench() { python -m braidtrain bench train -i $D "$@"; }
two() { timeout "$1" python -m torch.distributed.run --standalone --nproc-per-node 2 -m braidtrain train -i $D \
        --val-every 0 --sample-tokens 0 --no-progress "${@:2}"; }
sha() { python -c "import json,sys; print(json.load(open(sys.argv[1] + '/summary.json'))['weights_sha256'])" "$1"; }
last() { tail -n 1 "$1/metrics.jsonl" | cut -c1-240; }
case ${1:-} in
zero3)  # llm.c's d72 (7.3B): 16 bytes a parameter at ZeRO-0 (117 GB) and its activations do not fit 141 GB
  python -m braidtrain plan --model d72 --gpus 2 --gpu-mem 141 -t 1024 -d 65536 -b 1 --pp 1 --cp 1 --variants --top 8
  echo "== ZeRO-0 (expect the one-line out-of-memory message)"
  two 200 --model d72 -b 1 -t 1024 -d 65536 -x 2 -z 0 --out /tmp/z0 2>&1 | grep -E "error|out of memory" | head -3
  echo "== ZeRO-3, 20 steps"
  two 400 --model d72 -b 1 -t 1024 -d 65536 -x 20 -z 3 --out /tmp/z3 2>&1 | grep -E "error" | head -3
  last /tmp/z3
  python -m braidtrain plan --model d72 --gpus 2 --gpu-mem 141 -t 1024 -d 65536 -z 3 -b 1 --no-recompute --check --data $D
  bench --model d72 -b 1 -t 1024 -d 65536 --steps 5 --warmup 2 --layout '-z 3' --torch fsdp2 ;;
tp)
  bench --model gpt2-medium -b 8 -t 1024 -d 65536 --steps 10 --warmup 4 --layout '--tp 2' --layout '--tp 2 --sp' \
        --layout '-z 1 --compile' --torch ddp-compile
  for i in 1 2; do two 200 --config gpt2-medium -b 8 -t 1024 -d 32768 -x 4 --tp 2 --exact --out /tmp/tpx$i >/dev/null 2>&1; echo "tp exact $i: $(sha /tmp/tpx$i)"; done ;;
pp)
  for model in gpt2 gpt2-medium; do
    for m in 8 16; do
      layouts=(); for s in gpipe 1f1b interleaved zb; do layouts+=(--layout "--pp 2 --pp-schedule $s"); done
      bench --model $model -b 4 -t 1024 -d $((2 * 4 * 1024 * m / 2)) --steps 6 --warmup 2 "${layouts[@]}" --layout '-z 1' \
            --torch pipe-1f1b,pipe-interleaved
    done
  done
  for s in gpipe 1f1b interleaved zb; do
    two 200 --config gpt2 -b 4 -t 1024 -d 32768 -x 3 --pp 2 --pp-schedule $s --exact --out /tmp/ppx_$s >/dev/null 2>&1
    echo "pp 2 $s exact: $(sha /tmp/ppx_$s)"
  done
  timeout 150 python -m braidtrain train --config gpt2 -i $D -b 4 -t 1024 -d 32768 -x 3 --exact --val-every 0 \
    --sample-tokens 0 --no-progress --out /tmp/ppx_one >/dev/null 2>&1; echo "one GPU exact: $(sha /tmp/ppx_one)"
  python -m braidtrain plot --schedule /tmp/ppx_1f1b --out "$OUT/schedule_pp2_1f1b.png" ;;
cp)
  for t in 262144 524288; do
    echo "== one GPU, -t $t --recompute"
    timeout 200 python -m braidtrain train --config gpt2 -i $D --block-size $t -t $t -b 1 -d $t -x 2 --recompute \
      --val-every 0 --sample-tokens 0 --no-progress --out /tmp/cp1_$t 2>&1 | grep -E "error|out of memory" | head -2
  done
  echo "== cp 2, -t 1048576 --recompute, 20 steps"
  two 400 --config gpt2 --block-size 1048576 -t 1048576 -b 1 -d 1048576 -x 20 --recompute --cp 2 --out /tmp/cp2_long 2>&1 | grep error | head -2
  last /tmp/cp2_long
  for v in "cp2 --cp 2" "cp2ag --cp 2 --cp-impl allgather" "dp2 -z 1"; do  # -t 32768: fits both ways
    set -- $v; name=$1; shift
    two 300 --config gpt2 --block-size 32768 -t 32768 -b 1 -d 65536 -x 8 "$@" --out /tmp/cpb_$name >/dev/null 2>&1
    echo "$name: $(last /tmp/cpb_$name)"
  done
  for i in 1 2; do two 200 --config gpt2 -b 2 -t 1024 -d 8192 -x 3 --cp 2 --exact --out /tmp/cpx$i >/dev/null 2>&1; echo "cp exact $i: $(sha /tmp/cpx$i)"; done ;;
ep)  # bench train has no MoE flags: train runs, their metrics (tokens_per_s, mem_gb, moe_dropped, comm)
  for cap in 1.25 0; do
    for v in "ep2 --ep 2" "ep1 -z 0"; do
      set -- $v; name=$1; shift
      two 300 --config gpt2-moe -b 8 -t 1024 -d 65536 -x 10 --moe-capacity $cap "$@" --out /tmp/ep_${name}_$cap >/dev/null 2>&1
      echo "$name capacity $cap: $(last /tmp/ep_${name}_$cap)"
    done
  done
  two 200 --config gpt2-moe -b 4 -t 1024 -d 16384 -x 3 --ep 2 --exact --out /tmp/epx2 >/dev/null 2>&1
  two 200 --config gpt2-moe -b 4 -t 1024 -d 16384 -x 3 --exact --out /tmp/epx1 >/dev/null 2>&1
  echo "ep 2: $(sha /tmp/epx2)"; echo "ep 1: $(sha /tmp/epx1)" ;;
speed)
  bench --model gpt2 -b 16 -t 1024 -d 131072 --steps 12 --warmup 4 --repeat 3 --layout '-z 0 --compile --cuda-graph' \
        --layout '-z 1 --compile --cuda-graph' --layout '-z 3 --compile' --torch ddp-compile,fsdp2-compile
  torchrun --standalone --nproc-per-node 2 -m braidtrain bench comm ;;
*) echo "usage: $0 zero3|tp|pp|cp|ep|speed"; exit 2 ;;
esac
