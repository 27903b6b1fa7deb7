#!/usr/bin/env bash
# plan --check on one GPU: estimated against measured peak memory for gpt2 and gpt2-xl at two
# micro-batch sizes each (ZeRO-0, one micro-step), plus ZeRO-3 and recompute variants of gpt2.
# Usage (repo root, data/shakespeare_gpt2 carried): bash benchmarks/memory-plan/plan_check_gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p $OUT
plan() {  # the plan subcommand, whether or not cli.py has it wired yet
  python - "$@" <<'PY'
import argparse, sys
from braidtrain.plan import command, flags
p = argparse.ArgumentParser(); sub = p.add_subparsers(dest="cmd"); flags.add_parser(sub)
sys.exit(command.run(p.parse_args(["plan", *sys.argv[1:]])))
PY
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for spec in "gpt2 0,8" "gpt2 0,16" "gpt2 3,16" "gpt2 0,16,recompute" "gpt2-xl 0,4" "gpt2-xl 0,8"; do
  set -- $spec
  b=$(echo $2 | cut -d, -f2)
  echo "== $1 --check $2"
  plan --model $1 --gpus 1 --gpu-mem 141 -t 1024 -d $((b * 1024)) --check $2 \
       --data data/shakespeare_gpt2 --json > $OUT/check_${1}_${2//,/_}.json 2>$OUT/err_${1}_${2//,/_}.txt
  python -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r[k] for k in ('estimated_gb','measured_gb','rel_error')})" $OUT/check_${1}_${2//,/_}.json \
    || tail -3 $OUT/err_${1}_${2//,/_}.txt
done
