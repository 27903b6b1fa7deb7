#!/usr/bin/env bash
# --offload optimizer on one H200 (issue #57 item 7), ONE call, from the repo root with data/shakespeare_bytes
# (no network; prepared below if not carried; Llama-3's 128,256 ids are built from it). braidtrain's runs go through
# benchmarks/speed/fit_gpu.py, which drives the Trainer a few steps and saves no checkpoint (an 8B
# checkpoint is 96 GB, the disk 64 GB): tokens/s, MFU, GPU peak (torch's), host peak (max RSS), the host
# update's seconds a step (offload_update_s) and how much of it stayed exposed (offload_s: the main
# thread's waits for it in the next step's forward), each beside the planner's figure.
#   p. the probe: fused CPU AdamW elements/s on every core, pinned D2H/H2D GB/s, the host's copy GB/s
#      (offload_probe.py: the figures plan/timing.py's HOST_ADAM_PPS, PCIE_*_GBPS are to be set from)
#   b. llama3.1-8b -t 2048 -d 262144 in one call, side by side: --offload optimizer -b 4 --compile, no
#      --recompute (the planner's pick: `plan --model llama3.1-8b -t 2048 -d 262144 --compile`; b 4
#      without recompute fits only because the GPU holds no fp32 master or moments), and today's best
#      layout without offload, ZeRO-0 -b 4 --recompute --compile (issue #57's row was at -d 65536)
#   a. llama3.1-8b -b 1 -t 2048 -d 65536 --offload optimizer --compile, no --recompute
#   c. llama3.2-3b -b 2 -t 2048 -d 4096 (one micro-step) --compile, with and without offload; beside it
#      torch FSDP2 + CPUOffloadPolicy on transformers' LlamaForCausalLM of that shape (bench.torchref
#      fsdp2-offload, eager)
#   i. --offload-ratio (the planner's R: `plan --offload -b 2`, the smallest k/16 whose GPU memory fits) at
#      llama3.2-3b -b 2 -t 2048 -d 4096 (one micro-step) --compile, beside R = 1 and torch FSDP2 +
#      CPUOffloadPolicy (fsdp2-offload) -- issue #57's ">= 4x FSDP2's CPU offload"
#   ii. llama3.1-8b -t 2048 -d 65536 --compile at the planner's offloaded layout and R (`plan --offload`)
#   iii. llama3.2-3b -t 2048 -d 262144 --compile at the planner's offloaded layout and R against its best
#      layout without offload (`plan --no-offload`) -- issue #57's "within 10% of braidtrain without offload"
#   0. exact mode: a small llama with and without --offload optimizer, the same weights_sha256?
#   x. extras, if time is left: fsdp2-offload-compile; DeepSpeed ZeRO-Offload (only where its wheels
#      are carried in .whl: docs/performance.md says how; its CPU Adam is compiled on the spot)
# Data: data/shakespeare_bytes, carried or else prepared here (the corpus ships with braidtrain).
# Usage: bash benchmarks/memory-plan/offload_gpu.sh [p b a c i ii iii 0 x]   SMOKE=1: the same on the CPU at tiny sizes
# (default: p b a c 0 x; the ratio's parts by name: BUDGET=420 ... i, then BUDGET=560 ... ii iii)
# Parts run in the order above, each skipped (saying so) when too little of BUDGET (seconds, default 390:
# an 8-minute call with the machine's start) is left, and each stopped when it would overrun BUDGET.
# Prints one table at the end; writes $OUT/offload_gpu.json (every row) and $OUT/offload_gpu.log.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
parts=" ${*:-p b a c 0 x} "
OUT=${OUT:-/tmp/offload_gpu}
mkdir -p "$OUT"
W=$(mktemp -d)  # each run's JSON (only two files go to $OUT: a call brings back at most 8)
exec > >(tee -a "$OUT/offload_gpu.log") 2>&1
BUDGET=${BUDGET:-390}
WIDE=data/shakespeare_128k
if [ "${SMOKE:-0}" = 1 ]; then
  dev="--device cpu"; m3=llama3-tiny; m8=llama3-tiny; t=64; b8="-b 2"; d8a=512; d8b=1024; d3=128; c=""
  probe="--elements 1000000"; WIDE=data/shakespeare_bytes; GPU_GB=141
else
  dev=""; m3=llama3.2-3b; m8=llama3.1-8b; t=2048; b8="-b 1"; d8a=65536; d8b=262144; d3=4096; c="--compile"; probe=""
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  free -g | head -2
  GPU_GB=$(python -c "import torch; print(torch.cuda.mem_get_info()[1] / 1e9)")  # (what --layout auto plans on)
fi
{ cat COMMIT 2>/dev/null || git log -1 --format='commit %h %s'; } 2>/dev/null; date -u  # (a carried copy: its COMMIT file)
python benchmarks/corpus/llama3_ids.py  # data/shakespeare_128k: Llama-3's ids from the bytes (offline)
# fits N: the time left of BUDGET covers N seconds (what the part needs on an H200, estimated)
fits() { local left=$((BUDGET - SECONDS)); [ "$left" -ge "$1" ] && return 0; echo "(skipped: $left s left, it needs ~$1 s)"; return 1; }
# bounded CMD...: CMD, stopped once BUDGET is spent (exit 124)
bounded() { timeout -k 15 $((BUDGET - SECONDS > 10 ? BUDGET - SECONDS : 10)) "$@"; }
fit() { local name=$1; shift; echo "== $name (at ${SECONDS} s): $*"; bounded python benchmarks/speed/fit_gpu.py --json "$W/$name.json" "$@" \
  || echo "($name failed: exit $?)"; }
yard() { local name=$1 mode=$2; echo "== $name: torch $mode, $m3 -b 2 -t $t -d $d3"; bounded python -m torch.distributed.run \
  --standalone --nproc-per-node=1 -m braidtrain.bench.torchref --mode "$mode" --model $m3 -i $WIDE -b 2 -t $t -d $d3 --steps 3 \
  --json "$W/$name.json" $dev || echo "($name failed: exit $?)"; }
steps="--steps 3 --warmup 1"
# planned MODEL D PLAN_FLAGS...: the planner's pick (its best row that fits this GPU and host) as train's flags
planned() { local model=$1 d=$2; shift 2; python -m braidtrain plan --model "$model" --gpus 1 --gpu-mem "$GPU_GB" -t $t \
  -d "$d" $c "$@" --json | python -c "import json, sys; r = next(r for r in json.load(sys.stdin)['layouts'] if r['fits']); \
print(f\"-b {r['b']} -z {r['zero']}\" + ' --recompute' * r['recompute'] + ' --offload optimizer' * r['offload'] \
+ (f\" --offload-ratio {r['ratio']:g}\" if r['offload'] and r['ratio'] < 1 else ''))"; }

[[ $parts == *" p "* ]] && fits 20 && { echo "== probe"; bounded python benchmarks/memory-plan/offload_probe.py $probe --json "$W/probe.json" \
  || echo "(probe failed: exit $?)"; }
if [[ $parts == *" b "* ]] && fits 320; then  # a pair or nothing (each ~3 minutes on the H200: the 8B build, pinning, ...)
  fit b-8b-262144-offload --model $m8 -i $WIDE -b 4 -t $t -d $d8b --offload optimizer $c $dev --steps 2 --warmup 1
  fit b-8b-262144-device --model $m8 -i $WIDE -b 4 -t $t -d $d8b --zero 0 --recompute $c $dev --steps 2 --warmup 1
fi
[[ $parts == *" a "* ]] && fits 150 && fit a-8b-65536 --model $m8 -i $WIDE $b8 -t $t -d $d8a --offload optimizer $c $dev $steps
if [[ $parts == *" c "* ]] && fits 120; then
  fit c-3b-offload --model $m3 -i $WIDE -b 2 -t $t -d $d3 --offload optimizer $c $dev $steps
  fit c-3b-device --model $m3 -i $WIDE -b 2 -t $t -d $d3 $c $dev $steps
  fits 40 && yard c-3b-fsdp2-offload fsdp2-offload
fi
if [[ $parts == *" i "* ]] && fits 200; then  # three runs of ~60 s (the 3B's build and compile, 3 steps)
  pick=$(planned $m3 $d3 -b 2 --offload) && echo "(i: the planner's pick: $pick)"
  fit i-3b-offload-planned --model $m3 -i $WIDE -t $t -d $d3 $pick $c $dev $steps
  fit i-3b-offload-whole --model $m3 -i $WIDE -b 2 -t $t -d $d3 --offload optimizer $c $dev $steps
  fits 40 && yard i-3b-fsdp2-offload fsdp2-offload
fi
if [[ $parts == *" ii "* ]] && fits 150; then  # the 8B's build, pinning its host state, 3 steps of ~7 s
  pick=$(planned $m8 $d8a --offload) && echo "(ii: the planner's pick: $pick)"
  fit ii-8b-65536-planned --model $m8 -i $WIDE -t $t -d $d8a $pick $c $dev $steps
fi
if [[ $parts == *" iii "* ]] && fits 200; then  # a pair or nothing: two runs of ~90 s (2 steps of ~13 s each)
  d3b=$([ "${SMOKE:-0}" = 1 ] && echo 1024 || echo 262144)
  pick=$(planned $m3 $d3b --offload) && base=$(planned $m3 $d3b --no-offload) \
    && echo "(iii: the planner's picks: $pick; without offload: $base)"
  fit iii-3b-262144-offload --model $m3 -i $WIDE -t $t -d $d3b $pick $c $dev --steps 2 --warmup 1
  fit iii-3b-262144-device --model $m3 -i $WIDE -t $t -d $d3b $base $c $dev --steps 2 --warmup 1
fi
if [[ $parts == *" 0 "* ]] && fits 40; then
  echo "== 0. exact mode, with and without --offload optimizer (llama3-tiny widened, 8 steps)"
  for off in "" "--offload optimizer"; do
    o=$(mktemp -d); bounded python -m braidtrain train --model llama3-tiny --n-layer 4 --n-embd 256 --n-head 4 --n-kv-heads 2 \
      -i data/shakespeare_bytes -b 4 -t 256 -d 4096 -x 8 --exact --val-every 0 --sample-tokens 0 --no-progress $dev $off \
      --out "$o" > "$o.log" 2>&1 || tail -3 "$o.log"
    python -c "import json; s = json.load(open('$o/summary.json')); print('exact ${off:-(device)}:', s['weights_sha256']); \
json.dump({'weights_sha256': s['weights_sha256']}, open('$W/exact${off:+-offload}.json', 'w'))" || echo "(exact ${off:-device}: no summary)"
    rm -rf "$o" "$o.log"
  done
fi
if [[ $parts == *" x "* ]]; then
  fits 60 && yard x-3b-fsdp2-offload-compile fsdp2-offload-compile
  # DeepSpeed ZeRO-Offload (ZeRO-2, CPU Adam), GPU only (on the CPU DeepSpeed compiles its shared-memory comm too)
  if [ "${SMOKE:-0}" != 1 ] && ls .whl/deepspeed-*.whl > /dev/null 2>&1 && fits 120; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ds-site .whl/*.whl \
      && PYTHONPATH=/tmp/ds-site:${PYTHONPATH:-} yard x-3b-deepspeed-offload deepspeed-offload
  fi
fi
echo "done in $SECONDS s"
python - "$W" "$OUT/offload_gpu.json" <<'PY'
import json, sys
from pathlib import Path
rows = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
Path(sys.argv[2]).write_text(json.dumps(rows, indent=1) + "\n")
cell = lambda v, f: "-" if v is None else format(v, f)
print(f"{'run':<28}{'tokens/s':>10}{'MFU':>7}{'GPU GB':>8}{'planned':>8}{'host GB':>9}{'planned':>8}{'step s':>8}"
      f"{'offload s':>10}{'planned':>8}")
for name, r in rows.items():
    if name == "probe" or name.startswith("exact"):
        continue
    if "step_s" in r and isinstance(r["step_s"], list):  # a torch yardstick (bench.torchref): step 0 is warm-up
        steps = r["step_s"][1:]
        tps = r["tokens_per_step"] * len(steps) / sum(steps)
        r = {"tokens_per_s": tps, "mfu": r["peak_flops"] and tps * r["flops_per_token"] / r["peak_flops"],
             "mem_gb": r["mem_gb"], "host_peak_gb": r["host_gb"], "step_s": sum(steps) / len(steps)}
    pct = lambda v: None if v is None else 100 * v
    print(f"{name:<28}{r['tokens_per_s']:>10,.0f}{cell(pct(r.get('mfu')), '.1f'):>7}{cell(r.get('mem_gb'), '.1f'):>8}"
          f"{cell(r.get('estimated_gb'), '.1f'):>8}{cell(r.get('host_peak_gb'), '.1f'):>9}"
          f"{cell(r.get('planned_host_gb'), '.1f'):>8}{cell(r.get('step_s'), '.2f'):>8}{cell(r.get('offload_s'), '.2f'):>10}"
          f"{cell(r.get('planned_offload_s'), '.2f'):>8}")
if "probe" in rows:
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows["probe"].items()))
hashes = [rows[k]["weights_sha256"] for k in ("exact", "exact-offload") if k in rows]
if hashes:
    print("exact weights_sha256:", " / ".join(h[:16] for h in hashes),
          "(the same)" if len(hashes) == 2 and hashes[0] == hashes[1] else "(DIFFERENT)" if len(hashes) == 2 else "")
PY
rm -rf "$W"
