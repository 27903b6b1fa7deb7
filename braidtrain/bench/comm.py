"""`braidtrain bench comm`: what the collectives of this machine and backend deliver.

Run under torchrun (one process a GPU, or CPU processes with gloo). For each operation and message
size from --min-bytes to --max-bytes (x4 a row), after warm-up iterations, the mean time of
--iters iterations (on CUDA the GPU's time, queued ahead so that the host's launch cost is not
counted: _time), then nccl-tests' accounting (its PERFORMANCE.md): algbw = S / t with S the
size of the whole message -- the buffer of an all-reduce, the concatenated buffer of a
reduce-scatter, all-gather and all-to-all --, and busbw = algbw x the bus factor, which makes
the figures of different operations comparable with the link speed:

    all_reduce 2(n-1)/n    reduce_scatter, all_gather, all_to_all (n-1)/n    send_recv 1
    exact_reduce_scatter (n-1)/n  (its all-to-all; the pairwise sum is local)

Each operation's result is checked once against what it must be before it is timed.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from braidtrain.bench.flags import OPS
from braidtrain.collective.comm import Comm, bus_factor
from braidtrain.collective.mesh import build_mesh
from braidtrain.collective.runtime import init_runtime
from braidtrain.errors import UserError
from braidtrain.io import paths

SLEEP_CYCLES = 2_000_000  # bench comm on CUDA: GPU sleep per queued launch (~1 ms, several launches' time)


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], max(4, lo)
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _setup(op, nbytes, n, r, device):
    """Buffers for one op and size, filled so that the result is known: rank r holds r + 1."""
    count = max(n, nbytes // 4 // n * n)  # fp32 elements, divisible by n
    x = torch.full((count,), float(r + 1), device=device)
    total = n * (n + 1) / 2
    if op == "all_reduce":
        return (x,), lambda: bool((x == total).all()) if n > 1 else True, count * 4
    if op in ("reduce_scatter", "exact_reduce_scatter"):
        out = torch.empty(count // n, device=device)
        scratch = torch.empty(count, device=device)
        return (out, x, scratch), lambda: bool((out == total).all()), count * 4
    if op == "all_gather":
        out = torch.empty(count, device=device)
        inp = torch.full((count // n,), float(r + 1), device=device)
        want = torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(count // n)
        return (out, inp), lambda: bool((out == want).all()), count * 4
    if op == "all_to_all":
        out = torch.empty(count, device=device)
        want = torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(count // n)
        return (out, x), lambda: bool((out == want).all()), count * 4
    recv = torch.empty(count, device=device)  # send_recv: a ring, rank r sends to r + 1
    return (x, recv), lambda: bool((recv == float((r - 1) % n + 1)).all()), count * 4


def _launch(comm, op, bufs, group, n, r):
    if op == "all_reduce":
        return comm.all_reduce(bufs[0], group)
    if op == "reduce_scatter":
        return comm.reduce_scatter(bufs[0], bufs[1], group)
    if op == "exact_reduce_scatter":
        return comm.exact_reduce_scatter(bufs[0], bufs[1], bufs[2] if n > 1 else None, group)
    if op == "all_gather":
        return comm.all_gather(bufs[0], bufs[1], group)
    if op == "all_to_all":
        return comm.all_to_all(bufs[0], bufs[1], group)
    return comm.send_recv(bufs[0], bufs[1], (r + 1) % n, (r - 1) % n, group)


def _time(comm, op, bufs, group, n, r, iters) -> float:
    """Seconds per iteration. On CUDA, the GPU's own time: every launch is queued behind a sleeping
    kernel first and timed by the collectives' events from the second one's start to the last one's
    end, so that neither the host's launch cost (a call from Python, which would otherwise
    cap the small messages' figures) nor the first call's wait for the peers is counted. On a host
    backend, the wall clock over the iterations."""
    if comm.cuda and group.pg is not None:
        torch.cuda._sleep(SLEEP_CYCLES * (iters + 1))  # on the compute stream, which each launch waits for
        awake = torch.cuda.Event()
        awake.record()
        handles = [_launch(comm, op, bufs, group, n, r) for _ in range(iters + 1)]
        if awake.query():  # the GPU woke before every launch was queued: host time counts again
            print(f"bench comm: {op}: the launches outlasted the GPU's sleep, so one figure includes host time",
                  file=sys.stderr)
        for h in handles:
            h.wait()
        torch.cuda.synchronize()
        return handles[1].events[0].elapsed_time(handles[-1].events[1]) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        _launch(comm, op, bufs, group, n, r).wait()
    if comm.cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def run_comm(args) -> int:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise UserError(f"unknown operation {bad[0]!r}: use some of {', '.join(OPS)}")
    if args.min_bytes > args.max_bytes:
        raise UserError(f"--max-bytes {args.max_bytes} is below --min-bytes {args.min_bytes}: swap them")
    if args.iters < 1 or args.warmup < 0:
        raise UserError(f"--iters must be >= 1 and --warmup >= 0, got --iters {args.iters} --warmup {args.warmup}")
    if args.json_path:
        paths.out_file(args.json_path, "--json")
    rt = init_runtime("env", device=args.device)
    done = False
    try:
        n, r = rt.world_size, rt.rank
        comm = Comm(rt.device)
        group = build_mesh(r, n, comm).groups["world"]
        sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda: None)
        rows = []
        for op in ops:
            for nbytes in sizes(args.min_bytes, args.max_bytes):
                bufs, check, S = _setup(op, nbytes, n, r, rt.device)
                _launch(comm, op, bufs, group, n, r).wait()
                sync()
                ok = check()
                for _ in range(args.warmup):
                    _launch(comm, op, bufs, group, n, r).wait()
                sync()
                comm.barrier(group)
                t = _time(comm, op, bufs, group, n, r, args.iters)
                comm.step_comm()  # (its per-step sums are not this command's)
                t = comm.ordered_sum(t, group) / n  # the mean over ranks, the same on every rank
                ok = comm.ordered_sum(0.0 if ok else 1.0, group) == 0.0
                algbw = S / t / 1e9
                rows.append({"op": op, "bytes": S, "time_us": t * 1e6, "algbw_GBps": algbw,
                             "busbw_GBps": algbw * bus_factor(op, n), "correct": ok, "ranks": n,
                             "backend": rt.backend})
        if rt.is_main:
            print(f"{'op':<22}{'bytes':>12}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}  ok")
            for row in rows:
                print(f"{row['op']:<22}{row['bytes']:>12,}{row['time_us']:>12.1f}{row['algbw_GBps']:>12.3f}"
                      f"{row['busbw_GBps']:>12.3f}  {'yes' if row['correct'] else 'NO'}")
            if args.json_path:
                with open(args.json_path, "w") as f:
                    json.dump(rows, f, indent=1)
        done = True
        return 0 if all(row["correct"] for row in rows) else 1
    finally:
        rt.close(clean=done)
