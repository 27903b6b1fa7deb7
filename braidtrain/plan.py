"""`braidtrain plan`: per-GPU memory and step time of every layout, ranked, and checked for real.

A layout is one point of the mesh (dp only, for now) x ZeRO stage x micro-batch b x recompute.
Each new axis (tp, pp, cp, ep) is one more loop in `layouts` and one more term in `estimate`.

Model state per GPU (P parameters counted once, n = dp; fp32 master weights and gradients, fp32
Adam m and v; bf16 autocast on the GPU). `bucket` is the largest bucket in bytes (bucket_mb of
2^20 bytes, rounded up to whole units); `W` the ZeRO-3 working set in bytes: two block buckets in
fp32 (the one in use and the prefetched one) plus the embedding group wte + wpe + ln_f, which
stays gathered for the whole micro-step because the tied head uses it again at the end.

    stage    parameters     gradients                optimizer (m, v)   total
    ZeRO-0   4P             4P                       8P                 16P
    ZeRO-1   4P             4P (reduce-scatter in    8P/n               8P + 8P/n
                            place: the shard is a view)
    ZeRO-2   4P             4P/n + 2*bucket scratch  8P/n               4P + 12P/n + 2*bucket
    ZeRO-3   4P/n + W       4P/n + 2*bucket scratch  8P/n               16P/n + W + 2*bucket

Activations per micro-batch (b sequences of t tokens, width h, L layers, vocabulary V), in bf16 on
the GPU, twice that in fp32 on the CPU:
    layers   34*t*b*h per layer (Korthikanti et al. 2022, Table 2, without the 5*a*t^2*b attention
             matrix: flash / SDPA never stores it); recompute: 2*t*b*h per layer (the block input)
             plus one layer's full 34*t*b*h, rebuilt during its backward
    logits   b*t*V*(2 + 4 + 4): bf16 logits, their fp32 copy, fp32 log-probs kept by the cross-
             entropy; plus 4*b*t*V for the fp32 gradient of the logits in the backward pass
    weights  2P: autocast's bf16 copies of the weights, cached for the forward and saved for the
             backward (also under ZeRO-3: releasing a gathered fp32 bucket does not free them)

Per GPU: allocated = parameters + gradients + optimizer + activations (what
torch.cuda.max_memory_allocated sees); total = allocated + communication buffers (NCCL's own,
outside torch's allocator) + overhead (CUDA context and workspaces, plus allocator slack).

Step time = compute + exposed communication. Compute = flops_per_token(t) * d / (dp * achieved
FLOP/s), x 4/3 with recompute (a second forward). Collectives follow an alpha-beta model per
bucket message: alpha + k * bytes / busbw, k = 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter
and all-gather (the bus-bandwidth convention of nccl-tests).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from braidtrain.errors import UserError

# Calibration knobs: every number the estimates rest on, named once.
ACT_PER_LAYER = 34  # bytes per (token x channel) in one layer, bf16 (Korthikanti et al. 2022)
ACT_PER_LAYER_RECOMPUTE = 2  # the bf16 block input kept per layer under recompute
LOGITS_FWD = 2 + 4 + 4  # bytes per (token x vocab): bf16 logits, fp32 copy, fp32 log-probs
LOGITS_BWD = 4  # bytes per (token x vocab): fp32 gradient of the logits
CONTEXT_BYTES = 1e9  # CUDA context, cuBLAS/cuDNN workspaces: outside torch's allocator
ALLOCATOR_SLACK = 0.05  # fragmentation of the caching allocator, a fraction of what it holds
NCCL_BYTES = 0.5e9  # NCCL's channel buffers per communicator (n > 1)
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
GB = 1e9  # what metrics.jsonl's mem_gb uses


def model_state_bytes(P: int, n: int, zero: int, bucket_bytes: int, block_params: int, embed_params: int) -> dict:
    """Per-GPU bytes of parameters, gradients and optimizer state (the table above).
    bucket_bytes: the largest bucket; block_params: elements of the largest block bucket;
    embed_params: elements of wte + wpe + ln_f. `transient` is the part of params + grads that
    exists only during the forward/backward pass (scratch, working set): a rank at rest, as
    measured between steps on the CPU, holds the rest."""
    scratch = 2 * bucket_bytes if zero >= 2 else 0  # buckets whose reduce-scatter is in flight
    working = 4 * (2 * block_params + embed_params) if zero == 3 else 0
    return {
        "params": 4 * P // n + working if zero == 3 else 4 * P,
        "grads": 4 * P // n + scratch if zero >= 2 else 4 * P,
        "optimizer": 8 * P // n if zero >= 1 else 8 * P,
        "transient": scratch + working,
    }


def param_numels(cfg) -> list[tuple[str, int]]:
    """(unit, elements) in GPT.param_units order: the embedding group, then one entry per block."""
    c = cfg.n_embd
    embed = cfg.padded_vocab * c + cfg.block_size * c + 2 * c  # wte (tied head), wpe, ln_f
    return [("embed", embed)] + [("block", 12 * c * c + 13 * c)] * cfg.n_layer


def bucket_numels(cfg, bucket_mb: float) -> list[tuple[str, int]]:
    """The engine's buckets (parallel/data.py), replayed on sizes, in launch order: whole blocks
    from the last one backwards until a bucket holds >= bucket_mb; the embedding group alone, last."""
    limit = max(1, int(bucket_mb * 2**20 / 4))
    out, size = [], 0
    for kind, k in reversed(param_numels(cfg)):
        if kind == "embed":
            out += [("block", size)] if size else []
            out.append(("embed", k))
            size = 0
            continue
        size += k
        if size >= limit:
            out.append(("block", size))
            size = 0
    return out + ([("block", size)] if size else [])


def activation_bytes(cfg, b: int, t: int, recompute: bool, cpu: bool, weight_params: int) -> dict:
    """Named terms (see the module docstring), so each can be calibrated on its own."""
    scale = 2 if cpu else 1  # fp32 on the CPU
    tbh = t * b * cfg.n_embd
    per_layer = ACT_PER_LAYER * tbh * scale
    layers = (ACT_PER_LAYER_RECOMPUTE * tbh * scale * cfg.n_layer + per_layer) if recompute else per_layer * cfg.n_layer
    V = cfg.padded_vocab
    return {"layers": layers, "logits": b * t * V * (LOGITS_FWD + LOGITS_BWD),
            "weights_bf16": 0 if cpu else 2 * weight_params}


@dataclass(frozen=True)
class Setup:
    cfg: object  # GPTConfig
    gpus: int
    mem_gb: float
    t: int
    d: int
    tflops: float = 400.0
    busbw: float = 300.0  # GB/s
    alpha_us: float = 10.0
    bucket_mb: float = 25.0
    cpu: bool = False  # the --check on a CPU: fp32, gloo, no CUDA context


@dataclass(frozen=True)
class Layout:
    dp: int
    zero: int
    b: int
    recompute: bool
    # tp, pp, cp, ep: one field each, one loop in layouts(), one term in estimate()

    def name(self) -> str:
        return f"ZeRO-{self.zero} b={self.b}" + (" --recompute" if self.recompute else "")


def layouts(s: Setup, zeros=(0, 1, 2, 3), bs=MICRO_BATCHES, recomputes=(False, True)):
    for dp in (s.gpus,):  # with tp/pp/cp: dp = gpus // (tp * pp * cp), one loop per axis
        for zero in zeros if dp > 1 or len(zeros) == 1 else (0,):  # dp = 1: nothing to shard
            for b in bs:
                if s.d % (b * s.t * dp) == 0:
                    for rc in recomputes:
                        yield Layout(dp, zero, b, rc)


def collective_s(s: Setup, kind: str, nbytes: float, n: int) -> float:
    if n == 1:
        return 0.0
    k = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return s.alpha_us * 1e-6 + k * nbytes / (s.busbw * 1e9)


def exposed(times: list[float], window: float) -> float:
    """Messages issued while `window` seconds of compute run: one of them cannot hide (the last
    reduction after the backward ends, or the first gather before the forward starts); the rest
    hide behind compute, up to the length of the window."""
    return times[-1] + max(0.0, sum(times[:-1]) - window) if times else 0.0


def estimate(s: Setup, lay: Layout) -> dict:
    cfg, n = s.cfg, lay.dp
    P = cfg.num_params()
    buckets = bucket_numels(cfg, s.bucket_mb)
    blocks = [k for kind, k in buckets if kind == "block"]
    embed = next(k for kind, k in buckets if kind == "embed")
    state = model_state_bytes(P, n, lay.zero, 4 * max(k for _, k in buckets), max(blocks, default=0), embed)
    act = activation_bytes(cfg, lay.b, s.t, lay.recompute, s.cpu, P)
    mem = {k: state[k] for k in ("params", "grads", "optimizer")}
    mem["activations"] = sum(act.values())
    allocated = sum(mem.values())
    mem["comm"] = NCCL_BYTES if n > 1 and not s.cpu else 0
    mem["overhead"] = 0 if s.cpu else CONTEXT_BYTES + ALLOCATOR_SLACK * allocated
    mem["total"] = sum(mem.values())

    micro = max(1, s.d // (lay.b * s.t * n))
    compute = cfg.flops_per_token(s.t) * s.d / (n * s.tflops * 1e12) * (4 / 3 if lay.recompute else 1)
    fwd = compute / micro * (1 / 4 if lay.recompute else 1 / 3)  # the forward is 1 of 3 (of 4) passes
    bwd = compute / micro - fwd
    msg = [4 * k for _, k in buckets]  # fp32 buckets, in launch order
    ar, rs, ag = ([collective_s(s, kind, m, n) for m in msg] for kind in ("all_reduce", "reduce_scatter", "all_gather"))
    if lay.zero == 0:  # all-reduce on the last micro-step, overlapped with its backward
        comm = exposed(ar, bwd)
    elif lay.zero == 1:  # reduce-scatter likewise; then the updated parameters are all-gathered, exposed
        comm = exposed(rs, bwd) + sum(ag)
    elif lay.zero == 2:  # no full gradient buffer: reduce-scatter on every micro-step
        comm = micro * exposed(rs, bwd) + sum(ag)
    else:  # each block bucket is gathered before its forward and again before its backward,
        # prefetched one bucket ahead, so mostly only the first gather (the embedding group, held
        # all micro-step) and the last reduce-scatter are exposed; reduce-scatter every micro-step
        comm = micro * (exposed(ag, fwd) + exposed(ag[:-1] + rs, bwd))
    step = compute + comm
    return {"layout": lay, "micro_steps": micro, "mem": mem, "allocated": allocated, "state": state,
            "activations": act, "compute_s": compute, "comm_s": comm, "step_s": step,
            "tokens_per_s": s.d / step, "fits": mem["total"] <= s.mem_gb * GB}


def gpus_needed(s: Setup, limit: int = 1 << 16) -> int | None:
    """The fewest GPUs (doubling) on which the leanest layout, ZeRO-3 b=1 --recompute, fits."""
    m = s.gpus * 2
    while m <= limit:
        if estimate(replace(s, gpus=m), Layout(m, 3, 1, True))["fits"]:
            return m
        m *= 2
    return None


def fix(s: Setup, e: dict) -> str:
    """The smallest single changes that make a layout fit: a higher ZeRO stage, a smaller
    micro-batch, recompute; failing those, larger GPUs or more of them."""
    lay, opts = e["layout"], []
    z = next((k for k in range(lay.zero + 1, 4) if estimate(s, replace(lay, zero=k))["fits"]), None)
    if z is not None:
        opts.append(f"ZeRO-{z}")
    smaller = [b for b in MICRO_BATCHES if b < lay.b and s.d % (b * s.t * lay.dp) == 0]
    b = next((b for b in reversed(smaller) if estimate(s, replace(lay, b=b))["fits"]), None)
    if b is not None:
        opts.append(f"b={b}")
    if not lay.recompute and estimate(s, replace(lay, recompute=True))["fits"]:
        opts.append("--recompute")
    if not opts:
        opts.append(f"GPUs with >= {math.ceil(e['mem']['total'] / GB)} GB")
        m = gpus_needed(s)
        if m:
            opts.append(f"{m} GPUs with ZeRO-3 b=1 --recompute")
    return f"{lay.name()} needs {e['mem']['total'] / GB:.1f} GB > {s.mem_gb:g} GB: use " + ", or ".join(opts)


def nothing_fits(s: Setup) -> str:
    lean = min((estimate(s, Layout(s.gpus, z, 1, True)) for z in range(4)), key=lambda e: e["mem"]["total"])
    need = lean["mem"]["total"] / GB
    msg = (f"nothing fits on {s.gpus} x {s.mem_gb:g} GB: the leanest layout, {lean['layout'].name()}, "
           f"needs {need:.1f} GB per GPU; use GPUs with >= {math.ceil(need)} GB")
    m = gpus_needed(s)
    if m:
        msg += f", or {m} GPUs with ZeRO-3 b=1 --recompute" + (f" (-d a multiple of {s.t * m})" if s.d % (s.t * m) else "")
    return msg


def plan(s: Setup, zeros=(0, 1, 2, 3), bs=MICRO_BATCHES, recomputes=(False, True)) -> dict:
    rows = [estimate(s, lay) for lay in layouts(s, zeros, bs, recomputes)]
    if not rows:
        unit = s.t * s.gpus
        raise UserError(f"-d {s.d} is not a multiple of b*t*dp = b*{s.t}*{s.gpus} for any allowed b: use -d {max(1, s.d // unit) * unit}")
    # Step times within 0.1% are a tie (the model cannot tell them apart); then fewer micro-steps
    # (larger GEMMs, which the constant --tflops does not see), then less memory.
    rows.sort(key=lambda e: (not e["fits"], float(f"{e['step_s']:.3g}"), e["micro_steps"], e["mem"]["total"]))
    for e in rows:
        e["fix"] = None if e["fits"] else fix(s, e)
    best = rows[0]
    if best["fits"]:
        rec = (f"recommended: {best['layout'].name()} on {s.gpus} GPU(s), {best['micro_steps']} micro-step(s): "
               f"{best['mem']['total'] / GB:.1f} of {s.mem_gb:g} GB, {best['step_s']:.3f} s/step, "
               f"{best['tokens_per_s']:,.0f} tokens/s")
    else:
        rec = nothing_fits(s)
    return {"rows": rows, "recommendation": rec}


# ---------------------------------------------------------------------------------- output

COLUMNS = ("params", "grads", "optimizer", "activations", "comm", "overhead")


def row_json(e: dict) -> dict:
    return {**asdict(e["layout"]), "micro_steps": e["micro_steps"], "fits": e["fits"],
            "mem_gb": {k: v / GB for k, v in e["mem"].items()}, "allocated_gb": e["allocated"] / GB,
            "activations_gb": {k: v / GB for k, v in e["activations"].items()},
            "compute_s": e["compute_s"], "exposed_comm_s": e["comm_s"], "step_s": e["step_s"],
            "tokens_per_s": e["tokens_per_s"], "fix": e.get("fix")}


def table(result: dict, top: int) -> str:
    head = ["dp", "zero", "b", "micro", "recomp", "mem GB", "params", "grads", "optim", "activ", "comm",
            "ovhd", "step s", "tokens/s", "fits"]
    lines = [head]
    shown = result["rows"][:top] if top > 0 else result["rows"]
    for e in shown:
        lay, m = e["layout"], e["mem"]
        lines.append([lay.dp, lay.zero, lay.b, e["micro_steps"], "on" if lay.recompute else "off",
                      f"{m['total'] / GB:.1f}", *(f"{m[k] / GB:.2f}" for k in COLUMNS),
                      f"{e['step_s']:.3f}", f"{e['tokens_per_s']:,.0f}", "yes" if e["fits"] else "NO"])
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(head))]
    out = ["  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in lines]
    if len(shown) < len(result["rows"]):
        out.append(f"({len(result['rows']) - len(shown)} more layouts: --top 0 shows all)")
    fixes = [e["fix"] for e in shown if e["fix"]]
    out += fixes[:4] + ([f"({len(fixes) - 4} more such lines: --json has a fix for every layout)"] if len(fixes) > 4 else [])
    return "\n".join(out + [result["recommendation"]])


# ----------------------------------------------------------------------------- the command

def parse_count(text: str) -> int:
    """124M, 1.5B, 7e9 -> an integer parameter count."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not m:
        raise UserError(f"--params {text!r} is not a count: use e.g. 124M, 1.5B or 7e9")
    return int(float(m[1]) * 10 ** (3 * " kmbt".index(m[2] or " ")))


def assumed_shape(n_params: int, vocab: int, block_size: int):
    """A GPT-2-shaped model of about n_params: head size 64, width = 64 x depth (GPT-2 small's
    aspect ratio), then the head count that brings the parameter count closest."""
    from braidtrain.model.gpt import GPTConfig

    size = lambda L, k: GPTConfig(L, k, 64 * k, block_size, vocab).num_params()
    L = min(range(1, 1000), key=lambda L: abs(size(L, L) - n_params))
    k = min(range(1, 4 * L + 1), key=lambda k: abs(size(L, k) - n_params))
    return GPTConfig(L, k, 64 * k, block_size, vocab)


def add_parser(sub):
    p = sub.add_parser("plan", help="memory and step time of every layout; --check one against a real run",
                       allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--model", "-e", help="preset (tiny, gpt2 ... gpt2-xl) or llm.c's dN (default gpt2)")
    g.add_argument("--params", help="a parameter count (124M, 1.5B) for an assumed GPT-2 shape, instead of --model")
    for k in ("n-layer", "n-head", "n-embd", "block-size"):
        g.add_argument(f"--{k}", type=int)
    g.add_argument("--vocab", type=int, default=50257, help="tokenizer vocabulary (default GPT-2's; --data's wins)")
    g = p.add_argument_group("machine and batch")
    g.add_argument("--gpus", type=int, default=1, help="GPUs (= dp for now)")
    g.add_argument("--gpu-mem", type=float, default=80.0, help="GB per GPU")
    g.add_argument("--seq-len", "-t", type=int, default=1024)
    g.add_argument("--total-batch", "-d", type=int, default=524288, help="tokens per optimizer step")
    g.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU (default: H200 bf16, measured-looking)")
    g.add_argument("--busbw", type=float, default=300.0, help="collective bus bandwidth, GB/s")
    g.add_argument("--alpha-us", type=float, default=10.0, help="collective latency, microseconds")
    g.add_argument("--bucket-mb", type=float, default=25.0)
    g = p.add_argument_group("which layouts (default: all)")
    g.add_argument("--zero", "-z", type=int, choices=[0, 1, 2, 3])
    g.add_argument("--batch-size", "-b", type=int)
    g.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="only layouts with (--recompute) or without (--no-recompute)")
    g = p.add_argument_group("output and check")
    g.add_argument("--top", type=int, default=12, help="rows of the table (0: all)")
    g.add_argument("--json", action="store_true")
    g.add_argument("--check", nargs="?", const="", metavar="ZERO,B[,recompute]",
                   help="train two steps of this layout (or of -z/-b/--recompute) and compare memory")
    g.add_argument("--data", "-i", help="token data for --check (braidtrain data prepare --out DIR)")
    g.add_argument("--out", help="keep the --check run here (default: a temporary folder)")
    return p


def setup_from(args) -> Setup:
    for k in ("gpus", "gpu_mem", "seq_len", "total_batch", "tflops", "busbw", "bucket_mb", "vocab", "top"):
        if getattr(args, k) <= 0 and not (k == "top" and args.top == 0):
            raise UserError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k):g}")
    if args.alpha_us < 0:
        raise UserError(f"--alpha-us must be >= 0, got {args.alpha_us:g}")
    if args.batch_size is not None and args.batch_size not in MICRO_BATCHES:
        raise UserError(f"-b {args.batch_size}: use one of {', '.join(map(str, MICRO_BATCHES))}")
    vocab = args.vocab
    if args.data:
        meta = Path(args.data) / "tokenizer.json"
        vocab = json.loads(meta.read_text())["vocab_size"] if meta.is_file() else vocab
    if args.params and args.model:
        raise UserError("give --model or --params, not both")
    if args.params:
        cfg = assumed_shape(parse_count(args.params), vocab, args.block_size or max(1024, args.seq_len))
    else:
        from braidtrain.model.gpt import model_config

        cfg = model_config(args.model or "gpt2", vocab, args.n_layer, args.n_head, args.n_embd, args.block_size)
    if args.seq_len > cfg.block_size:
        raise UserError(f"-t {args.seq_len} is longer than the model's context ({cfg.block_size}): use -t {cfg.block_size} or less")
    return Setup(cfg, args.gpus, args.gpu_mem, args.seq_len, args.total_batch, args.tflops, args.busbw,
                 args.alpha_us, args.bucket_mb)


def check_layout(args) -> Layout:
    if args.check:
        parts = [p.strip() for p in args.check.split(",")]
        try:
            zero, b = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            raise UserError(f"--check {args.check!r}: use ZERO,B or ZERO,B,recompute (e.g. 1,8)") from None
        if len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("recompute", "1", "on")):
            raise UserError(f"--check {args.check!r}: the third field can only be 'recompute'")
        rc = len(parts) == 3
    elif args.zero is None or args.batch_size is None:
        raise UserError("--check needs a layout: --check ZERO,B[,recompute], or -z ZERO -b B [--recompute]")
    else:
        zero, b, rc = args.zero, args.batch_size, bool(args.recompute)
    if zero not in (0, 1, 2, 3) or b <= 0:
        raise UserError(f"--check {zero},{b}: ZeRO stage 0-3 and a positive micro-batch")
    return Layout(args.gpus, zero, b, rc)


def check(s: Setup, lay: Layout, data: str, out: str | None) -> dict:
    """Two real training steps (the first optimizer step included) of this layout, then estimated
    vs measured mem_gb. On a GPU mem_gb is torch's peak allocation, so the estimate compared is
    `allocated`; on the CPU it is the model state at rest (params + grads + Adam m, v)."""
    import torch

    s = replace(s, cpu=not torch.cuda.is_available())
    if s.d % (lay.b * s.t * lay.dp):
        raise UserError(f"-d {s.d} is not a multiple of b*t*dp = {lay.b * s.t * lay.dp}")
    e = estimate(s, lay)
    c = s.cfg
    cmd = ["-m", "braidtrain", "train", "--model", "gpt2", "--n-layer", c.n_layer, "--n-head", c.n_head,
           "--n-embd", c.n_embd, "--block-size", c.block_size, "-i", data, "-b", lay.b, "-t", s.t, "-d", s.d,
           "-z", lay.zero, "-x", 2, "--val-every", 0, "--sample-tokens", 0, "--no-progress",
           "--bucket-mb", s.bucket_mb] + (["--recompute"] if lay.recompute else [])
    if lay.dp > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={lay.dp}"] + cmd
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(out or tmp)
        p = subprocess.run([sys.executable, *map(str, cmd), "--out", str(run_dir)], capture_output=True, text=True)
        if p.returncode:
            errs = [l for l in p.stderr.splitlines() if "error" in l.lower()] or p.stderr.splitlines() or ["no output"]
            raise UserError(f"the --check run failed (exit {p.returncode}): {errs[-1].strip()}")
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        measured = max(json.loads(l)["mem_gb"] for l in lines if l.strip())
    st = e["state"]
    if s.cpu:
        what = "model state at rest (params + grads + optimizer)"
        est = (st["params"] + st["grads"] + st["optimizer"] - st["transient"]) / GB
    else:
        what = "peak allocated (model state + activations)"
        est = e["allocated"] / GB
    return {"layout": asdict(lay), "device": "cpu" if s.cpu else "cuda", "compared": what, "estimate": row_json(e),
            "estimated_gb": est, "measured_gb": measured, "rel_error": (est - measured) / measured}


def run(args) -> int:
    s = setup_from(args)
    if args.check is not None:
        if not args.data:
            raise UserError("--check trains for real: give the data with --data DIR (braidtrain data prepare --out DIR)")
        r = check(s, check_layout(args), args.data, args.out)
        if args.json:
            print(json.dumps(r))
        else:
            print(f"check {Layout(**r['layout']).name()} on {args.gpus} {r['device']} process(es), {r['compared']}: "
                  f"estimated {r['estimated_gb']:.4f} GB, measured {r['measured_gb']:.4f} GB, "
                  f"error {100 * r['rel_error']:+.1f}%")
        return 0
    rc = None if args.recompute is None else (args.recompute,)
    result = plan(s, (args.zero,) if args.zero is not None else (0, 1, 2, 3),
                  (args.batch_size,) if args.batch_size else MICRO_BATCHES, rc or (False, True))
    c = s.cfg
    shape = (f"{c.num_params() / 1e6:,.1f}M parameters (n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}, "
             f"vocab={c.vocab_size}), {s.gpus} x {s.mem_gb:g} GB, -t {s.t} -d {s.d}")
    if args.json:
        print(json.dumps({"model": {**asdict(c), "params": c.num_params()}, "setup": {**asdict(s), "cfg": None},
                          "layouts": [row_json(e) for e in result["rows"]], "recommendation": result["recommendation"]}))
    else:
        print(shape)
        print(table(result, args.top))
    return 0
