#!/usr/bin/env bash
# One call on the GPU machine, for the pipeline's wave: (1) zero bubble's split backward against
# the plain backward on the GPU, bitwise (tests/test_pipeline.py's check, under pytest where the
# machine has it); (2) gpt2 a few steps at pp 1 through the reshaped engine (default -z 0, -z 1
# --compile, exact); (3) the bubble benchmark on the host's CPU cores (gloo, pp 4, 3 threads a
# process). Usage (repo root; data/shakespeare_gpt2 and data/shakespeare_bytes carried):
#   bash benchmarks/axes/pipeline_gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
RUNS=/tmp/pipeline_gpu; mkdir -p "$RUNS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; nproc
echo "== (1) split backward on cuda"
if python -c "import pytest" 2>/dev/null; then
  PYTHONPATH=. python -m pytest -q -p no:cacheprovider tests/test_pipeline.py -k "split_backward and cuda" 2>&1 | tail -3
else
  echo "no pytest here"
fi
echo "== (2) gpt2 at pp 1"
common="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072 -x 8 --val-every 0 --sample-tokens 0 --no-progress"
for run in "default -z 0" "compile -z 1 --compile" "exact -z 0 --exact"; do
  set -- $run; name=$1; shift
  python -m braidtrain train $common "$@" --out $RUNS/$name 2>&1 | grep -E "error|Error" | head -5
  echo "$name: $(tail -n 1 $RUNS/$name/metrics.jsonl | cut -c1-200)"; grep weights_sha256 $RUNS/$name/summary.json
done
echo "== (3) bubble, CPU processes"
python benchmarks/axes/pipeline_bubble.py --data data/shakespeare_bytes --pp 4 --micro 8 16 --threads 3
