"""`braidtrain plan --check`: train a layout for two steps and compare the planner's memory
estimate with what the run measured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch

from braidtrain.errors import UserError
from braidtrain.layout import make_layout
from braidtrain.model import registry
from braidtrain.plan.estimate import estimate
from braidtrain.plan.memory import GB
from braidtrain.plan.report import row_json
from braidtrain.plan.space import Candidate, Setup


def check_layout(args) -> Candidate:
    """The layout of --check ZERO,B[,recompute] or of -z, -b, --recompute; the mesh from --tp, --sp,
    --pp and --pp-schedule (default 1f1b); --offload (--offload-ratio R): with --offload optimizer (at R)."""
    tp, pp, cp = args.tp or 1, args.pp or 1, args.cp or 1
    mesh = dict(dp=args.gpus // (tp * pp * cp), tp=tp, sp=bool(args.sp), pp=pp, cp=cp, ep=args.ep or 1,
                offload=bool(args.offload) or args.offload_ratio is not None, ratio=args.offload_ratio or 1.0)
    if pp > 1:
        mesh.update(schedule=args.pp_schedule or "1f1b", virtual=2 if args.pp_schedule == "interleaved" else 1)
    if not args.check:  # the layout from the flags
        if args.zero is None or args.batch_size is None:
            raise UserError("--check needs a layout: --check ZERO,B[,recompute], or -z ZERO -b B [--recompute] "
                            "(and --tp N [--sp])")
        return Candidate(zero=args.zero, b=args.batch_size, recompute=bool(args.recompute), **mesh)
    m = re.fullmatch(r"([0-3]),([1-9][0-9]*)(,recompute)?", args.check.replace(" ", ""))
    if not m:
        raise UserError(f"--check {args.check!r}: use ZERO,B or ZERO,B,recompute with ZERO 0-3 (e.g. 1,8)")
    return Candidate(zero=int(m[1]), b=int(m[2]), recompute=bool(m[3]), **mesh)


def check(s: Setup, lay: Candidate, data: str, out: str | None) -> dict:
    """Two real training steps of this layout (the first optimizer step, which creates Adam's
    state, included), then estimated vs measured mem_gb. On a GPU that is torch's peak
    allocation, compared with `allocated`; on the CPU it is the model state a rank holds between
    steps (params + grads + Adam m, v), compared with the model state less its transient part.
    Under tp both are one rank's: its shards and the replicated parameters (rank 0's mem_gb); under
    pp rank 0's, the first stage's."""
    s = replace(s, cpu=not torch.cuda.is_available())  # where `braidtrain train` will run
    make_layout(lay.gpus, s.cfg, seq_len=s.t, batch_size=lay.b, total_batch=s.d, world_name=f"--gpus {lay.gpus}",
                **lay.layout_kw())  # what `train` will ask
    e, c = estimate(s, lay), s.cfg
    cmd = ["-m", "braidtrain", "train", *registry.command_line(c), "-i", data, "-b", lay.b, "-t", s.t, "-d", s.d,
           "-z", lay.zero, "-x", 2, "--val-every", 0, "--sample-tokens", 0, "--no-progress",
           "--bucket-mb", s.bucket_mb] + (["--tp", lay.tp] if lay.tp > 1 else []) + (["--sp"] if lay.sp else [])
    cmd += ["--pp", lay.pp, "--pp-schedule", lay.schedule, "--pp-virtual", lay.virtual] if lay.pp > 1 else []
    cmd += ["--recompute"] if lay.recompute else []
    cmd += ["--cp", lay.cp, "--cp-impl", lay.cp_impl] if lay.cp > 1 else []
    cmd += ["--ep", lay.ep] if lay.ep > 1 else []
    cmd += ["--fp8", s.fp8] if s.fp8 else []
    cmd += ["--compile"] if s.compile else []
    cmd += ["--offload", "optimizer"] if lay.offload else []
    cmd += ["--offload-ratio", lay.ratio] if lay.offload and lay.ratio < 1 else []
    if lay.gpus > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={lay.gpus}"] + cmd
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(out or tmp)
        p = run_job([sys.executable, *map(str, cmd), "--out", str(run_dir)])
        if p.returncode:
            lines = ([line for line in p.stderr.splitlines() if "error" in line.lower()] or p.stderr.splitlines()
                     or ["no output"])
            raise UserError(f"the --check run failed (exit {p.returncode}): {lines[-1].strip()}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        measured = max(r["mem_gb"] for r in records)
    st = e["stage_state"][0] if lay.pp > 1 else e["state"]  # rank 0's: the first stage's
    est = (st["params"] + st["grads"] + st["optimizer"] - st["transient"] if s.cpu else e["allocated"]) / GB
    r = {"layout": asdict(lay), "device": "cpu" if s.cpu else "cuda", "estimated_gb": est,
         "measured_gb": measured, "rel_error": (est - measured) / measured, "estimate": row_json(e),
         "compared": "model state between steps" if s.cpu else "peak allocated (model state + activations)"}
    if lay.offload:
        # a rank's share of the node's planned host bytes, against what the run measured (metrics'
        # host_gb: the offloaded state's bytes on the CPU; on a GPU the rank's peak resident memory,
        # which also holds the process itself -- torch, CUDA's host side, the data's pages)
        host = e["host"] / min(s.gpus, s.gpus_per_node or s.gpus) / GB
        got = max(rec["host_gb"] for rec in records)
        r.update(host_estimated_gb=host, host_measured_gb=got, host_rel_error=(host - got) / got)
    return r


def run_job(cmd: list) -> subprocess.CompletedProcess:
    """The check's run, its output captured (the tests fork it instead: tests/helpers.forked)."""
    return subprocess.run(cmd, capture_output=True, text=True)
