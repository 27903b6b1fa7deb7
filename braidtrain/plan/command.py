"""`braidtrain plan`, the command (its flags: plan/flags.py): the model it weighs (a preset, or an
assumed GPT-2 shape of --params), the ranked table or JSON, and --check (plan/check.py)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path

from braidtrain.errors import UserError
from braidtrain.layout import check_offload, make_layout
from braidtrain.model import registry
from braidtrain.model.gpt2 import GPTConfig
from braidtrain.plan import check
from braidtrain.plan.memory import GB
from braidtrain.plan.report import row_json, table
from braidtrain.plan.search import plan
from braidtrain.plan.space import MICRO_BATCHES, Candidate, Setup, meshes, tp_degrees


def parse_count(text: str) -> int:
    """124M, 1.5B, 7e9 -> an integer parameter count."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([kmbt]?)", text.strip().lower())
    n = int(float(m[1]) * 10 ** (3 * " kmbt".index(m[2] or " "))) if m else 0
    if n < 1 or n > 10**15:
        raise UserError(f"--params {text!r} is not a count of parameters: use e.g. 124M, 1.5B or 7e9")
    return n


def assumed_shape(n_params: int, vocab: int, block_size: int):
    """A GPT-2-shaped model of about n_params: head size 64, width 64 x depth (GPT-2 small's
    aspect ratio) for the depth, then the head count that comes closest."""
    size = lambda L, k: GPTConfig(L, k, 64 * k, block_size, vocab).num_params()
    L = min(range(1, 1000), key=lambda L: abs(size(L, L) - n_params))
    k = min(range(1, 4 * L + 1), key=lambda k: abs(size(L, k) - n_params))
    return GPTConfig(L, k, 64 * k, block_size, vocab)


MAX_GPUS = 2**20  # (the planner walks every mesh of --gpus)


def setup_from(args) -> Setup:
    if args.gpus > MAX_GPUS:
        raise UserError(f"--gpus {args.gpus} is out of range: at most {MAX_GPUS}")
    for k in ("n_layer", "n_head", "n_embd", "block_size", "n_kv_heads", "moe_top_k", "moe_every"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            raise UserError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k)}")
    for k in ("moe_experts", "moe_hidden", "moe_capacity"):
        if getattr(args, k) is not None and getattr(args, k) < 0:
            raise UserError(f"--{k.replace('_', '-')} must be >= 0, got {getattr(args, k):g}")
    for k in ("gpus", "gpu_mem", "seq_len", "total_batch", "tflops", "busbw", "bucket_mb", "vocab", "tp_busbw", "tp",
              "pp", "cp", "ep", "gpus_per_node", "node_busbw", "host_mem"):
        if getattr(args, k) is not None and getattr(args, k) <= 0:
            raise UserError(f"--{k.replace('_', '-')} must be positive, got {getattr(args, k):g}")
    for k in ("alpha_us", "top"):
        if getattr(args, k) < 0:
            raise UserError(f"--{k.replace('_', '-')} must be >= 0, got {getattr(args, k):g}")
    if args.params and args.model:
        raise UserError("give --model or --params, not both")
    meta = Path(args.data or "") / "tokenizer.json"  # the check's run trains with the data's vocabulary
    vocab = json.loads(meta.read_text())["vocab_size"] if args.data and meta.is_file() else args.vocab
    if args.params:
        cfg = assumed_shape(parse_count(args.params), vocab or 50257, args.block_size or max(1024, args.seq_len))
    else:
        fields = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "n_kv_heads",
                                                 "moe_experts", "moe_top_k", "moe_every", "moe_hidden", "moe_capacity")}
        cfg = registry.model_config(args.model or "gpt2", vocab, **fields)
        # a longer context than the preset's: train's --block-size
        if args.block_size is None and cfg.block_size < args.seq_len:
            cfg = replace(cfg, block_size=args.seq_len)
    s = Setup(cfg, args.gpus, args.gpu_mem, args.seq_len, args.total_batch, args.tflops, args.busbw,
              args.alpha_us, args.bucket_mb, tp_busbw=args.tp_busbw, gpus_per_node=args.gpus_per_node,
              node_busbw=args.node_busbw, fp8=args.fp8, compile=args.compile, live=args.live_recovery,
              host_gb=args.host_mem)
    if args.live_recovery and (args.ep or 1) != 1:
        raise UserError(f"--live-recovery does not recover expert parallelism, got --ep {args.ep} (its groups span "
                        f"replicas: live/trainer.py check_config)")
    if args.live_recovery and args.check is not None:
        raise UserError("--check runs under torchrun, which --live-recovery cannot (its agent stops every worker when "
                        "one fails); the copies' bytes are checked against a live run by tests/test_live.py")
    check_mesh(s, args.tp, args.sp, args.pp, args.pp_schedule, args.cp, args.ep)
    return s


def check_mesh(s: Setup, tp: int | None, sp: bool | None, pp: int | None = None, schedule: str | None = None,
               cp: int | None = None, ep: int | None = None) -> None:
    """One-line UserErrors for a --tp / --sp / --pp / --cp the GPUs or the model cannot take
    (layout.py's), or the planner cannot weigh."""
    make_layout(s.gpus, s.cfg, seq_len=s.t, batch_size=1, tp=tp or 1, sp=bool(sp) and tp is not None,
                pp=pp or 1, cp=cp or 1, ep=ep or 1, schedule="gpipe", world_name=f"--gpus {s.gpus}")
    if schedule and pp == 1:
        raise UserError(f"--pp-schedule {schedule} orders a pipeline's stages: give --pp 2 or more (or drop it)")
    if sp and not any(True for _ in meshes(s, None if tp is None else (tp,), (True,))):
        raise UserError(f"--sp: no tp > 1 divides the GPUs ({s.gpus}), n_head ({s.cfg.n_head}) and -t {s.t}")


def run(args) -> int:
    s = setup_from(args)
    if args.offload_ratio is not None:  # (as train's: layout.py)
        check_offload("optimizer" if args.offload is not False else None, False, args.offload_ratio, "--offload")
    if args.check is not None:
        if not args.data:
            raise UserError("--check trains for real: give its data with --data DIR (braidtrain data prepare --out "
                            "DIR)")
        r = check.check(s, check.check_layout(args), args.data, args.out)
        host = (f"; host: estimated {r['host_estimated_gb']:.4f} GB, measured {r['host_measured_gb']:.4f} GB, error "
                f"{100 * r['host_rel_error']:+.1f}%" if "host_measured_gb" in r else "")
        print(json.dumps(r) if args.json else
              f"check {Candidate(**r['layout']).name()} on {args.gpus} {r['device']} process(es), {r['compared']}: "
              f"estimated {r['estimated_gb']:.4f} GB, measured {r['measured_gb']:.4f} GB, error "
              f"{100 * r['rel_error']:+.1f}%{host}")
        return 0
    pick = lambda v, all_: all_ if v is None else (v,)
    offloads = (True,) if args.offload is None and args.offload_ratio is not None else pick(args.offload, None)
    result = plan(s, pick(args.zero, (0, 1, 2, 3)), pick(args.batch_size, MICRO_BATCHES),
                  pick(args.recompute, (False, True)), None if args.tp is None else (args.tp,),
                  pick(args.sp, (False, True)),
                  None if args.pp is None else (args.pp,), None if args.pp_schedule is None else (args.pp_schedule,),
                  None if args.cp is None else (args.cp,), None if args.ep is None else (args.ep,),
                  variants=args.variants or args.json, offloads=offloads,
                  ratio=args.offload_ratio)
    if args.offload and not any(e["host"] <= s.host_gb * GB for e in result["rows"]):
        need = min(e["host"] for e in result["rows"]) / GB
        raise UserError(f"--offload: the host cannot hold the optimizer's state: the leanest layout needs {need:.1f} "
                        f"GB of host memory a node > --host-mem {s.host_gb:g}; use more nodes, or ZeRO over more GPUs")
    c = s.cfg
    if args.json:
        print(json.dumps({"model": {**asdict(c), "params": c.num_params()}, "setup": {**asdict(s), "cfg": None},
                          "layouts": [row_json(e) for e in result["rows"]],
                          "recommendation": result["recommendation"]}))
        return 0
    node = f" ({s.gpus_per_node} a node)" if s.gpus_per_node and s.gpus_per_node < s.gpus else ""
    heads = [k for k in range(2, c.n_head + 1) if c.n_head % k == 0]
    no_tp = ""
    if s.gpus > 1 and tp_degrees(s) == [1]:
        no_tp = f"; no tp: no divisor of n_head {c.n_head} ({heads}) divides {s.gpus}"
    print(f"{c.num_params() / 1e6:,.1f}M parameters (n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}, "
          f"block_size={c.block_size}, vocab={c.vocab_size}), {s.gpus} x {s.mem_gb:g} GB{node}, -t {s.t} -d "
          f"{s.d}{no_tp}")
    print(table(result, args.top))
    return 0
