#!/usr/bin/env bash
# One call on one GPU: mixtures of experts at ep 1 (from the repo root, data/shakespeare_gpt2 carried).
#   1. gpt2-moe (GPT-2 experts, top 2 of 8), mixtral-small (SwiGLU experts at gpt2-moe's active size)
#      and finemoe-small (64 experts of 512, top 8) at -b 8 -t 1024 -d 65536: --compile --cuda-graph
#      (gpt2-moe eager too, the host-bound baseline), dropless (the presets') and at capacity 1.25; tokens/s,
#      MFU on the active parameters, host_s / step_s, peak memory
#   2. a profile of the fine-grained preset's compiled step (benchmarks/profile/profile_step.py)
#   3. side by side with transformers' MixtralForCausalLM under torch.compile (bench train --torch
#      hf-compile) at mixtral-small's shape, from the same initial weights, final losses compared
# (0: GPT-2's exact bits, a check that a change left them alone.) Parts 0 1 take ~5 min on the H200,
# 2 3 about as long: two calls (ONLY=graph with parts 1 3: one call of ~7 min). Everything printed is
# also in $OUT/moe_speed.txt (appended).
# Usage: OUT=/tmp/out bash benchmarks/speed/moe_speed_gpu.sh [0|1|2|3 ...]; SMOKE=1: tiny shapes on the CPU;
#        ONLY='graph ...': part 1's runs of those names alone (eager, graph, graph-cap1.25)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
parts=${*:-1 2 3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/moe_speed.txt") 2>&1
q="--val-every 0 --sample-tokens 0 --no-progress"
D=data/shakespeare_gpt2; shape="-b 8 -t 1024 -d 65536"; steps=10
models="gpt2-moe mixtral-small finemoe-small"
if [ -n "${SMOKE:-}" ]; then
  D=data/shakespeare_bytes; shape="-b 2 -t 64 -d 256 --n-layer 2 --n-embd 64 --n-head 4"; steps=2
  models="tiny-moe mixtral-tiny"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
last() { python -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1] + '/metrics.jsonl')][-1]; \
print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k in ('step', 'loss', 'tokens_per_s', 'mfu', 'mem_gb', 'host_s', 'step_s', 'moe_dropped', 'moe_load_max')})" "$1"; }
model_flag() { [ -f braidtrain/configs/$1.toml ] && echo "--config $1" || echo "--model $1"; }

if [[ " $parts " == *" 0 "* ]] && [ -z "${SMOKE:-}" ]; then  # (0: not in the default parts)
  echo "== GPT-2's exact bits: --config gpt2 -b 16 -t 1024 -d 131072 -x 3 --exact --compile"
  python -m braidtrain train --config gpt2 -i $D -b 16 -t 1024 -d 131072 -x 3 --exact --compile $q --out /tmp/g_exact \
    2>&1 | grep -iE "error|Traceback" | head -5
  python -c "import json; print('gpt2 exact weights_sha256', json.load(open('/tmp/g_exact/summary.json'))['weights_sha256'])"
  rm -rf /tmp/g_exact
fi

runs_of() {  # the runs of model $1: eager (the host-bound baseline) for the first, then compiled ones
  case $1 in
    gpt2-moe|tiny-moe) echo "eager|graph --compile --cuda-graph|graph-cap1.25 --compile --cuda-graph --moe-capacity 1.25" ;;
    mixtral-small|mixtral-tiny) echo "graph --compile --cuda-graph|graph-cap1.25 --compile --cuda-graph --moe-capacity 1.25" ;;
    *) echo "graph --compile --cuda-graph" ;;
  esac
}
if [[ " $parts " == *" 1 "* ]]; then
  for m in $models; do
    IFS='|' read -ra runs <<< "$(runs_of $m)"
    for run in "${runs[@]}"; do
      [ -n "${SMOKE:-}" ] && run=${run/ --cuda-graph/}  # (no CUDA graph on the CPU)
      set -- $run; name=$1; shift
      [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && continue  # ONLY="graph": those runs alone
      out=/tmp/moe_${m}_$name
      python -m braidtrain train $(model_flag $m) -i $D $shape -x $steps $q "$@" --out $out 2>&1 | grep -iE "error|Traceback" | head -5
      echo "$m $name ($*): $(last $out)"
      rm -rf $out
    done
  done
fi

if [[ " $parts " == *" 2 "* ]] && [ -z "${SMOKE:-}" ]; then
  echo "== profile: finemoe-small --compile --cuda-graph"
  python benchmarks/profile/profile_step.py --model finemoe-small -i $D $shape --compile --cuda-graph $q 2>&1 | head -60
  echo "== profile: mixtral-small --compile --cuda-graph"
  python benchmarks/profile/profile_step.py --model mixtral-small -i $D $shape --compile --cuda-graph $q 2>&1 | head -40
fi

if [[ " $parts " == *" 3 "* ]]; then  # (bench checks that the final losses agree within --loss-tol: else exit 2)
  m=mixtral-small; layout="-z 0 --compile --cuda-graph"
  [ -n "${SMOKE:-}" ] && m=mixtral-tiny && layout="-z 0 --compile"
  echo "== $m: braidtrain $layout beside transformers' MixtralForCausalLM + torch.compile"
  python -m braidtrain bench train --model $m -i $D $shape --steps $((steps + 4)) --warmup 4 --layout "$layout" \
    --torch hf-compile 2>&1 | tail -6
  echo "bench exit: ${PIPESTATUS[0]}"
fi
