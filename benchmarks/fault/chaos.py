"""Chaos: does every interrupted run end exactly as one that never failed? (docs/fault-tolerance.md)

Each trial draws, from --seed: a fault (SIGKILL or SIGSTOP of a random rank at a random step), a
ZeRO stage (0-3), a world size for the run (2 or 4) and another for its restart (1, 2 or 4). The
run trains `tiny` in exact mode under `torchrun --max-restarts 0` with a checkpoint every 3 steps
until the fault ends it (a frozen rank: the heartbeat, --heartbeat-timeout 5, and a survivor ends
it); the restart is a new torchrun on the other world size with `--resume auto`, to the end. The
trial passes when its final weights_sha256 is the uninterrupted run's (exact mode: the same bits
on any dp and ZeRO stage). Timed: the fault to the survivors' exit, and to the restart's
"resumed from" line (which includes starting the new torchrun). One line per trial, then a
summary; exit 1 if any trial failed.

    python benchmarks/fault/chaos.py --trials 10 [--seed 0] [--data data/shakespeare_bytes]

--live: live recovery instead (braidtrain/live/). Each trial starts 4 ranks with scripts/live.sh
(one process each, -pi tcp, --live-recovery) at a random ZeRO stage (0-3; 1-3 keep each shard's
buddy copy, parallel/mirror.py) and SIGKILLs or SIGSTOPs a random rank other than 0 (rank 0 hosts
the rendezvous store) at a random step; the survivors must finish in the processes they started
in, every step logged once, with the uninterrupted run's weights. Timed: the fault to the completion of the step it interrupted (rank
0's "live: step N completed" line). --against-restart K also runs the first K trials' faults on today's
restart path (torchrun, --max-restarts 0, then a new torchrun with --resume auto, same world) and
times the same thing there: the "resumed from" line plus the redone steps' step_s up to that step.

    python benchmarks/fault/chaos.py --live --trials 20 [--against-restart K]

--layout tp|pp|cp (with --live): each replica 2 ranks along that axis, --nproc ranks in all (4: two
replicas, ZeRO-0; 8: four, a random ZeRO stage -- 0-2 under pp). The fault strikes a random rank
outside replica 0 (rank 0's: it hosts the store); its replica is retired (live/replicas.py), its
other rank must leave in one line, exit 0, and the other replicas go on, bitwise as ever (the
reference runs the same axis at 2: exact mode's bits depend on tp and cp).

    python benchmarks/fault/chaos.py --live --layout tp --nproc 8 --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS, D = 12, 1024  # -d 1024 = b 2 x t 128 x 4 micro-steps at dp 1: a power of two at dp 1, 2 and 4
MODEL = ["--model", "tiny", "-b", "2", "-t", "128", "-d", str(D), "-x", str(STEPS), "--exact", "--val-every", "0",
         "--sample-tokens", "0", "--no-progress", "--ckpt-every", "3", "--heartbeat-timeout", "5"]


def torchrun(nproc: int, args: list, env: dict, log: Path) -> tuple[int, dict]:
    """Run, timing the lines that matter; returns (exit code, {event: seconds since the epoch})."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
           "-m", "braidtrain", "train", *map(str, args)]
    events = {}
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            f.write(line)
            for key in ("fault injected", "peer lost", "resumed from"):
                if key in line and key not in events:
                    events[key] = time.time()
        p.wait()
    events["exit"] = time.time()
    return p.returncode, events


def trial(k: int, rnd: random.Random, data: str, work: Path, want: str) -> dict:
    kind, zero = rnd.choice(["kill", "stop"]), rnd.randrange(4)
    n1, n2 = rnd.choice([2, 4]), rnd.choice([1, 2, 4])
    rank, step = rnd.randrange(n1), rnd.randrange(4, STEPS)  # after the first checkpoint (step 3)
    run = work / f"trial{k}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    args = [*MODEL, "-i", data, "-z", zero, "--out", run]
    rc1, ev1 = torchrun(n1, args, dict(env, BRAIDTRAIN_FAULT=f"{kind}:step={step}:rank={rank}"), work / f"trial{k}-a.log")
    rc2, ev2 = torchrun(n2, [*args, "--resume", "auto"], env, work / f"trial{k}-b.log")
    summary = run / "summary.json"
    got = json.loads(summary.read_text())["weights_sha256"] if summary.is_file() else None
    t0 = ev1.get("fault injected")
    return {"trial": k, "fault": f"{kind} rank {rank} at step {step}", "zero": zero, "world": f"{n1} -> {n2}",
            "first_exit": rc1, "ok": rc1 != 0 and rc2 == 0 and got == want,
            "to_exit_s": ev1["exit"] - t0 if t0 else None,
            # a frozen rank ended by a survivor's heartbeat (fault.Guard._end_frozen), not by torchrun's SIGKILL 30 s on
            "ended_by_peer": f"ended rank {rank} (pid" in (work / f"trial{k}-a.log").read_text(),
            "to_resumed_s": ev2["resumed from"] - t0 if t0 and "resumed from" in ev2 else None}


LIVE_D = 2048  # 2 micro-batches a rank at dp 4: a lost rank's two go to two of the three others


def live_args(data: str, run: Path, zero: int = 0, layout: str | None = None) -> list:
    args = [a if a != str(D) else str(LIVE_D) for a in MODEL]  # (a bucket a block: ZeRO-3 gathers every micro-batch)
    return [*args, "-z", zero, "--bucket-mb", "0.5", "-i", data, "--out", run, *(["--" + layout, 2] if layout else [])]


def replica(r: int, layout: str | None, n: int) -> int:
    """Rank r's replica (data-parallel index) with 2 ranks along `layout` (mesh.py's grid: pp outermost)."""
    return r if layout is None else r % (n // 2) if layout == "pp" else r // 2


def live_trial(k: int, rnd: random.Random, data: str, work: Path, want: str, against: bool, layout: str | None = None,
               n: int = 4) -> dict:
    outside = [r for r in range(n) if replica(r, layout, n) != 0]  # (replica 0 holds rank 0, the store's host)
    kind, rank, step = rnd.choice(["kill", "stop"]), rnd.choice(outside), rnd.randrange(4, STEPS + 1)  # (as trial())
    if not layout:
        zero = rnd.randrange(4)
    else:  # (ZeRO 1-3 over a replica group of one: no; ZeRO-3 with a pipeline: no)
        zero = rnd.randrange(3 if layout == "pp" else 4) if n // 2 > 2 else 0
    gone = [r for r in range(n) if replica(r, layout, n) == replica(rank, layout, n)]
    run = work / f"live{k}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NPROC=str(n),
               BRAIDTRAIN_FAULT=f"{kind}:step={step}:rank={rank}")
    p = subprocess.run([str(ROOT / "scripts" / "live.sh"), *map(str, live_args(data, run, zero, layout))], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    (work / f"live{k}.log").write_text(p.stdout + p.stderr)
    t0 = re.search(r"fault injected: .* at step \d+ \(t=([\d.]+)\)", p.stderr)
    t1 = re.search(rf"live: step {step} completed by ranks ([\d,]+) \(t=([\d.]+)\)", p.stdout)
    pids = {int(r): int(x) for r, x in re.findall(r"live.sh: rank (\d+): pid (\d+)", p.stderr)}
    summary, changes = run / "summary.json", run / "flight" / "membership.jsonl"
    got = json.loads(summary.read_text())["weights_sha256"] if summary.is_file() else None
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").is_file() else []
    moved = [json.loads(line) for line in changes.read_text().splitlines()] if changes.is_file() else []
    same_pids = len(moved) == 1 and {int(r): x for r, x in moved[0]["pids"].items()} == \
        {r: x for r, x in pids.items() if r not in gone}
    left = [r for r in gone if r != rank]  # a retired replica's other ranks: one line each, exit 0
    said = all(f"braidtrain: rank {r}: its replica (data-parallel index {replica(r, layout, n)}) was retired" in p.stderr
               and f"live.sh: rank {r} (pid {pids.get(r)}) exited 0" in p.stderr for r in left)
    r = {"trial": k, "fault": f"{kind} rank {rank} at step {step}", "zero": zero, "world": f"{n} -> {n - len(gone)}",
         "ok": p.returncode == 0 and got == want and steps == list(range(1, STEPS + 1)) and same_pids and said,
         "same_pids": same_pids, "live_s": float(t1.group(2)) - float(t0.group(1)) if t0 and t1 else None}
    if against:
        r["restart_s"] = restart_time(k, kind, rank, step, zero, data, work, layout, n)
    return r


def restart_time(k: int, kind: str, rank: int, step: int, zero: int, data: str, work: Path, layout: str | None = None,
                 n: int = 4) -> float | None:
    """Today's path for the same fault: seconds from the fault to the end of the step it interrupted."""
    run = work / f"restart{k}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    args = [*live_args(data, run, zero, layout)]
    _, ev1 = torchrun(n, args, dict(env, BRAIDTRAIN_FAULT=f"{kind}:step={step}:rank={rank}"), work / f"restart{k}-a.log")
    rc, ev2 = torchrun(n, [*args, "--resume", "auto"], env, work / f"restart{k}-b.log")
    t0 = ev1.get("fault injected")
    if rc or not t0 or "resumed from" not in ev2:
        return None
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = recs[max(i for i, x in enumerate(recs) if "load_s" in x):]
    return ev2["resumed from"] - t0 + sum(x["step_s"] for x in after if x["step"] <= step)


def live_main(a) -> int:
    rnd = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="braidtrain-chaos-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        rc, _ = torchrun(2, live_args(a.data, work / "ref", layout=a.layout), env, work / "ref.log")
        if rc:
            print((work / "ref.log").read_text()[-3000:], file=sys.stderr)
            return 1
        want = json.loads((work / "ref" / "summary.json").read_text())["weights_sha256"]
        rows = []
        fmt = lambda x: "-" if x is None else f"{x:.1f} s"
        for k in range(a.trials):
            r = live_trial(k, rnd, a.data, work, want, k < a.against_restart, a.layout, a.nproc)
            rows.append(r)
            print(f"trial {k}: {r['fault']}, ZeRO-{r['zero']}, world {r['world']}: "
                  f"{'bitwise equal, survivors the same processes' if r['ok'] else 'FAILED'}; fault to that step "
                  "completed "
                  f"{fmt(r['live_s'])}" + (f" (restart path: {fmt(r['restart_s'])})" if "restart_s" in r else ""),
                  flush=True)
            if not r["ok"]:
                print((work / f"live{k}.log").read_text()[-3000:], file=sys.stderr)
    passed = sum(r["ok"] for r in rows)
    for kind in ("kill", "stop"):
        for key, what in (("live_s", "live"), ("restart_s", "restart path")):
            t = sorted(r[key] for r in rows if r["fault"].startswith(kind) and r.get(key) is not None)
            if t:
                print(f"{kind}: fault to the interrupted step completed, {what}: median {t[len(t) // 2]:.1f} s, "
                      f"max {t[-1]:.1f} s ({len(t)} trials)")
    print(f"{passed} of {len(rows)} trials bitwise equal to the uninterrupted run, in the same processes")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if passed == len(rows) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default="data/shakespeare_bytes")
    ap.add_argument("--json", help="also write the trials here")
    ap.add_argument("--live", action="store_true", help="live recovery (scripts/live.sh) instead of the restart")
    ap.add_argument("--against-restart", type=int, default=0, metavar="K",
                    help="--live: time the first K trials' faults on the restart path too")
    ap.add_argument("--layout", choices=("tp", "pp", "cp"), help="--live: replicas of 2 ranks along this axis")
    ap.add_argument("--nproc", type=int, default=4, help="--live: ranks (4 or 8)")
    a = ap.parse_args()
    if a.layout and not a.live:
        ap.error("--layout goes with --live")
    if a.live:
        return live_main(a)
    rnd = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="braidtrain-chaos-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        rc, _ = torchrun(2, [*MODEL, "-i", a.data, "--out", work / "ref"], env, work / "ref.log")
        if rc:
            print((work / "ref.log").read_text()[-3000:], file=sys.stderr)
            return 1
        want = json.loads((work / "ref" / "summary.json").read_text())["weights_sha256"]
        rows = []
        for k in range(a.trials):
            r = trial(k, rnd, a.data, work, want)
            rows.append(r)
            fmt = lambda x: "-" if x is None else f"{x:.1f} s"
            print(f"trial {k}: {r['fault']}, ZeRO-{r['zero']}, world {r['world']}: "
                  f"{'bitwise equal' if r['ok'] else 'FAILED'}; fault to exit {fmt(r['to_exit_s'])}, "
                  f"to resumed {fmt(r['to_resumed_s'])}", flush=True)
            if not r["ok"]:
                for part in "ab":
                    print((work / f"trial{k}-{part}.log").read_text()[-2000:], file=sys.stderr)
    passed = sum(r["ok"] for r in rows)
    for kind in ("kill", "stop"):
        t = sorted(r["to_resumed_s"] for r in rows if r["fault"].startswith(kind) and r["to_resumed_s"] is not None)
        if t:
            print(f"{kind}: fault to resumed, median {t[len(t) // 2]:.1f} s, max {t[-1]:.1f} s ({len(t)} trials)")
    print(f"{passed} of {len(rows)} trials bitwise equal to the uninterrupted run")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
