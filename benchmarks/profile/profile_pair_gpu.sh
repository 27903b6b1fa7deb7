#!/usr/bin/env bash
# One GPU: where the step's time goes in braidtrain (`--compile --cuda-graph`) and in bench train's
# torch yardstick (DDP + compile), profiled one after the other with the same model and batch, so
# their kernel classes can be set side by side (benchmarks/profile/profile_step.py prints each).
#   bash benchmarks/profile/profile_pair_gpu.sh [MODEL ...]     # default: gpt2 gpt2-medium; logs in $OUT
set -u
out=${OUT:-out/profile_pair}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
flags=(-i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072)
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(gpt2 gpt2-medium)
for model in "${models[@]}"; do
  python benchmarks/profile/profile_step.py --model "$model" "${flags[@]}" --compile --cuda-graph > "$out/$model.braidtrain.log" 2>&1
  echo "$model braidtrain rc=$? $(grep -m1 '^step' "$out/$model.braidtrain.log")"
  python benchmarks/profile/profile_step.py --torch ddp-compile --model "$model" "${flags[@]}" > "$out/$model.torch.log" 2>&1
  echo "$model torch rc=$? $(grep -m1 '^step' "$out/$model.torch.log")"
done
