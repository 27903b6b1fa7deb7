#!/usr/bin/env bash
# flash-attn-4's attention (braidtrain/model/flash4.py) on one H200: issue #58's attention lever.
# The GPU machine has no network, and the package's CUDA libraries (nvidia-cutlass-dsl-libs-cu13, one
# 92 MB wheel) exceed a call's 64 MiB carry: they travel in two calls to one warm machine (it is given
# back after ~30 s idle: make each next call at once; what a call carried stays there while it is warm).
# From the repo root:
#   here, once:  bash benchmarks/speed/flash4_gpu.sh prepare     # .fa4a/ (~55 MiB), .fa4b/ (~43 MiB)
#   call 1:      carry [".fa4a"]:  bash benchmarks/speed/flash4_gpu.sh stage   (then work that needs no
#                data, e.g. `; OUT=$OUT bash benchmarks/speed/exact_cost_gpu.sh k n`)
#   call 2:      carry [".fa4b", "data", "COMMIT"] (data: shakespeare_bytes, shakespeare_gpt2):
#                OUT=$OUT bash benchmarks/speed/flash4_gpu.sh install kernel
#   call 3:      carry [".whl", "COMMIT"] (torchtitan's wheels; data is still there):
#                OUT=$OUT BUDGET=550 bash benchmarks/speed/flash4_gpu.sh install a f
#   later calls to the same machine: install finds it installed (carry only what the parts need)
# Parts, after install (in the order given):
#   kernel  benchmarks/kernels/flash4_gpu.py --exact: SDPA (cuDNN) against flash4, fwd and fwd+bwd, errors;
#           its deterministic backward's bits (repeat, batch invariance) and time against exact mode's (~90 s)
#   a       titan_gpu.sh a with LEVER="--attention sdpa": llama3.2-1b b4 t2048 one micro-step, braidtrain
#           -z 0 --compile --cuda-graph with flash4 (auto) and with sdpa, against torchtitan, one bench train
#   other titan_gpu.sh parts (f g b 3 x q) likewise, each layout also with --attention sdpa
# BUDGET as titan_gpu.sh's. Writes to $OUT (default /tmp/flash4_gpu).
set -uo pipefail
WHEELS="flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5"
BIG=nvidia_cutlass_dsl_libs_cu13
SITE=/tmp/fa4site
OUT=${OUT:-/tmp/flash4_gpu}

prepare() {  # here (network): the wheels for the GPU machine's python 3.12, split over two carries
  grep -qx '/.fa4[ab]/' .git/info/exclude 2>/dev/null || printf '/.fa4a/\n/.fa4b/\n' >> .git/info/exclude
  rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b
  # shellcheck disable=SC2086  # (one name a word)
  python3 -m pip download -q --pre --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d .fa4a $WHEELS || exit 1
  local big; big=$(ls .fa4a/$BIG-*.whl) || exit 1
  (cd .fa4a && sha256sum "$(basename "$big")" > big.sha256)
  split -b 45M -d "$big" .fa4a/big.part. && mv .fa4a/big.part.0[1-9] .fa4b/ && rm "$big"
  du -sh .fa4a .fa4b
}

stage() {  # GPU machine, call 1: keep the first half outside the checkout until call 2
  rm -rf /tmp/fa4a && cp -r .fa4a /tmp/fa4a && du -sh /tmp/fa4a && nvidia-smi --query-gpu=name --format=csv,noheader
}

install() {  # GPU machine, call 2: join the halves, check, install (later calls: already there);
  # PYTHONPATH as pip's .pth would set it
  if [ ! -d $SITE/flash_attn ]; then
    [ -d /tmp/fa4a ] || { echo "no /tmp/fa4a: call 1 (stage) ran on another machine; start again"; exit 1; }
    local name; name=$(cut -d' ' -f3 /tmp/fa4a/big.sha256)
    cat /tmp/fa4a/big.part.* .fa4b/big.part.* > "/tmp/$name" && (cd /tmp && sha256sum -c /tmp/fa4a/big.sha256) \
      || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
      /tmp/fa4a/*.whl "/tmp/$name" || exit 1
  fi
  export PYTHONPATH=$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "from braidtrain.model import flash4; import flash_attn.cute as f; \
print('flash-attn-4', f.__version__, 'available:', flash4.available('cuda'))" || exit 1
}

case ${1:-} in
  prepare) prepare; exit ;;
  stage) stage; exit ;;
  install) shift; install ;;
  *) echo "usage: flash4_gpu.sh prepare | stage | install [kernel] [titan_gpu.sh parts]"; exit 2 ;;
esac
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
parts=()
for part in "$@"; do
  if [ "$part" = kernel ]; then
    python3 benchmarks/kernels/flash4_gpu.py --exact 2>&1 | tee "$OUT/kernel.log"
  else
    parts+=("$part")
  fi
done
# titan_gpu.sh installs .whl/ into /tmp/site and sets PYTHONPATH=$PWD:/tmp/site: keep ours after it
[ ${#parts[@]} -eq 0 ] && exit 0
LEVER="--attention sdpa" OUT=$OUT EXTRA_PATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages \
  bash benchmarks/speed/titan_gpu.sh "${parts[@]}"
