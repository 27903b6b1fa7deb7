"""`braidtrain bench comm|train`'s flags, and the variants bench train runs by default (the
commands themselves: bench/comm.py and bench/train.py, loaded when they run)."""

from __future__ import annotations

import argparse

from braidtrain.options import device

LAYOUTS = ("-z 0", "-z 0 --compile", "-z 1 --compile", "-z 3 --compile", "-z 0 --compile --exact")
GRAPH_LAYOUTS = ("-z 0 --compile --cuda-graph", "-z 0 --compile --exact --cuda-graph")  # added on CUDA
TORCH = ("ddp", "ddp-compile", "fsdp2", "fsdp2-compile")  # the yardsticks (torchref.py says what each compiles)
HF = ("hf", "hf-compile")  # transformers' model of the family, eager and compiled (torchref.hf_model)
LOSS_TOL = {"cpu": 1e-3, "cuda": 2e-2}  # final losses of variants within this (relative): fp32; bf16
PIPE = ("pipe-1f1b", "pipe-interleaved")  # torch.distributed.pipelining's (pp = ranks), beside --layout '--pp N'
FLOAT8 = ("ao-tensorwise", "ao-rowwise")  # torchao's float8 training, beside --layout '--compile --fp8 ...'
TITAN = ("titan", "titan-fp8")  # torchtitan's own Llama (and Llama 4 MoE), its compile and FSDP2 (bench/titan.py)
# transformers' model under FSDP2 with CPUOffloadPolicy (eager, each layer compiled), and under DeepSpeed's
# ZeRO-Offload (where deepspeed is installed), beside --offload optimizer
OFFLOAD = ("fsdp2-offload", "fsdp2-offload-compile", "deepspeed-offload")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv", "exact_reduce_scatter")


def add_parser(sub):
    p = sub.add_parser("bench", help="measure collectives (bench comm) or training against torch DDP/FSDP2 (bench "
                                     "train)")
    bsub = p.add_subparsers(dest="what", required=True, parser_class=sub._parser_class)  # one-line errors too
    c = bsub.add_parser("comm", help="all_reduce, reduce_scatter, all_gather, all_to_all, send_recv, exact "
                                     "reduce-scatter")
    c.add_argument("--min-bytes", type=_size, default=_size("1K"))
    c.add_argument("--max-bytes", type=_size, default=_size("1G"))
    c.add_argument("--iters", type=int, default=20)
    c.add_argument("--warmup", type=int, default=5)
    c.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ",".join(OPS))
    c.add_argument("--json", dest="json_path", help="also write the rows to this file (rank 0)")
    c.add_argument("--device", type=device, help="cpu or cuda (default: the local GPU, else cpu)")
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
                   help="torch variants, a subset "
                        "of " + ",".join(TORCH + HF + PIPE + FLOAT8 + TITAN + OFFLOAD) + " ('' for none; default "
                        + ",".join(TORCH) + "); hf, hf-compile: transformers' model of the family (e.g. "
                                            "LlamaForCausalLM); fsdp2-offload*: that model under FSDP2 with its "
                                            "state on the host (CPUOffloadPolicy); titan*: torchtitan's Llama")
    t.add_argument("--baseline", help="the torch variant the ratios are against (default: ddp-compile if run, else "
                                      "the first of --torch)")
    t.add_argument("--json", dest="json_path", help="also write the rows to this file")
    t.add_argument("--device", type=device, help="cpu or cuda (default: the local GPUs, else cpu)")
    t.add_argument("--keep", metavar="DIR", help="keep the variants' run directories here (with --repeat, in "
                                                 "DIR/round1, DIR/round2, ...; default: a temporary folder)")
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
        n = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, IndexError, OverflowError):
        n = 0
    if not 1 <= n < 2**63:
        # argparse turns this into its one-line error (a UserError here would escape as a traceback)
        raise argparse.ArgumentTypeError(f"'{text}' is not a size: use e.g. 4096, 64K, 16M or 1G")
    return n
