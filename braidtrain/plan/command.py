"""`braidtrain plan`, the command: its flags, the ranked table, and `--check`, which trains a
layout for two steps and compares the planner's memory estimate with what the run measured. The
planner itself -- the layouts, their memory and step time, the ranking and the fixes -- is
plan.py."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from braidtrain.plan import estimate as plan
from braidtrain.config import Config
from braidtrain.errors import UserError
from braidtrain.layout import make_layout
from braidtrain.parallel import pipeline

# ---------------------------------------------------------------------------------- output

COLUMNS = ("params", "grads", "optimizer", "activations", "comm", "overhead")


def row_json(e: dict) -> dict:
    return {**asdict(e["layout"]), "micro_steps": e["micro_steps"], "fits": e["fits"],
            "mem_gb": {k: v / plan.GB for k, v in e["mem"].items()}, "allocated_gb": e["allocated"] / plan.GB,
            "activations_gb": {k: v / plan.GB for k, v in e["activations"].items()},
            "compute_s": e["compute_s"], "exposed_comm_s": e["comm_s"], "dp_exposed_comm_s": e["dp_comm_s"],
            "tp_comm_s": e["tp_comm_s"], "pp_comm_s": e["pp_comm_s"], "cp_comm_s": e["cp_comm_s"], "step_s": e["step_s"],
            "tokens_per_s": e["tokens_per_s"], "fix": e.get("fix"),
            **({"bubble": e["bubble"], "stages_gb": e["stages_gb"]} if "bubble" in e else {})}


def table(result: dict, top: int) -> str:
    """The ranked rows; the tp and sp columns only when a row shown has tp > 1, the pipeline's
    (pp, its schedule, the largest of its ranks' bubbles: the first stage's, the papers') when one
    has pp > 1; memory is the fullest rank's."""
    shown = result["rows"][:top] if top > 0 else result["rows"]
    tp, pp = any(e["layout"].tp > 1 for e in shown), any(e["layout"].pp > 1 for e in shown)
    cp, ep = any(e["layout"].cp > 1 for e in shown), any(e["layout"].ep > 1 for e in shown)
    head = ["dp", *(["tp", "sp"] if tp else []), *(["pp", "sched", "bubble"] if pp else []), *(["cp"] if cp else []),
            *(["ep"] if ep else []),
            "zero", "b", "micro",
            "recomp", "mem GB", "params", "grads", "optim", "activ", "comm", "ovhd", "step s", "tokens/s", "fits"]
    lines = [head]
    for e in shown:
        lay, m = e["layout"], e["mem"]
        mesh = [lay.tp, "on" if lay.sp else "off"] if tp else []
        if pp:
            pipe = "-" if lay.pp == 1 else lay.schedule + (f"x{lay.virtual}" if lay.virtual > 1 else "")
            bubble = f"{max(e['bubble']):.0%}" if lay.pp > 1 else "-"
            mesh += [lay.pp, pipe, bubble]
        mesh += [f"{lay.cp}" + ("ag" if lay.cp_impl == "allgather" else "") if lay.cp > 1 else 1] if cp else []
        mesh += [lay.ep] if ep else []
        lines.append([lay.dp, *mesh, lay.zero, lay.b, e["micro_steps"], "on" if lay.recompute else "off",
                      f"{m['total'] / plan.GB:.1f}", *(f"{m[k] / plan.GB:.2f}" for k in COLUMNS),
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
    from braidtrain.model.gpt2 import GPTConfig

    size = lambda L, k: GPTConfig(L, k, 64 * k, block_size, vocab).num_params()
    L = min(range(1, 1000), key=lambda L: abs(size(L, L) - n_params))
    k = min(range(1, 4 * L + 1), key=lambda k: abs(size(L, k) - n_params))
    return GPTConfig(L, k, 64 * k, block_size, vocab)


def add_parser(sub):
    p = sub.add_parser("plan", help="memory and step time of every layout; --check one against a real run",
                       allow_abbrev=False)
    a = p.add_argument
    a("--model", "-e", help="a model family's preset, e.g. gpt2, gpt2-xl, llm.c's d12, llama3.1-8b (default gpt2)")
    a("--params", help="a parameter count (124M, 1.5B) for an assumed GPT-2 shape, instead of --model")
    for k in ("n-layer", "n-head", "n-embd", "block-size", "n-kv-heads"):
        a(f"--{k}", type=int)
    a("--vocab", type=int, help="tokenizer vocabulary (default: the model family's tokenizer's; --data's wins)")
    a("--gpus", type=int, default=1, help="GPUs (pp x dp x cp x tp)")
    a("--gpus-per-node", type=int, help="GPUs of one node (default: all --gpus); groups that span nodes "
                                        "talk at --node-busbw")
    a("--gpu-mem", type=float, default=80.0, help="GB per GPU")
    a("--seq-len", "-t", type=int, default=1024)
    a("--total-batch", "-d", type=int, default=524288, help="tokens per optimizer step")
    a("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU (default: H200, bf16)")
    a("--fp8", choices=["tensorwise", "rowwise"], help="the blocks' linears in float8 (as for train): their "
                                                        "products at the measured float8 speed, their float8 copies")
    a("--busbw", type=float, default=300.0, help="collective bus bandwidth of the dp (replica) group, GB/s")
    a("--tp-busbw", type=float, help="bus bandwidth of the tp group inside a node, GB/s (default --busbw)")
    a("--node-busbw", type=float, default=40.0, help="bus bandwidth of a group that spans nodes, GB/s per GPU "
                                                     "(default 40: 400 Gb/s InfiniBand)")
    a("--alpha-us", type=float, default=10.0, help="collective latency, microseconds")
    a("--bucket-mb", type=float, default=Config.bucket_mb)
    a("--zero", "-z", type=int, choices=[0, 1, 2, 3], help="only this ZeRO stage")
    a("--batch-size", "-b", type=int, choices=plan.MICRO_BATCHES, help="only this micro-batch")
    a("--recompute", action=argparse.BooleanOptionalAction, help="only layouts with (without) recompute")
    a("--tp", type=int, help="only this tensor-parallel degree (dp = gpus / (pp*cp*tp))")
    a("--sp", action=argparse.BooleanOptionalAction, help="only layouts with (without) sequence parallelism")
    a("--pp", type=int, help="only this number of pipeline stages (dp = gpus / (pp*cp*tp))")
    a("--pp-schedule", choices=pipeline.SCHEDULES, help="only pipelines of this schedule")
    a("--cp", type=int, help="only this context-parallel degree (each sequence over cp GPUs)")
    a("--ep", type=int, help="only this expert-parallel degree (a mixture of experts)")
    for k, kind in (("moe-experts", int), ("moe-top-k", int), ("moe-every", int), ("moe-hidden", int), ("moe-capacity", float)):
        a(f"--{k}", type=kind, help="the model's mixture of experts (as for train)" if k == "moe-experts" else None)
    a("--top", type=int, default=12, help="rows of the table (0: all)")
    a("--variants", action="store_true", help="every ZeRO stage, b and recompute of each mesh (default: each mesh's best)")
    a("--json", action="store_true")
    a("--check", nargs="?", const="", metavar="ZERO,B[,recompute]",
      help="train two steps of this layout (or of -z, -b, --recompute; with --tp, --sp) and compare estimated "
           "and measured memory")
    a("--data", "-i", help="token data for --check (braidtrain data prepare --out DIR)")
    a("--out", help="keep the --check run here (default: a temporary folder)")
    return p


def setup_from(args) -> plan.Setup:
    for k in ("gpus", "gpu_mem", "seq_len", "total_batch", "tflops", "busbw", "bucket_mb", "vocab", "tp_busbw", "tp", "pp", "cp",
              "ep", "gpus_per_node", "node_busbw"):
        if getattr(args, k) is not None and getattr(args, k) <= 0:
            raise UserError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k):g}")
    if args.alpha_us < 0 or args.top < 0:
        raise UserError("--alpha-us and --top must be >= 0")
    if args.params and args.model:
        raise UserError("give --model or --params, not both")
    meta = Path(args.data or "") / "tokenizer.json"  # the check's run trains with the data's vocabulary
    vocab = json.loads(meta.read_text())["vocab_size"] if args.data and meta.is_file() else args.vocab
    if args.params:
        cfg = assumed_shape(parse_count(args.params), vocab or 50257, args.block_size or max(1024, args.seq_len))
    else:
        from braidtrain.model import registry

        fields = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "n_kv_heads", "moe_experts",
                                                 "moe_top_k", "moe_every", "moe_hidden", "moe_capacity")}
        cfg = registry.model_config(args.model or "gpt2", vocab, **fields)
        if args.block_size is None and cfg.block_size < args.seq_len:  # a longer context than the preset's: train's --block-size
            cfg = replace(cfg, block_size=args.seq_len)
    s = plan.Setup(cfg, args.gpus, args.gpu_mem, args.seq_len, args.total_batch, args.tflops, args.busbw,
              args.alpha_us, args.bucket_mb, tp_busbw=args.tp_busbw, gpus_per_node=args.gpus_per_node,
              node_busbw=args.node_busbw, fp8=args.fp8)
    check_mesh(s, args.tp, args.sp, args.pp, args.pp_schedule, args.cp, args.ep)
    return s


def check_mesh(s: plan.Setup, tp: int | None, sp: bool | None, pp: int | None = None, schedule: str | None = None,
               cp: int | None = None, ep: int | None = None) -> None:
    """One-line UserErrors for a --tp / --sp / --pp / --cp the GPUs or the model cannot take
    (layout.py's), or the planner cannot weigh."""
    make_layout(s.gpus, s.cfg, seq_len=s.t, batch_size=1, tp=tp or 1, sp=bool(sp) and tp is not None,
                pp=pp or 1, cp=cp or 1, ep=ep or 1, schedule="gpipe", world_name=f"--gpus {s.gpus}")
    if schedule and pp == 1:
        raise UserError(f"--pp-schedule {schedule} orders a pipeline's stages: give --pp 2 or more (or drop it)")
    if sp and not any(True for _ in plan.meshes(s, None if tp is None else (tp,), (True,))):
        raise UserError(f"--sp: no tp > 1 divides the GPUs ({s.gpus}), n_head ({s.cfg.n_head}) and -t {s.t}")


def check_layout(args) -> plan.Candidate:
    """The layout of --check ZERO,B[,recompute] or of -z, -b, --recompute; the mesh from --tp, --sp,
    --pp and --pp-schedule (default 1f1b)."""
    tp, pp, cp = args.tp or 1, args.pp or 1, args.cp or 1
    mesh = dict(dp=args.gpus // (tp * pp * cp), tp=tp, sp=bool(args.sp), pp=pp, cp=cp, ep=args.ep or 1)
    if pp > 1:
        mesh.update(schedule=args.pp_schedule or "1f1b", virtual=2 if args.pp_schedule == "interleaved" else 1)
    if not args.check:  # the layout from the flags
        if args.zero is None or args.batch_size is None:
            raise UserError("--check needs a layout: --check ZERO,B[,recompute], or -z ZERO -b B [--recompute] "
                            "(and --tp N [--sp])")
        return plan.Candidate(zero=args.zero, b=args.batch_size, recompute=bool(args.recompute), **mesh)
    m = re.fullmatch(r"([0-3]),([1-9][0-9]*)(,recompute)?", args.check.replace(" ", ""))
    if not m:
        raise UserError(f"--check {args.check!r}: use ZERO,B or ZERO,B,recompute with ZERO 0-3 (e.g. 1,8)")
    return plan.Candidate(zero=int(m[1]), b=int(m[2]), recompute=bool(m[3]), **mesh)


def check(s: plan.Setup, lay: plan.Candidate, data: str, out: str | None) -> dict:
    """Two real training steps of this layout (the first optimizer step, which creates Adam's
    state, included), then estimated vs measured mem_gb. On a GPU that is torch's peak
    allocation, compared with `allocated`; on the CPU it is the model state a rank holds between
    steps (params + grads + Adam m, v), compared with the model state less its transient part.
    Under tp both are one rank's: its shards and the replicated parameters (rank 0's mem_gb); under
    pp rank 0's, the first stage's."""
    import torch

    s = replace(s, cpu=not torch.cuda.is_available())  # where `braidtrain train` will run
    make_layout(lay.gpus, s.cfg, seq_len=s.t, batch_size=lay.b, total_batch=s.d, world_name=f"--gpus {lay.gpus}",
                **lay.layout_kw())  # what `train` will ask
    e, c = plan.estimate(s, lay), s.cfg
    from braidtrain.model import registry

    cmd = ["-m", "braidtrain", "train", *registry.command_line(c), "-i", data, "-b", lay.b, "-t", s.t, "-d", s.d,
           "-z", lay.zero, "-x", 2, "--val-every", 0, "--sample-tokens", 0, "--no-progress",
           "--bucket-mb", s.bucket_mb] + (["--tp", lay.tp] if lay.tp > 1 else []) + (["--sp"] if lay.sp else [])
    cmd += ["--pp", lay.pp, "--pp-schedule", lay.schedule, "--pp-virtual", lay.virtual] if lay.pp > 1 else []
    cmd += ["--recompute"] if lay.recompute else []
    cmd += ["--cp", lay.cp, "--cp-impl", lay.cp_impl] if lay.cp > 1 else []
    cmd += ["--ep", lay.ep] if lay.ep > 1 else []
    cmd += ["--fp8", s.fp8] if s.fp8 else []
    if lay.gpus > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={lay.gpus}"] + cmd
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(out or tmp)
        p = run_job([sys.executable, *map(str, cmd), "--out", str(run_dir)])
        if p.returncode:
            lines = [l for l in p.stderr.splitlines() if "error" in l.lower()] or p.stderr.splitlines() or ["no output"]
            raise UserError(f"the --check run failed (exit {p.returncode}): {lines[-1].strip()}")
        measured = max(json.loads(l)["mem_gb"] for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip())
    st = e["stage_state"][0] if lay.pp > 1 else e["state"]  # rank 0's: the first stage's
    est = (st["params"] + st["grads"] + st["optimizer"] - st["transient"] if s.cpu else e["allocated"]) / plan.GB
    return {"layout": asdict(lay), "device": "cpu" if s.cpu else "cuda", "estimated_gb": est,
            "measured_gb": measured, "rel_error": (est - measured) / measured, "estimate": row_json(e),
            "compared": "model state between steps" if s.cpu else "peak allocated (model state + activations)"}


def run_job(cmd: list) -> subprocess.CompletedProcess:
    """The check's run, its output captured (the tests fork it instead: tests/helpers.forked)."""
    return subprocess.run(cmd, capture_output=True, text=True)


def run(args) -> int:
    s = setup_from(args)
    if args.check is not None:
        if not args.data:
            raise UserError("--check trains for real: give its data with --data DIR (braidtrain data prepare --out DIR)")
        r = check(s, check_layout(args), args.data, args.out)
        print(json.dumps(r) if args.json else
              f"check {plan.Candidate(**r['layout']).name()} on {args.gpus} {r['device']} process(es), {r['compared']}: "
              f"estimated {r['estimated_gb']:.4f} GB, measured {r['measured_gb']:.4f} GB, error {100 * r['rel_error']:+.1f}%")
        return 0
    pick = lambda v, all_: all_ if v is None else (v,)
    result = plan.plan(s, pick(args.zero, (0, 1, 2, 3)), pick(args.batch_size, plan.MICRO_BATCHES), pick(args.recompute, (False, True)),
                  None if args.tp is None else (args.tp,), pick(args.sp, (False, True)),
                  None if args.pp is None else (args.pp,), None if args.pp_schedule is None else (args.pp_schedule,),
                  None if args.cp is None else (args.cp,), None if args.ep is None else (args.ep,),
                  variants=args.variants or args.json)
    c = s.cfg
    if args.json:
        print(json.dumps({"model": {**asdict(c), "params": c.num_params()}, "setup": {**asdict(s), "cfg": None},
                          "layouts": [row_json(e) for e in result["rows"]], "recommendation": result["recommendation"]}))
        return 0
    node = f" ({s.gpus_per_node} a node)" if s.gpus_per_node and s.gpus_per_node < s.gpus else ""
    heads = [k for k in range(2, c.n_head + 1) if c.n_head % k == 0]
    no_tp = f"; no tp: no divisor of n_head {c.n_head} ({heads}) divides {s.gpus}" if s.gpus > 1 and plan.tp_degrees(s) == [1] else ""
    print(f"{c.num_params() / 1e6:,.1f}M parameters (n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}, "
          f"block_size={c.block_size}, vocab={c.vocab_size}), {s.gpus} x {s.mem_gb:g} GB{node}, -t {s.t} -d {s.d}{no_tp}")
    print(table(result, args.top))
    return 0
