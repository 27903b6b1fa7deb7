"""`braidtrain plan`'s flags (the command itself: plan/command.py, loaded when it runs)."""

from __future__ import annotations

import argparse

from braidtrain.config import Config
from braidtrain.parallel import pipeline
from braidtrain.plan.space import MICRO_BATCHES


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
    a("--compile", action="store_true", help="the blocks under torch.compile (as for train): its graphs keep fewer "
                                             "activations for the backward (traced, not assumed)")
    a("--busbw", type=float, default=300.0, help="collective bus bandwidth of the dp (replica) group, GB/s")
    a("--tp-busbw", type=float, help="bus bandwidth of the tp group inside a node, GB/s (default --busbw)")
    a("--node-busbw", type=float, default=40.0, help="bus bandwidth of a group that spans nodes, GB/s per GPU "
                                                     "(default 40: 400 Gb/s InfiniBand)")
    a("--alpha-us", type=float, default=10.0, help="collective latency, microseconds")
    a("--bucket-mb", type=float, default=Config.bucket_mb)
    a("--zero", "-z", type=int, choices=[0, 1, 2, 3], help="only this ZeRO stage")
    a("--batch-size", "-b", type=int, choices=MICRO_BATCHES, help="only this micro-batch")
    a("--recompute", action=argparse.BooleanOptionalAction, help="only layouts with (without) recompute")
    a("--tp", type=int, help="only this tensor-parallel degree (dp = gpus / (pp*cp*tp))")
    a("--sp", action=argparse.BooleanOptionalAction, help="only layouts with (without) sequence parallelism")
    a("--pp", type=int, help="only this number of pipeline stages (dp = gpus / (pp*cp*tp))")
    a("--pp-schedule", choices=pipeline.SCHEDULES, help="only pipelines of this schedule")
    a("--cp", type=int, help="only this context-parallel degree (each sequence over cp GPUs)")
    a("--ep", type=int, help="only this expert-parallel degree (a mixture of experts)")
    for k, kind in (("moe-experts", int), ("moe-top-k", int), ("moe-every", int), ("moe-hidden", int),
                    ("moe-capacity", float)):
        a(f"--{k}", type=kind, help="the model's mixture of experts (as for train)" if k == "moe-experts" else None)
    a("--offload", action=argparse.BooleanOptionalAction, help="only layouts with (without) --offload optimizer "
                                                                "(default: with it too where it can win: nothing fits "
                                                                "without, or it is faster); with --check: offloaded")
    a("--offload-ratio", type=float, metavar="R", help="offloaded layouts at this share (0 < R <= 1) of the "
                                                       "optimizer's state on the host (default: R = 1 and the "
                                                       "smallest R = k/16 that fits the GPU)")
    a("--host-mem", type=float, default=128.0, help="GB of host memory a node (--offload's state lives there; "
                                                    "default 128: the H200 machine's)")
    a("--live-recovery", action="store_true", help="as train's: no expert parallelism, and at ZeRO 1-3 each rank's "
                                                   "copy of its neighbour's shard (parallel/mirror.py)")
    a("--top", type=int, default=12, help="rows of the table (0: all)")
    a("--variants", action="store_true", help="every ZeRO stage, b and recompute of each mesh (default: each mesh's "
                                              "best)")
    a("--json", action="store_true")
    a("--check", nargs="?", const="", metavar="ZERO,B[,recompute]",
      help="train two steps of this layout (or of -z, -b, --recompute; with --tp, --sp) and compare estimated "
           "and measured memory")
    a("--data", "-i", help="token data for --check (braidtrain data prepare --out DIR)")
    a("--out", help="keep the --check run here (default: a temporary folder)")
    return p
