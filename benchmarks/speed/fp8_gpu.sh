#!/usr/bin/env bash
# --fp8 on one H200 (from the repo root; data/shakespeare_bytes carried, and wheels/ for torchao's
# yardstick), its parts in as few device calls as fit:
#   3b, 1b  tokens/s of llama3.2-3b and llama3.2-1b, -b 4 -t 2048 -d 16384, --compile (the best
#           one-GPU layout: ZeRO-0) in bf16, --fp8 tensorwise and --fp8 rowwise: one `bench train`
#           a model, each variant its own job. The data: the byte corpus's ids spread over llama-3's
#           vocabulary (128,256: the real head). Each run's final checkpoint (38 GB at 3B) is refused
#           by a file-size limit (ulimit -f, --on-save-error continue): no disk, no time spent on it.
#   loss    gpt2's shape on the byte corpus, 300 steps (-b 8 -t 1024): bf16, --fp8 tensorwise and
#           --fp8 rowwise, their final losses compared and the curves plotted (fp8_loss.png);
#           --exact --fp8 tensorwise twice (40 steps): the same weights_sha256 both times; and
#           --compile --cuda-graph --fp8 tensorwise (300 steps) against the eager run's losses. These
#           six small runs share the GPU at once (no timing is read from them).
#   ao      torchao's float8 (its tensorwise and rowwise recipes on the same linears, torch.compile
#           of the whole model: braidtrain.bench.torchref's ao-*) on llama3.2-3b (or AO_MODEL) beside
#           braidtrain's --compile bf16 and --fp8 (RECIPES for both: the 3b part and torchao's, side
#           by side in one bench), if wheels/torchao-*.whl is there (installed into a scratch
#           folder, --no-deps); skipped, saying so, without it. Fetch it where there is a network:
#           `pip download --no-deps torchao==0.17.0 -d wheels/` (built for torch 2.11; wheels/ is
#           git-ignored: carry it to the GPU machine).
# A part whose expected time (EST below, H200 seconds: estimates until a call has measured them)
# would take the call past LIMIT seconds (default 560) is skipped, saying so, with the command that
# runs it: by the estimates, 3b and loss in a first call (~440 s), 1b in a second, ao in a third.
# Everything goes to $OUT (bench_*.json, loss_*.jsonl, fp8_loss.png, *.log, summary.txt); run
# directories are deleted.
# SMOKE=1: the same parts on the CPU with llama3-tiny and tiny, a few steps, no --compile and no
# CUDA graph (the plumbing: 3b, loss and 1b in ~6 minutes of a loaded 2-core VM; ao ~10 more).
# RECIPES='tensorwise': the 3b and 1b parts with that recipe only (a shorter call).
# Usage: OUT=/tmp/out bash benchmarks/speed/fp8_gpu.sh [3b loss 1b ao]   (default: all four, in that order)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
SMOKE=${SMOKE:-0}
parts=${*:-3b loss 1b ao}
declare -A EST=([3b]=330 [loss]=90 [1b]=220 [ao]=500)  # seconds each part took, or is expected to take, on an H200
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/fp8-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cd "$(dirname "$0")/../.."

if [ "$SMOKE" = 1 ]; then
  BIG=llama3-tiny SMALL_MODEL=llama3-tiny DEV="--device cpu" COMPILE="" STEPS=3 WARM=1 LIMIT=${LIMIT:-100000}
  SHAPE="-b 2 -t 64 -d 256" LOSS_MODEL="--model tiny" LOSS_SHAPE="-b 4 -t 64 -d 256" LOSS_STEPS=20 EXACT_STEPS=4
  GRAPH=""  # (no CUDA graph on the CPU, and no --compile in the smoke run: the eager step again)
else
  BIG=llama3.2-3b SMALL_MODEL=llama3.2-1b DEV="" COMPILE="--compile" STEPS=10 WARM=4 LIMIT=${LIMIT:-560}
  SHAPE="-b 4 -t 2048 -d 16384" LOSS_MODEL="--model gpt2" LOSS_SHAPE="-b 8 -t 1024 -d 8192" LOSS_STEPS=300 EXACT_STEPS=40
  GRAPH="--compile --cuda-graph"
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
fi
python -c "import torch; print('torch', torch.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null

late() {  # late PART: true (and says so) when PART would end past the limit
  if [ $((SECONDS + ${EST[$1]})) -gt "$LIMIT" ]; then
    echo "== $1: skipped, ${SECONDS} s gone + ~${EST[$1]} s > ${LIMIT} s (run: bash benchmarks/speed/fp8_gpu.sh $1)" | tee -a "$OUT/summary.txt"
    return 0
  fi
  return 1
}

# llama-3's vocabulary: each byte id b becomes 500 b + 7 (distinct ids below 128,256), in llama-3's layout
IDS=$WORK/llama3_ids
python - "$IDS" <<'EOF'
import sys
from pathlib import Path
from braidtrain.io.data import read_bin, resolve_files, write_bin
out = Path(sys.argv[1]); out.mkdir(parents=True)
for split in ("train", "val"):
    (src,) = resolve_files("data/shakespeare_bytes", split)
    write_bin(out / f"ids_{split}_000000.bin", read_bin(src).astype("uint32") * 500 + 7, vocab_size=128256)
EOF

# (--loss-tol 0.1: after these few steps float8's loss stands up to 9% above bf16's, torchao's and
# braidtrain's float8 within 1% of each other; the loss part's 300 steps are the loss criterion)
bench() {  # bench NAME MODEL [bench train args]: one model's variants, the table in NAME.log, rows in bench_NAME.json
  local name=$1 model=$2
  shift 2
  echo "== $name: $model ($SECONDS s in)"
  # (a subshell: the file-size limit stops each run's final checkpoint, not this script's files)
  ( ulimit -f 2000000
    python -m braidtrain bench train --model "$model" -i "$IDS" $SHAPE --steps $STEPS --warmup $WARM --nproc 1 $DEV \
      --loss-tol 0.1 --json "$OUT/bench_$name.json" "$@" ) > "$OUT/$name.log" 2>&1
  echo "exit $? ($SECONDS s in)"; grep -vE "^\[|Warning|warn" "$OUT/$name.log" | tail -12
}
keep="--on-save-error continue"
three=(--layout="$COMPILE $keep")  # bf16, then each recipe of RECIPES (default both)
for r in ${RECIPES:-tensorwise rowwise}; do three+=(--layout="$COMPILE --fp8 $r $keep"); done

for part in $parts; do
  case $part in
  3b) late 3b || bench 3b $BIG "${three[@]}" --torch '' ;;
  1b) late 1b || bench 1b $SMALL_MODEL "${three[@]}" --torch '' ;;
  loss)
    late loss && continue
    echo "== loss: $LOSS_STEPS steps, bf16 and both recipes; --exact --fp8 tensorwise twice ($SECONDS s in)"
    R=$WORK/loss
    common="$LOSS_MODEL -i data/shakespeare_bytes $LOSS_SHAPE --val-every 100 --sample-tokens 0 --no-progress $DEV"
    python -m braidtrain train $common -x $LOSS_STEPS --out $R/bf16 > "$OUT/loss_bf16.log" 2>&1 &
    python -m braidtrain train $common -x $LOSS_STEPS --fp8 tensorwise --out $R/tensorwise > "$OUT/loss_tensorwise.log" 2>&1 &
    python -m braidtrain train $common -x $LOSS_STEPS --fp8 rowwise --out $R/rowwise > "$OUT/loss_rowwise.log" 2>&1 &
    for k in 1 2; do
      python -m braidtrain train $common -x $EXACT_STEPS --exact --fp8 tensorwise --out $R/exact$k > "$OUT/exact$k.log" 2>&1 &
    done
    python -m braidtrain train $common -x $LOSS_STEPS $GRAPH --fp8 tensorwise --out $R/graph > "$OUT/graph.log" 2>&1 &
    wait
    for run in bf16 tensorwise rowwise exact1 exact2 graph; do
      cp $R/$run/metrics.jsonl "$OUT/loss_$run.jsonl" 2>/dev/null || { echo "$run failed:"; tail -3 "$OUT/"*"$run.log"; }
    done
    python -m braidtrain plot $R/bf16 $R/tensorwise $R/rowwise --out "$OUT/fp8_loss.png" 2>&1 | tail -2
    python - $R "$GRAPH" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
R = Path(sys.argv[1])
s = {r: json.loads((R / r / "summary.json").read_text()) for r in ("bf16", "tensorwise", "rowwise", "exact1", "exact2", "graph")
     if (R / r / "summary.json").is_file()}
if "bf16" in s:
    for r in ("bf16", "tensorwise", "rowwise"):
        if r in s:
            print(f"loss {r}: final train {s[r]['loss']:.4f} val {s[r]['val_loss']:.4f} "
                  f"({(s[r]['loss'] / s['bf16']['loss'] - 1) * 100:+.2f}% train, "
                  f"{(s[r]['val_loss'] / s['bf16']['val_loss'] - 1) * 100:+.2f}% val against bf16)")
metrics = lambda r: [json.loads(l)["loss"] for l in (R / r / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
if "graph" in s and "tensorwise" in s:
    a, b = metrics("graph"), metrics("tensorwise")
    worst = max(abs(x - y) / y for x, y in zip(a[:40], b[:40]))
    print(f"--fp8 tensorwise with {sys.argv[2]!r}: the first 40 steps' losses within {worst * 100:.3f}% of the eager "
          f"run's; final {s['graph']['loss']:.4f} against {s['tensorwise']['loss']:.4f}")
shas = [s[r]["weights_sha256"] for r in ("exact1", "exact2") if r in s]
if len(shas) == 2:
    print(f"--exact --fp8 tensorwise twice: {'the same' if shas[0] == shas[1] else 'DIFFERENT'} weights_sha256 {shas[0][:16]} {shas[1][:16]}")
EOF
    rm -rf $R ;;
  ao)
    late ao && continue
    whl=$(ls wheels/torchao-*.whl 2>/dev/null | head -1)
    if [ -z "$whl" ]; then echo "== ao: skipped, no wheels/torchao-*.whl" | tee -a "$OUT/summary.txt"; continue; fi
    pip install -q --no-deps --target "$WORK/ao" "$whl" > "$OUT/ao_install.log" 2>&1 \
      || { echo "== ao: skipped, $whl did not install" | tee -a "$OUT/summary.txt"; continue; }
    aos=$(for r in ${RECIPES:-tensorwise rowwise}; do printf "ao-%s," "$r"; done)
    PYTHONPATH="$WORK/ao${PYTHONPATH:+:$PYTHONPATH}" bench ao ${AO_MODEL:-$BIG} "${three[@]}" \
      --torch "${aos%,}" --baseline "${aos%%,*}" ;;
  *) echo "unknown part $part: use 3b, 1b, loss, ao" ;;
  esac
done

# tokens/s of each variant against its model's braidtrain bf16 run
python - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("3b", "1b", "ao"):
    path = out / f"bench_{name}.json"
    if not path.is_file():
        continue
    rows = json.loads(path.read_text())
    base = next((r for r in rows if "--fp8" not in r["variant"] and r["variant"].startswith("braidtrain") and "error" not in r), None)
    for r in rows:
        if "error" in r:
            print(f"{name}: {r['variant']}: FAILED {r['error']}")
            continue
        x = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x bf16" if base else ""
        mem = f"{r['mem_gb']:.1f} GB" if r.get("mem_gb") is not None else ""
        print(f"{name}: {r['variant']:<60} {r['tokens_per_s']:>9,.0f} tokens/s {x:>11}  {mem:>8}  loss {r['loss']:.4f}")
EOF
echo "done in $SECONDS s"
