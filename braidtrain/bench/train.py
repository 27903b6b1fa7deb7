"""`braidtrain bench comm`: what the collectives of this machine and backend deliver.
`braidtrain bench train`: braidtrain's layouts against torch DDP and FSDP2, and against transformers'
own model of the family (LlamaForCausalLM, GPT2LMHeadModel), side by side.

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

bench train runs each variant as its own torchrun job on the same --nproc processes -- each
braidtrain layout through the real `braidtrain train` command, each torch variant through
braidtrain/bench/torchref.py -- with the same model, batch, data and optimizer settings, and reads what
they wrote. Separate jobs: one variant's compile caches, memory pool or deterministic-algorithm
switch cannot colour another's figures. The first --warmup steps (compilation, allocator warm-up)
are not timed; tokens/s is the timed tokens over the timed seconds; MFU is the model's FLOPs
(GPTConfig.flops_per_token: 6 per weight per token plus attention's 12·L·T·C) at that rate over
the devices' dense peak (metrics.PEAK_FLOPS); memory is torch's peak allocation on rank 0;
exposed communication is the time the step waited for the gradient reduction after its backward
pass, and busbw (GB/s) the step's collectives' bus bytes over their summed duration -- the
reduction's effective bandwidth while it overlaps the backward pass, to hold against bench comm's
figure at the bucket size (braidtrain only; the step's few tiny collectives are included);
"host" is the share of the step the host took to issue its work (metrics' host_s): near 100%, the
GPU waited for the host -- or a full launch queue held the host back, which a profile tells apart
(on CPUs always near 100%: the work is done as it is issued);
"slowest" is the slowest timed step over the median one, which shows a stall the mean hides. On
GPUs, nvidia-smi samples every GPU five times a second beside each job, and "SM MHz" and "W" are
the mean SM clock and power draw over the samples of GPUs that were busy (utilization >= BUSY):
an H200 held at its 700 W cap runs below its top clock, and a variant that keeps it busier can be
slowed by that (docs/performance.md). The final loss of every variant is shown: they train the
same model on the same sequences, so the losses must agree to bf16 rounding -- a variant that
does less work shows it there. Figures on one host move 5-10% between runs of the same command:
--repeat N runs all the variants N times in turn (every other round in reverse order), and each
row is then a variant's median run, its ratio the median of its rounds' ratios, each against the
baseline run of the same round (for an even N the lower of the middle two; no ratio where a
round's baseline failed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from braidtrain.dist.comm import bus_factor
from braidtrain.errors import UserError

LAYOUTS = ("-z 0", "-z 0 --compile", "-z 1 --compile", "-z 3 --compile", "-z 0 --compile --exact")
GRAPH_LAYOUTS = ("-z 0 --compile --cuda-graph", "-z 0 --compile --exact --cuda-graph")  # added on CUDA
TORCH = ("ddp", "ddp-compile", "fsdp2", "fsdp2-compile")  # the yardsticks (torchref.py says what each compiles)
HF = ("hf", "hf-compile")  # transformers' model of the family, eager and compiled (torchref.hf_model)
LOSS_TOL = {"cpu": 1e-3, "cuda": 2e-2}  # final losses of variants within this (relative): fp32; bf16
PIPE = ("pipe-1f1b", "pipe-interleaved")  # torch.distributed.pipelining's (pp = ranks), beside --layout '--pp N'
FLOAT8 = ("ao-tensorwise", "ao-rowwise")  # torchao's float8 training, beside --layout '--compile --fp8 ...'
SLEEP_CYCLES = 2_000_000  # bench comm on CUDA: GPU sleep per queued launch (~1 ms, several launches' time)
SMI = ["nvidia-smi", "--query-gpu=utilization.gpu,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "200"]
BUSY = 90  # bench train: nvidia-smi samples of GPUs at least this busy (%) count for "SM MHz" and "W"
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv", "exact_reduce_scatter")


def add_parser(sub):
    p = sub.add_parser("bench", help="measure collectives (bench comm) or training against torch DDP/FSDP2 (bench train)")
    bsub = p.add_subparsers(dest="what", required=True, parser_class=sub._parser_class)  # one-line errors too
    c = bsub.add_parser("comm", help="all_reduce, reduce_scatter, all_gather, all_to_all, send_recv, exact reduce-scatter")
    c.add_argument("--min-bytes", type=_size, default=_size("1K"))
    c.add_argument("--max-bytes", type=_size, default=_size("1G"))
    c.add_argument("--iters", type=int, default=20)
    c.add_argument("--warmup", type=int, default=5)
    c.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    c.add_argument("--json", dest="json_path", help="also write the rows to this file (rank 0)")
    c.add_argument("--device", help="cpu or cuda (default: the local GPU, else cpu)")
    t = bsub.add_parser("train", help="braidtrain layouts against torch DDP (eager, compiled), FSDP2 and "
                                      "transformers' model, one job each")
    t.add_argument("--model", default="gpt2")
    for k in ("--n-layer", "--n-head", "--n-embd", "--n-kv-heads"):
        t.add_argument(k, type=int)
    t.add_argument("--train-data", "-i", default="data/shakespeare_gpt2")
    t.add_argument("--batch-size", "-b", type=int, default=16)
    t.add_argument("--seq-len", "-t", type=int, default=1024)
    t.add_argument("--total-batch", "-d", type=int, help="tokens per step (default: 8 micro-steps a rank)")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--warmup", type=int, default=5, help="steps not timed (compilation, warm-up)")
    t.add_argument("--nproc", type=int, help="processes (default: the local GPUs, else 1)")
    t.add_argument("--layout", action="append", metavar="FLAGS",
                   help="braidtrain train flags of one layout, e.g. '-z 1 --compile', or --layout='--compile' when "
                        "the first flag is a long one (repeatable; default: "
                        + "; ".join(LAYOUTS) + "; on CUDA also " + "; ".join(GRAPH_LAYOUTS) + ")")
    t.add_argument("--torch", default=",".join(TORCH),
                   help="torch variants, a subset of " + ",".join(TORCH + HF + PIPE + FLOAT8) + " ('' for none; default "
                        + ",".join(TORCH) + "); hf, hf-compile: transformers' model of the family (e.g. LlamaForCausalLM)")
    t.add_argument("--baseline", help="the torch variant the ratios are against (default: ddp-compile if run, else "
                                      "the first of --torch)")
    t.add_argument("--json", dest="json_path", help="also write the rows to this file")
    t.add_argument("--device", help="cpu or cuda (default: the local GPUs, else cpu)")
    t.add_argument("--keep", metavar="DIR", help="keep the variants' run directories here (with --repeat, in DIR/round1, "
                                                  "DIR/round2, ...; default: a temporary folder)")
    t.add_argument("--loss-tol", type=float, help="final losses of the variants must agree within this, relative "
                   f"(default {LOSS_TOL['cpu']:g} on the CPU, fp32; {LOSS_TOL['cuda']:g} on CUDA, bf16); else exit 2")
    t.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run all the variants N times, in turn (figures move between runs): each row is a variant's "
                        "median run, its ratio the median of its rounds' ratios; every run is listed below the table")
    return p


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().rstrip("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, IndexError):
        # argparse turns this into its one-line error (a UserError here would escape as a traceback)
        raise argparse.ArgumentTypeError(f"'{text}' is not a size: use e.g. 4096, 64K, 16M or 1G") from None


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], max(4, lo)
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _setup(op, nbytes, n, r, device):
    """Buffers for one op and size, filled so that the result is known: rank r holds r + 1."""
    import torch

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
    end, so that neither the host's launch cost (~0.15 ms a call from Python, which would otherwise
    cap the small messages' figures) nor the first call's wait for the peers is counted. On a host
    backend, the wall clock over the iterations."""
    import torch

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


def run(args) -> int:
    return run_train(args) if args.what == "train" else run_comm(args)


def run_comm(args) -> int:
    import torch

    from braidtrain.dist.comm import Comm
    from braidtrain.dist.mesh import build_mesh
    from braidtrain.dist.runtime import init_runtime

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise UserError(f"unknown operation {bad[0]!r}: use some of {', '.join(OPS)}")
    if args.min_bytes > args.max_bytes or args.iters < 1 or args.warmup < 0:
        raise UserError("need --min-bytes <= --max-bytes, --iters >= 1 and --warmup >= 0")
    rt = init_runtime("env", device=args.device)
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
                rt.barrier()
                t = _time(comm, op, bufs, group, n, r, args.iters)
                comm.step_comm()  # (its per-step sums are not this command's)
                t = rt.cpu_sum(t) / n  # the mean over ranks, the same on every rank
                ok = rt.cpu_sum(0.0 if ok else 1.0) == 0.0
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
        return 0 if all(row["correct"] for row in rows) else 1
    finally:
        rt.close()


def _variant_rows(args, n: int, d: int, cuda: bool, work: Path):
    """(name, command, reader) of every variant: a reader turns the finished job into a row."""
    model = ["--model", args.model] + [x for k in ("n_layer", "n_head", "n_embd", "n_kv_heads") if getattr(args, k)
                                       for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    common = [*model, "-i", args.train_data, "-b", str(args.batch_size), "-t", str(args.seq_len), "-d", str(d)]
    device = ["--device", args.device] if args.device else []
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m"]
    out = []
    for i, layout in enumerate(args.layout or LAYOUTS + (GRAPH_LAYOUTS if cuda else ())):
        run_dir = work / f"braidtrain{i}"
        cmd = [*launch, "braidtrain", "train", *common, "-x", str(args.steps), "--val-every", "0", "--val-steps", "1",
               "--sample-tokens", "0", "--no-progress", "--out", str(run_dir), *device, *shlex.split(layout)]
        out.append((f"braidtrain {layout}", cmd, lambda run_dir=run_dir: _braidtrain_row(run_dir, args.warmup)))
    for mode in [m.strip() for m in args.torch.split(",") if m.strip()]:
        path = work / f"torch-{mode}.json"
        cmd = [*launch, "braidtrain.bench.torchref", "--mode", mode, *common, "--steps", str(args.steps), "--json", str(path), *device]
        out.append((f"torch {mode}", cmd, lambda path=path: _torch_row(path, args.warmup)))
    return out


def _braidtrain_row(run_dir: Path, warmup: int) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = recs[warmup:]
    secs = sum(r["step_s"] for r in timed)
    tps = sum(r["tokens_per_s"] * r["step_s"] for r in timed) / secs
    mfu = timed[0]["mfu"] / timed[0]["tokens_per_s"] * tps if timed[0]["mfu"] else None
    comm = [(r["comm_busbw_GBps"], r["comm_s"]) for r in timed if r["comm_busbw_GBps"]]
    busbw = sum(b * s for b, s in comm) / sum(s for _, s in comm) if comm else None  # total bus bytes / total time
    return {"tokens_per_s": tps, "mfu": mfu, "mem_gb": max(r["mem_gb"] for r in recs),
            "exposed_comm_frac": sum(r["exposed_comm_s"] for r in timed) / secs, "comm_busbw_GBps": busbw,
            "host_frac": sum(r["host_s"] for r in timed) / secs,
            "slowest": slowest([r["step_s"] for r in timed]), "loss": recs[-1]["loss"]}


def _torch_row(path: Path, warmup: int) -> dict:
    r = json.loads(path.read_text())
    secs = sum(r["step_s"][warmup:])
    tps = r["tokens_per_step"] * len(r["step_s"][warmup:]) / secs
    mfu = tps * r["flops_per_token"] / r["peak_flops"] if r["peak_flops"] else None
    return {"tokens_per_s": tps, "mfu": mfu, "mem_gb": r["mem_gb"], "exposed_comm_frac": None, "comm_busbw_GBps": None,
            "host_frac": None,
            "slowest": slowest(r["step_s"][warmup:]), "loss": r["loss"][-1]}


def gpu_load(lines: list[str]) -> dict:
    """The mean SM clock (MHz) and power draw (W) over nvidia-smi's CSV samples (utilization %,
    clock, power) of GPUs that were at least BUSY % busy; {} when none was (or no line parsed)."""
    busy = []
    for line in lines:
        try:
            util, mhz, watts = (float(x) for x in line.split(","))
        except ValueError:  # a field nvidia-smi could not read ("[N/A]"), a partial last line
            continue
        if util >= BUSY:
            busy.append((mhz, watts))
    if not busy:
        return {}
    return {"sm_mhz": statistics.mean(m for m, _ in busy), "power_w": statistics.mean(w for _, w in busy)}


def slowest(step_s: list[float]) -> float:
    """The slowest timed step over the median one: 1.0x-1.05x for a steady run; more flags a
    stall (a peer late to a collective, the host pausing) that the mean alone would hide."""
    return max(step_s) / statistics.median(step_s)


def _check_train_args(args) -> None:
    """Every bad input a one-line UserError before any job starts (each layout parsed as `train` would)."""
    from braidtrain.cli import Parser, _train_parser, train_config
    from braidtrain.model import registry

    # the model and its shape flags, as every variant's job will build it
    mcfg = registry.model_config(args.model, **{k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "n_kv_heads")})
    if args.seq_len > mcfg.block_size:
        raise UserError(f"-t {args.seq_len} is longer than {args.model}'s context ({mcfg.block_size}): "
                        f"use -t {mcfg.block_size} or less")
    torch_modes = [m.strip() for m in args.torch.split(",") if m.strip()]
    bad = [m for m in torch_modes if m not in TORCH + HF + PIPE + FLOAT8]
    if bad:
        raise UserError(f"unknown torch variant {bad[0]!r}: use some of {', '.join(TORCH + HF + PIPE + FLOAT8)}")
    if any(m in HF for m in torch_modes):
        _check_hf(mcfg, args.model)
    if args.baseline is None:
        args.baseline = "ddp-compile" if "ddp-compile" in torch_modes or not torch_modes else torch_modes[0]
    if torch_modes and args.baseline not in torch_modes:
        raise UserError(f"--baseline {args.baseline} is not among the torch variants run ({', '.join(torch_modes)})")
    for name in ("batch_size", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc must be positive, got {args.nproc}")
    if args.repeat < 1:
        raise UserError(f"--repeat must be positive, got {args.repeat}")
    if args.steps <= args.warmup or args.warmup < 0:
        raise UserError(f"--steps {args.steps} must exceed --warmup {args.warmup} (>= 0): nothing would be timed")
    parser = _train_parser(Parser(prog="braidtrain").add_subparsers(parser_class=Parser))
    for layout in args.layout or LAYOUTS + GRAPH_LAYOUTS:
        try:
            train_config(parser.parse_args(shlex.split(layout)))
        except ValueError as e:  # shlex: an unclosed quote
            raise UserError(f"--layout {layout!r}: {e}") from None
    if not Path(args.train_data).exists():
        raise UserError(f"no data at {args.train_data}: prepare it with `python -m braidtrain data prepare "
                        f"--corpus shakespeare --tokenizer gpt2 --out {args.train_data}`")


def _check_hf(mcfg, model: str) -> None:
    """--torch hf: a dense model (the yardstick loads per-expert tensors into no mixture), transformers
    installed, with the class of the model's architecture."""
    from braidtrain.model import registry

    if mcfg.moe_experts:
        raise UserError(f"--torch hf: {model} is a mixture of experts; the hf yardsticks train dense models: "
                        f"drop hf and hf-compile from --torch")
    arch = registry.family_of(mcfg).hf_config(mcfg, 0)["architectures"][0]
    try:
        import transformers
    except ImportError:
        raise UserError(f"--torch hf trains transformers' {arch}: install the transformers package "
                        f"(pip install transformers), or drop hf and hf-compile from --torch") from None
    if not hasattr(transformers, arch):
        raise UserError(f"--torch hf: transformers {transformers.__version__} has no {arch} (for --model {model}): "
                        f"upgrade it, or drop hf and hf-compile from --torch")


def run_train(args) -> int:
    import torch

    _check_train_args(args)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda and (args.nproc or 0) > torch.cuda.device_count():
        raise UserError(f"--nproc {args.nproc} is more than the {torch.cuda.device_count()} local GPU(s)")
    n = args.nproc or (torch.cuda.device_count() if cuda else 1)
    d = args.total_batch or 8 * args.batch_size * args.seq_len * n
    if d % (args.batch_size * args.seq_len * n):
        raise UserError(f"-d {d} is not a multiple of b*t*nproc = {args.batch_size * args.seq_len * n}")
    with tempfile.TemporaryDirectory(prefix="braidtrain-bench-") as tmp:
        rounds = []  # each: one run of every variant, rows in variant order
        for r in range(args.repeat):
            folder = round_folder(Path(args.keep or tmp), r, args.repeat)
            folder.mkdir(parents=True, exist_ok=True)
            variants = _variant_rows(args, n, d, cuda, folder)
            if r == 0:
                print(f"bench train: {args.model}, -b {args.batch_size} -t {args.seq_len} -d {d}, {n} process(es), "
                      f"{args.steps} steps ({args.warmup} untimed), {len(variants)} variants"
                      + (f", {args.repeat} rounds" if args.repeat > 1 else ""), file=sys.stderr, flush=True)
            # every other round in reverse order, so that what running first or last does to a
            # variant (a cooler GPU, a warmer one) falls on each variant alike
            order = list(range(len(variants)))[:: -1 if r % 2 else 1]
            rows = _run_variants(args, [variants[i] for i in order], d, n, cuda,
                                 f"round {r + 1}/{args.repeat}, " if args.repeat > 1 else "")
            rounds.append([row for _, row in sorted(zip(order, rows))])
            if not args.keep and args.repeat > 1:  # each variant's run left a checkpoint (GBs for gpt2)
                shutil.rmtree(folder, ignore_errors=True)
    rows = [_median_row([r[i] for r in rounds]) for i in range(len(rounds[0]))]
    _print_train(rows, args.baseline if any(r["ratio"] is not None for r in rows) else None)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1) + "\n")
    _check_losses(rows, args.loss_tol if args.loss_tol is not None else LOSS_TOL["cuda" if cuda else "cpu"])
    return 1 if any("error" in r for r in rows) else 0


def _check_losses(rows: list[dict], tol: float) -> None:
    """Every variant trained the same model on the same sequences: their final losses agree, or
    one of them does other work (a one-line UserError, after the table)."""
    done = [r for r in rows if "error" not in r]
    if not done:
        return
    ref = done[0]
    for r in done[1:]:
        if abs(r["loss"] - ref["loss"]) > tol * abs(ref["loss"]):
            raise UserError(f"final losses disagree: {r['variant']} {r['loss']:.5f} against {ref['variant']} "
                            f"{ref['loss']:.5f} (more than {tol:g} apart, relative): the variants did not do the same "
                            f"work (--loss-tol to allow more)")


def round_folder(work: Path, r: int, repeat: int) -> Path:
    """Where round r (from 0) keeps its variants' run directories: `work` itself for a single round."""
    return work if repeat == 1 else work / f"round{r + 1}"


def run_job(cmd: list, env: dict) -> subprocess.CompletedProcess:
    """One variant's command, its output captured (the tests fork it instead: tests/helpers.forked)."""
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def _run_variants(args, variants, d: int, n: int, cuda: bool, label: str) -> list[dict]:
    """One run of every variant, in order, each row with its ratio to this round's baseline run."""
    rows = []
    smi = cuda and shutil.which(SMI[0]) is not None
    for k, (name, cmd, read) in enumerate(variants, 1):
        t0 = time.time()
        sampler = subprocess.Popen(SMI, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) if smi else None
        p = run_job(cmd, dict(os.environ, PYTHONUNBUFFERED="1"))
        row = {"variant": name, "ranks": n, "tokens_per_step": d}
        if sampler is not None:
            sampler.terminate()
            row.update(gpu_load(sampler.communicate()[0].splitlines()))
        try:
            if p.returncode:
                raise RuntimeError(_last_error(p.stderr + p.stdout))
            row.update(read())
            note = f"{row['tokens_per_s']:,.0f} tokens/s"
        except Exception as e:  # one failed variant does not cost the others' figures
            row["error"] = str(e) or type(e).__name__
            note = "FAILED: " + row["error"]
        rows.append(row)
        print(f"[{label}{k}/{len(variants)}] {name}: {note} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    base = next((r for r in rows if r["variant"] == f"torch {args.baseline}" and "error" not in r), None)
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / base["tokens_per_s"] if base and "error" not in r else None
    return rows


def _median_row(runs: list[dict]) -> dict:
    """A variant over its rounds: the run of median tokens/s and the median of the rounds' ratios
    (each the lower of the middle two), each ratio against the baseline run beside it, so a host
    that drifts between rounds moves both; and every run's tokens/s and ratio. A failed run fails
    the row; a round whose baseline failed leaves every row without a ratio."""
    failed = [r for r in runs if "error" in r]
    row = dict(failed[0] if failed else sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2])
    ratios = [r["ratio"] for r in runs]
    row["ratio"] = None if failed or None in ratios else statistics.median_low(ratios)
    row["runs_tokens_per_s"], row["runs_ratio"] = [r.get("tokens_per_s") for r in runs], ratios
    return row


def _last_error(text: str) -> str:
    """The failed job's own error: the last 'SomethingError: ...' line that is not torchrun's
    report about its child, else torchrun's word on a child killed by a signal."""
    lines = [line.strip() for line in text.splitlines() if line.strip().strip("=")]
    errs = [line for line in lines if ("Error" in line.split(":")[0] or "error:" in line) and "ChildFailedError" not in line]
    errs = errs or [line for line in lines if "Signal" in line or "exitcode" in line]
    return (errs or lines or ["exited with an error"])[-1][:300]


def _print_train(rows, baseline) -> None:
    cell = lambda v, f, unit="": "-" if v is None else format(v, f) + unit
    print(f"{'variant':<40}{'tokens/s':>12}{'MFU':>8}{'peak GB':>9}{'exposed':>9}{'busbw':>8}{'host':>7}{'slowest':>9}{'SM MHz':>8}"
          f"{'W':>6}{'loss':>9}{'x ' + baseline if baseline else '':>16}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<40}  FAILED: {r['error']}")
            continue
        pct = lambda v: None if v is None else 100 * v
        print(f"{r['variant']:<40}{r['tokens_per_s']:>12,.0f}{cell(pct(r['mfu']), '.1f', '%'):>8}"
              f"{cell(r['mem_gb'], '.2f'):>9}{cell(pct(r['exposed_comm_frac']), '.2f', '%'):>9}"
              f"{cell(r['comm_busbw_GBps'], '.1f'):>8}{cell(pct(r.get('host_frac')), '.0f', '%'):>7}{r['slowest']:>8.2f}x{cell(r.get('sm_mhz'), '.0f'):>8}"
              f"{cell(r.get('power_w'), '.0f'):>6}{r['loss']:>9.4f}{cell(r['ratio'], '.3f'):>16}")
    if len(rows[0]["runs_tokens_per_s"]) > 1:
        print("every run (tokens/s, and x the baseline run of its round):")
        for r in rows:
            runs = "  ".join("-" if t is None else f"{t:,.0f}" for t in r["runs_tokens_per_s"])
            ratios = "  ".join("-" if x is None else f"{x:.3f}" for x in r["runs_ratio"])
            print(f"  {r['variant']:<40}{runs}" + (f"   x {ratios}" if any(x is not None for x in r["runs_ratio"]) else ""))
