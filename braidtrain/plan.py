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

Activations per micro-batch (b sequences of t tokens, width h, L layers, padded vocabulary V), on
the GPU under bf16 autocast; with them `--check` on an H200 is within 1% for gpt2 at b = 4 ... 16
(vocabularies 50257 and 256, with and without recompute); at b = 1 it reads ~0.1 GB low:
    layers   38*t*b*h per layer: Korthikanti et al. 2022 (Table 2) count 34, without the
             5*a*t^2*b attention matrix (flash / SDPA never stores it), assume a 16-bit residual
             stream; here it is fp32 (the embeddings are, and autocast leaves additions alone), so
             both LayerNorm inputs are 4 bytes and there are no dropout masks:
             ln_1 in 4, c_attn in 2, q k v 6, attention out 2, c_proj in 2, ln_2 in 4, c_fc in 2,
             GELU in 8, GELU out 8 = 38
             recompute: 4*t*b*h per layer (the fp32 block input), plus one block's 38*t*b*h while
             it is rebuilt in the backward, after the logits' buffers are gone (the larger counts)
    head     6*t*b*h: ln_f's fp32 input and the head matmul's bf16 input
    logits   b*t*V*(4 + max(2 + 4, 4 + 4)): the fp32 log-probs the cross-entropy keeps, plus the
             larger of the forward's bf16 logits and their fp32 copy and the backward's fp32
             gradients of the log-probs and of the logits
    weights  2P: autocast's bf16 copies of the weights, cached for the forward and saved for the
             backward (also under ZeRO-3: releasing a gathered fp32 bucket does not free them)
On the CPU (fp32, no autocast) the per token x channel terms count twice and there are no bf16 copies.

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

# Calibration knobs: every number the estimates rest on, named once (bytes per element).
ACT_PER_LAYER = 38  # per token x channel of one block (the docstring counts them)
ACT_KEPT_RECOMPUTE = 4  # per token x channel of one block under recompute: its fp32 input
ACT_HEAD = 4 + 2  # per token x channel: ln_f's fp32 input, the head's bf16 input
LOGITS_KEPT = 4  # per token x vocab: fp32 log-probs saved by the cross-entropy
LOGITS_FWD = 2 + 4  # bf16 logits, their fp32 copy: freed once the loss is computed
LOGITS_BWD = 4 + 4  # fp32 gradients of the log-probs and of the logits, early in the backward
CONTEXT_BYTES = 1e9  # CUDA context, cuBLAS/cuDNN workspaces: outside torch's allocator
ALLOCATOR_SLACK = 0.05  # fragmentation of the caching allocator, a fraction of what it holds
NCCL_BYTES = 0.5e9  # NCCL's channel buffers per communicator (n > 1), outside torch's allocator
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


def bucket_numels(cfg, bucket_mb: float) -> list[tuple[str, int]]:
    """The engine's buckets (parallel/data.py) replayed on sizes, in launch order: whole blocks
    from the last one backwards until a bucket holds >= bucket_mb, then the embedding group
    (wte, tied to the head, wpe, ln_f) alone: it is used at both ends, so its gradient is last."""
    c, limit = cfg.n_embd, max(1, int(bucket_mb * 2**20 / 4))
    out, size = [], 0
    for _ in range(cfg.n_layer):
        size += 12 * c * c + 13 * c
        if size >= limit:
            out.append(("block", size))
            size = 0
    embed = cfg.padded_vocab * c + cfg.block_size * c + 2 * c
    return out + ([("block", size)] if size else []) + [("embed", embed)]


def activation_bytes(cfg, b: int, t: int, recompute: bool, cpu: bool, P: int) -> dict:
    """Named terms (see the module docstring), so each can be calibrated on its own; `peak` is
    what they add up to at the worst moment, the start of the backward pass."""
    scale = 2 if cpu else 1  # fp32 on the CPU
    tbh, btv = t * b * cfg.n_embd * scale, b * t * cfg.padded_vocab
    terms = {
        "layers": (ACT_KEPT_RECOMPUTE if recompute else ACT_PER_LAYER) * tbh * cfg.n_layer,
        "block_recomputed": ACT_PER_LAYER * tbh if recompute else 0,
        "head": ACT_HEAD * tbh,
        "logits": LOGITS_KEPT * btv + max(LOGITS_FWD, LOGITS_BWD) * btv,
        "weights_bf16": 0 if cpu else 2 * P,
    }
    # a block rebuilt by recompute lives after the logits' gradients are gone: the larger counts
    transient = max(terms["logits"], terms["block_recomputed"])
    terms["peak"] = terms["layers"] + terms["head"] + terms["weights_bf16"] + transient
    return terms


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
    mem["activations"] = act["peak"]
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


def rank(rows: list[dict]) -> list[dict]:
    """Fits first, then by step time. Times equal to 3 digits are a tie (the model cannot tell
    them apart); then fewer micro-steps (larger GEMMs, which a constant --tflops does not see),
    less sharding, less memory."""
    return sorted(rows, key=lambda e: (not e["fits"], float(f"{e['step_s']:.3g}"), e["micro_steps"],
                                       e["layout"].zero, e["mem"]["total"]))


def fix(s: Setup, e: dict, fitting: list[dict]) -> str:
    """The smallest change that makes a layout fit: the fitting layouts that differ from it in
    the fewest settings (the best of each kind of change); failing any, larger or more GPUs."""
    lay = e["layout"]
    changed = lambda f: tuple(k for k in ("zero", "b", "recompute") if getattr(f["layout"], k) != getattr(lay, k))
    say = {"zero": lambda l: f"ZeRO-{l.zero}", "b": lambda l: f"b={l.b}",
           "recompute": lambda l: "--recompute" if l.recompute else "no recompute"}
    opts = []
    if fitting:
        fewest = min(len(changed(f)) for f in fitting)
        for f in fitting:  # best first: the first of each kind of change is its best
            ks = changed(f)
            if len(ks) == fewest and not any(ks == o[0] for o in opts):
                opts.append((ks, " ".join(say[k](f["layout"]) for k in ks)))
        opts = [o[1] for o in opts]
    else:
        opts.append(f"GPUs with >= {math.ceil(e['mem']['total'] / GB)} GB")
        m = gpus_needed(s)
        opts += [f"{m} GPUs with ZeRO-3 b=1 --recompute"] if m else []
    return f"{lay.name()} needs {e['mem']['total'] / GB:.1f} GB > {s.mem_gb:g} GB: use " + ", or ".join(opts)


def nothing_fits(s: Setup, grid: list[dict]) -> str:
    lean = min(grid, key=lambda e: e["mem"]["total"])
    need = lean["mem"]["total"] / GB
    msg = (f"nothing fits on {s.gpus} x {s.mem_gb:g} GB: the leanest layout, {lean['layout'].name()}, "
           f"needs {need:.1f} GB per GPU; use GPUs with >= {math.ceil(need)} GB")
    m = gpus_needed(s)
    if m:
        msg += f", or {m} GPUs with ZeRO-3 b=1 --recompute" + (f" (-d a multiple of {s.t * m})" if s.d % (s.t * m) else "")
    return msg


def plan(s: Setup, zeros=(0, 1, 2, 3), bs=MICRO_BATCHES, recomputes=(False, True)) -> dict:
    """The layouts asked for, ranked, each that does not fit with its fix; the fixes and the
    recommendation look at every layout."""
    rows = rank([estimate(s, lay) for lay in layouts(s, zeros, bs, recomputes)])
    grid = rank([estimate(s, lay) for lay in layouts(s)])
    if not rows or not grid:
        unit = s.t * s.gpus
        raise UserError(f"-d {s.d} is not a multiple of b*t*dp = b*{s.t}*{s.gpus} for any allowed b: "
                        f"use -d {max(1, s.d // unit) * unit}")
    fitting = [e for e in grid if e["fits"]]
    for e in rows:
        e["fix"] = None if e["fits"] else fix(s, e, fitting)
    best = rows[0] if rows[0]["fits"] else fitting[0] if fitting else None
    if best is None:
        rec = nothing_fits(s, grid)
    else:
        rec = (f"recommended: {best['layout'].name()} on {s.gpus} GPU(s), {best['micro_steps']} micro-step(s): "
               f"{best['mem']['total'] / GB:.1f} of {s.mem_gb:g} GB, {best['step_s']:.3f} s/step, "
               f"{best['tokens_per_s']:,.0f} tokens/s" + ("" if best is rows[0] else " (none of the layouts asked for fits)"))
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
    m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)([kmbt]?)", text.strip().lower())
    if not m:
        raise UserError(f"--params {text!r} is not a count: use e.g. 124M, 1.5B or 7e9")
    return int(float(m[1]) * 10 ** (3 * " kmbt".index(m[2] or " ")))


def assumed_shape(n_params: int, vocab: int, block_size: int):
    """A GPT-2-shaped model of about n_params: head size 64, width 64 x depth (GPT-2 small's
    aspect ratio) for the depth, then the head count that comes closest."""
    from braidtrain.model.gpt import GPTConfig

    size = lambda L, k: GPTConfig(L, k, 64 * k, block_size, vocab).num_params()
    L = min(range(1, 1000), key=lambda L: abs(size(L, L) - n_params))
    k = min(range(1, 4 * L + 1), key=lambda k: abs(size(L, k) - n_params))
    return GPTConfig(L, k, 64 * k, block_size, vocab)


def add_parser(sub):
    p = sub.add_parser("plan", help="memory and step time of every layout; --check one against a real run",
                       allow_abbrev=False)
    a = p.add_argument
    a("--model", "-e", help="preset (tiny, gpt2 ... gpt2-xl) or llm.c's dN (default gpt2)")
    a("--params", help="a parameter count (124M, 1.5B) for an assumed GPT-2 shape, instead of --model")
    for k in ("n-layer", "n-head", "n-embd", "block-size"):
        a(f"--{k}", type=int)
    a("--vocab", type=int, default=50257, help="tokenizer vocabulary (default GPT-2's; --data's wins)")
    a("--gpus", type=int, default=1, help="GPUs (all data-parallel, for now)")
    a("--gpu-mem", type=float, default=80.0, help="GB per GPU")
    a("--seq-len", "-t", type=int, default=1024)
    a("--total-batch", "-d", type=int, default=524288, help="tokens per optimizer step")
    a("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU (default: H200, bf16)")
    a("--busbw", type=float, default=300.0, help="collective bus bandwidth, GB/s")
    a("--alpha-us", type=float, default=10.0, help="collective latency, microseconds")
    a("--bucket-mb", type=float, default=25.0)
    a("--zero", "-z", type=int, choices=[0, 1, 2, 3], help="only this ZeRO stage")
    a("--batch-size", "-b", type=int, choices=MICRO_BATCHES, help="only this micro-batch")
    a("--recompute", action=argparse.BooleanOptionalAction, help="only layouts with (without) recompute")
    a("--top", type=int, default=12, help="rows of the table (0: all)")
    a("--json", action="store_true")
    a("--check", nargs="?", const="", metavar="ZERO,B[,recompute]",
      help="train two steps of this layout (or of -z, -b, --recompute) and compare estimated and measured memory")
    a("--data", "-i", help="token data for --check (braidtrain data prepare --out DIR)")
    a("--out", help="keep the --check run here (default: a temporary folder)")
    return p


def setup_from(args) -> Setup:
    for k in ("gpus", "gpu_mem", "seq_len", "total_batch", "tflops", "busbw", "bucket_mb", "vocab"):
        if getattr(args, k) <= 0:
            raise UserError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k):g}")
    if args.alpha_us < 0 or args.top < 0:
        raise UserError("--alpha-us and --top must be >= 0")
    if args.params and args.model:
        raise UserError("give --model or --params, not both")
    meta = Path(args.data or "") / "tokenizer.json"  # the check's run trains with the data's vocabulary
    vocab = json.loads(meta.read_text())["vocab_size"] if args.data and meta.is_file() else args.vocab
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
    if not args.check:  # the layout from the flags
        if args.zero is None or args.batch_size is None:
            raise UserError("--check needs a layout: --check ZERO,B[,recompute], or -z ZERO -b B [--recompute]")
        return Layout(args.gpus, args.zero, args.batch_size, bool(args.recompute))
    m = re.fullmatch(r"([0-3]),([1-9][0-9]*)(,recompute)?", args.check.replace(" ", ""))
    if not m:
        raise UserError(f"--check {args.check!r}: use ZERO,B or ZERO,B,recompute with ZERO 0-3 (e.g. 1,8)")
    return Layout(args.gpus, int(m[1]), int(m[2]), bool(m[3]))


def check(s: Setup, lay: Layout, data: str, out: str | None) -> dict:
    """Two real training steps of this layout (the first optimizer step, which creates Adam's
    state, included), then estimated vs measured mem_gb. On a GPU that is torch's peak
    allocation, compared with `allocated`; on the CPU it is the model state a rank holds between
    steps (params + grads + Adam m, v), compared with the model state less its transient part."""
    import torch

    s = replace(s, cpu=not torch.cuda.is_available())  # where `braidtrain train` will run
    if s.d % (lay.b * s.t * lay.dp):
        raise UserError(f"-d {s.d} is not a multiple of b*t*dp = {lay.b}*{s.t}*{lay.dp}")
    e, c = estimate(s, lay), s.cfg
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
            lines = [l for l in p.stderr.splitlines() if "error" in l.lower()] or p.stderr.splitlines() or ["no output"]
            raise UserError(f"the --check run failed (exit {p.returncode}): {lines[-1].strip()}")
        measured = max(json.loads(l)["mem_gb"] for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip())
    st = e["state"]
    est = (st["params"] + st["grads"] + st["optimizer"] - st["transient"] if s.cpu else e["allocated"]) / GB
    return {"layout": asdict(lay), "device": "cpu" if s.cpu else "cuda", "estimated_gb": est,
            "measured_gb": measured, "rel_error": (est - measured) / measured, "estimate": row_json(e),
            "compared": "model state between steps" if s.cpu else "peak allocated (model state + activations)"}


def run(args) -> int:
    s = setup_from(args)
    if args.check is not None:
        if not args.data:
            raise UserError("--check trains for real: give its data with --data DIR (braidtrain data prepare --out DIR)")
        r = check(s, check_layout(args), args.data, args.out)
        print(json.dumps(r) if args.json else
              f"check {Layout(**r['layout']).name()} on {args.gpus} {r['device']} process(es), {r['compared']}: "
              f"estimated {r['estimated_gb']:.4f} GB, measured {r['measured_gb']:.4f} GB, error {100 * r['rel_error']:+.1f}%")
        return 0
    pick = lambda v, all_: all_ if v is None else (v,)
    result = plan(s, pick(args.zero, (0, 1, 2, 3)), pick(args.batch_size, MICRO_BATCHES), pick(args.recompute, (False, True)))
    c = s.cfg
    if args.json:
        print(json.dumps({"model": {**asdict(c), "params": c.num_params()}, "setup": {**asdict(s), "cfg": None},
                          "layouts": [row_json(e) for e in result["rows"]], "recommendation": result["recommendation"]}))
        return 0
    print(f"{c.num_params() / 1e6:,.1f}M parameters (n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}, "
          f"vocab={c.vocab_size}), {s.gpus} x {s.mem_gb:g} GB, -t {s.t} -d {s.d}")
    print(table(result, args.top))
    return 0
