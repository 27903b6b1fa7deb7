"""How fast does a run notice a failure and get going again? (docs/fault-tolerance.md records the output)

Two scenarios, each under `torchrun --max-restarts 1`, on the tiny model (CPU, gloo):

  kill    rank 2 is SIGKILLed in the middle of a step (BRAIDTRAIN_FAULT test hook). Measured: from
          the kill to the survivors' flight logs (torchrun noticed and stopped them), to the restarted
          group's "resumed from" line, and to its first completed step (metrics.jsonl).
  stop    rank 1 is frozen with SIGSTOP. Measured: from the freeze to the survivors' flight logs (the
          heartbeat), and to the first completed step after the restart -- which includes torchrun's
          own 30 s grace before it SIGKILLs a worker that ignores SIGTERM (a stopped one must).

    python benchmarks/fault/fault_recovery.py [--nproc 4] [--repeat 3] [--heartbeat-timeout 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--model", "tiny", "-b", "2", "-t", "128", "--val-every", "0", "--sample-tokens", "0", "--no-progress"]


def run_once(data: Path, work: Path, nproc: int, fault: str, heartbeat: float) -> dict:
    run = work / f"run-{time.time_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), BRAIDTRAIN_FAULT=fault)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=1",
           "-m", "braidtrain", "train", *MODEL, "-i", str(data), "-d", str(2 * 128 * nproc), "-x", "12",
           "--ckpt-every", "4", "--out", str(run), "--heartbeat-timeout", str(heartbeat)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events: dict[str, float] = {}
    lines: list[str] = []

    def read():
        for line in iter(p.stdout.readline, ""):
            lines.append(line)
            if "fault injected" in line:
                events["fault"] = float(line.rsplit("t=", 1)[1].rstrip(")\n"))
            if "resumed from" in line:
                events.setdefault("resumed", time.time())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while p.poll() is None:  # the first metrics record that carries load_s is the first step after the resume
        m = run / "metrics.jsonl"
        if "first_step" not in events and m.is_file() and '"load_s"' in m.read_text():
            events["first_step"] = time.time()
        time.sleep(0.05)
    reader.join(5)
    if p.returncode != 0 or "fault" not in events:
        raise SystemExit(f"run failed ({p.returncode}):\n{''.join(lines)[-4000:]}")
    dumps = [json.loads(f.read_text().splitlines()[0])["time"] for f in (run / "flight").glob("rank_*.jsonl")]
    t0 = events["fault"]
    return {"detected_s": max(dumps) - t0, "first_dump_s": min(dumps) - t0,
            "resumed_s": events["resumed"] - t0, "first_step_s": events["first_step"] - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0)
    ap.add_argument("--data", help="prepared token data (default: byte-level Shakespeare, prepared in a temp dir)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="braidtrain-fault-"))
    data = Path(args.data) if args.data else work / "data"
    if not args.data:
        subprocess.run([sys.executable, "-m", "braidtrain", "data", "prepare", "--corpus", "shakespeare", "--tokenizer",
                        "bytes", "--out", str(data)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       check=True, capture_output=True)
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.node()}: {os.cpu_count()} cores, {args.nproc} ranks (gloo), "
          f"heartbeat timeout {args.heartbeat_timeout:g} s, {args.repeat} runs each; seconds after the fault")
    print("| fault | flight logs written | group resumed | first step after resume |")
    print("|---|---|---|---|")
    for name, fault in (("SIGKILL rank "
                         "2, step 10", "kill:rank=2:step=10"), ("SIGSTOP rank 1, step 10", "stop:rank=1:step=10")):
        rs = [run_once(data, work, args.nproc, fault, args.heartbeat_timeout) for _ in range(args.repeat)]
        col = lambda k: f"{statistics.median(r[k] for r in rs):.1f} (max {max(r[k] for r in rs):.1f})"
        print(f"| {name} | {col('detected_s')} | {col('resumed_s')} | {col('first_step_s')} |", flush=True)


if __name__ == "__main__":
    main()
