#!/usr/bin/env bash
# The two-GPU figures of issue #7 on nvidia-h200-x2, one part per device call (each fits in ten
# minutes). Usage (repo root, data/shakespeare_gpt2 carried): bash benchmarks/speed/two_gpu.sh PART
#   exact  --exact --compile on 1 and on 2 H200s: the same losses and weights_sha256? (any further
#          arguments go to the two-GPU run, e.g. exact -z 3)
#   quick  bench train on both GPUs: ZeRO-0/1 --compile against torch DDP + compile (5 timed steps)
#   train  bench train on both GPUs: ZeRO-0/1/3 --compile, DDP + compile, FSDP2; then ZeRO-1
#          --compile and DDP + compile on one GPU of the same host (the 1 -> 2 scaling)
#   buckets  bench train on both GPUs, ZeRO-1 --compile at --bucket-mb 10, 25, 50 (the default), 100
#   graph  --cuda-graph on both GPUs: --exact --compile eager, with the graph at ZeRO-0 and ZeRO-1
#          (the collectives captured too), the same losses and weights_sha256?
#   graph-train  bench train on both GPUs: ZeRO-0/1 --compile --cuda-graph, ZeRO-1 --compile and
#          torch DDP + compile
#   zero3  bench train on both GPUs: ZeRO-3 --compile against FSDP2 as torch ships it, then both
#          with TORCH_NCCL_HIGH_PRIORITY=1, then both with that and NCCL_PROTO=Simple (braidtrain's
#          own defaults); then --exact --compile -z 3 on 2 GPUs against one GPU: the same losses and
#          weights_sha256?
#   comm   bench comm: raw all_reduce / reduce_scatter / all_gather busbw from 4 MB to 1 GB, and
#          at the bucket sizes, to hold against bench train's busbw column
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
rm -rf /tmp/keep-train /tmp/keep-buckets /tmp/keep-graph /tmp/keep-zero3 /tmp/e1 /tmp/e2  # a warm machine may hold an earlier call's runs
nvidia-smi --query-gpu=name --format=csv,noheader
bench() { python -m braidtrain bench train -i data/shakespeare_gpt2 "$@"; }
steps() {  # each kept run's steps: seconds, communication seconds, exposed seconds, busbw
  for m in "$1"/*/metrics.jsonl; do
    echo "$m"; python -c "import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l); print(r['step'], *(round(r.get(k) or 0, 4) for k in ('step_s', 'comm_s', 'exposed_comm_s', 'comm_busbw_GBps')))" "$m"
  done
}
same_bits() {  # --exact --compile on both GPUs (with the arguments given) and on one: the same losses and weights_sha256?
  local common="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 32768 -x 4 --val-every 0 --sample-tokens 0 --no-progress --exact --compile"
  timeout 100 python -m torch.distributed.run --standalone --nproc-per-node 2 -m braidtrain train $common "$@" --out /tmp/e2 > "$OUT/e2.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 80 python -m braidtrain train $common --out /tmp/e1 > "$OUT/e1.log" 2>&1
  for r in e1 e2; do
    echo "$r losses: $(python -c "import json; print([json.loads(l)['loss'] for l in open('/tmp/$r/metrics.jsonl')])" 2>&1)"
    echo "$r sha: $(python -c "import json; print(json.load(open('/tmp/$r/summary.json'))['weights_sha256'])" 2>&1)"
  done
}
case ${1:-} in
exact)
  shift; same_bits "$@" ;;
graph)
  common="--config gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 65536 -x 6 --val-every 2 --val-steps 2 --ckpt-every 2 --sample-tokens 0 --no-progress --exact --compile"
  for v in "eager" "graph --cuda-graph" "graph_z1 --cuda-graph -z 1"; do
    set -- $v
    name=$1; shift
    timeout 150 python -m torch.distributed.run --standalone --nproc-per-node 2 -m braidtrain train $common "$@" --out /tmp/g_$name > "$OUT/g_$name.log" 2>&1 \
      || { echo "== $name FAILED"; tail -30 "$OUT/g_$name.log"; }
    echo "$name: $(python -c "import json; print([(r['loss'], r.get('val_loss'), round(r['comm_s'], 5), r['exposed_comm_s']) for r in map(json.loads, open('/tmp/g_$name/metrics.jsonl'))], json.load(open('/tmp/g_$name/summary.json'))['weights_sha256'])" 2>&1)"
  done ;;
graph-train)
  bench --nproc 2 --steps 10 --warmup 3 --torch ddp-compile --layout "-z 0 --compile --cuda-graph" \
    --layout "-z 1 --compile --cuda-graph" --layout "-z 1 --compile" --json "$OUT/graph_train.json" --keep /tmp/keep-graph
  steps /tmp/keep-graph ;;
quick)
  bench --nproc 2 --steps 8 --warmup 3 --torch ddp-compile --layout "-z 1 --compile" --layout "-z 0 --compile" --json "$OUT/quick.json" ;;
train)
  bench --nproc 2 --steps 10 --warmup 3 --torch ddp-compile,fsdp2 --layout "-z 0 --compile" --layout "-z 1 --compile" \
    --layout "-z 3 --compile" --json "$OUT/train2.json" --keep /tmp/keep-train
  steps /tmp/keep-train
  bench --nproc 1 --steps 10 --warmup 3 --torch ddp-compile --layout "-z 1 --compile" --json "$OUT/train1.json" ;;
buckets)
  bench --nproc 2 --steps 10 --warmup 3 --torch "" --layout "-z 1 --compile --bucket-mb 10" --layout "-z 1 --compile --bucket-mb 25" \
    --layout "-z 1 --compile" --layout "-z 1 --compile --bucket-mb 100" --json "$OUT/buckets.json" --keep /tmp/keep-buckets
  steps /tmp/keep-buckets ;;
zero3)
  bench --nproc 2 --steps 10 --warmup 3 --torch fsdp2 --baseline fsdp2 --layout "-z 3 --compile" --json "$OUT/zero3.json" --keep /tmp/keep-zero3
  steps /tmp/keep-zero3
  TORCH_NCCL_HIGH_PRIORITY=1 bench --nproc 2 --steps 10 --warmup 3 --torch fsdp2 --baseline fsdp2 --layout "-z 3 --compile" --json "$OUT/zero3_hp.json"
  TORCH_NCCL_HIGH_PRIORITY=1 NCCL_PROTO=Simple bench --nproc 2 --steps 10 --warmup 3 --torch fsdp2 --baseline fsdp2 --layout "-z 3 --compile" --json "$OUT/zero3_hp_simple.json"
  same_bits -z 3 ;;
comm)
  python -m torch.distributed.run --standalone --nproc-per-node 2 -m braidtrain bench comm \
    --ops all_reduce,reduce_scatter,all_gather --min-bytes 4M --max-bytes 1G --json "$OUT/comm.json"
  # at the reduction's own message sizes: one GPT-2 block in fp32 (a bucket at --bucket-mb 25;
  # the default 50 holds two), then x4 and x16 (the embedding group's bucket, 157 MB, lies between)
  python -m torch.distributed.run --standalone --nproc-per-node 2 -m braidtrain bench comm \
    --ops all_reduce,reduce_scatter --min-bytes 28351488 --max-bytes 512M --json "$OUT/comm_buckets.json" ;;
*) echo "usage: bash benchmarks/speed/two_gpu.sh exact|graph|graph-train|quick|train|buckets|zero3|comm" >&2; exit 2 ;;
esac
