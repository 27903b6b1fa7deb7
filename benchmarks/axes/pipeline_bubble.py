"""The pipeline's bubble, measured against the planner's model of it, on CPU processes (gloo).

For each schedule and number of micro-batches m, a real `braidtrain train` of --pp stages (one
process each, dp = 1) runs a few steps; its metrics give each stage's bubble per step (1 - work /
span of work, parallel/schedule.py's timing), its schedule.json every rank's timed work of the last
step. Printed per run, stage by stage:

    measured     the mean bubble over the steps after the first two (train's: 1 - the stage's
                 work / its pass's span, from the step's start to its last work)
    simulated    pipeline.simulate -- what the planner runs -- on the same plan, with each
                 (op, chunk)'s cost the mean of its measured durations and transfers free: the
                 model's error, once the costs are right
    formula      rank 0's closed form with F = 1, B = 2 (zb: B = W = 1): (p-1)/(m+p-1) for gpipe
                 and 1f1b, (p-1)/(v*m+p-1) interleaved, (p-1)/(3m+p-1) zb

Usage (repo root; bytes data from `braidtrain data prepare --tokenizer bytes`):
    python benchmarks/axes/pipeline_bubble.py --data data/shakespeare_bytes [--pp 4] [--micro 8 16]
Processes beyond the cores wait their turn: the bubble on an oversubscribed machine is the
scheduler's as much as the pipeline's (say so next to any figure quoted).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from braidtrain.parallel import pipeline  # noqa: E402


def run(args, schedule: str, m: int, out: Path) -> tuple[list[float], dict]:
    d = m * args.b * args.t
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.pp}",
           "-m", "braidtrain", "train", "--model", "tiny", "--n-layer", str(args.layers), "--n-embd", str(args.width),
           "--n-head", "4", "-i", args.data, "-b", str(args.b), "-t", str(args.t), "-d", str(d),
           "-x", str(args.steps), "--val-every", "0", "--sample-tokens", "0", "--no-progress",
           "--pp", str(args.pp), "--pp-schedule", schedule, "--device", "cpu", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"{schedule} m={m} failed:\n{p.stderr[-2000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"bubble"' in line]
    measured = [statistics.mean(s["bubble"][r] for s in steps[2:]) for r in range(args.pp)]
    return measured, json.loads((out / "schedule.json").read_text())


def simulated(sched: dict, m: int) -> list[float]:
    """Each stage's bubble from pipeline.simulate, with the measured mean cost of each (op, chunk)."""
    pp, v = sched["pp"], sched["virtual"]
    times = {}
    for events in sched["ranks"]:
        for op, chunk, _micro, start, end in events:
            times.setdefault((op, chunk), []).append(end - start)
    cost = {k: statistics.mean(x) for k, x in times.items()}
    ranks = pipeline.simulate(pipeline.build(sched["schedule"], pp, v, m), pp, lambda a: cost[a.op, a.stage])
    return [1 - r["busy"] / r["end"] for r in ranks]


def formula(name: str, pp: int, m: int) -> float:
    v = 2 if name == "interleaved" else 1
    return (pp - 1) / ({"zb": 3 * m}.get(name, v * m) + pp - 1)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--data", required=True)
    a.add_argument("--pp", type=int, default=4)
    a.add_argument("--micro", type=int, nargs="+", default=[8, 16])
    a.add_argument("--schedules", nargs="+", default=list(pipeline.SCHEDULES))
    a.add_argument("--layers", type=int, default=8)
    a.add_argument("--width", type=int, default=256)
    a.add_argument("-b", type=int, default=4)
    a.add_argument("-t", type=int, default=128)
    a.add_argument("--steps", type=int, default=6)
    a.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    args = a.parse_args()
    pct = lambda xs: " ".join(f"{100 * x:4.0f}%" for x in xs)
    print(f"pp {args.pp}, tiny GPT {args.layers} layers x {args.width}, b {args.b}, t {args.t}, "
          f"{os.cpu_count()} cores, {args.threads} thread(s) a process; bubble by stage")
    print(f"{'schedule':<12}{'m':>4}  {'measured':<28}{'simulated (measured costs)':<30}{'formula, rank 0':>16}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.schedules:
            for m in args.micro:
                measured, sched = run(args, name, m, Path(tmp) / f"{name}-{m}")
                print(f"{name:<12}{m:>4}  {pct(measured):<28}{pct(simulated(sched, m)):<30}"
                      f"{100 * formula(name, args.pp, m):>15.0f}%", flush=True)


if __name__ == "__main__":
    main()
