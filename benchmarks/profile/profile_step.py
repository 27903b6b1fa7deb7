"""Where one training step's GPU time goes: braidtrain's own trainer, torch.profiler around a step.

    python benchmarks/profile/profile_step.py [train flags ...]     # from the repo root, one GPU
    e.g. python benchmarks/profile/profile_step.py --model gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072 --compile
    torchrun --standalone --nproc-per-node 2 benchmarks/profile/profile_step.py ...   # rank 0's step
    python benchmarks/profile/profile_step.py --torch ddp-compile --model gpt2 -i DATA -b 16 -t 1024 -d 131072
        # the same step of bench train's torch yardstick (braidtrain.bench.torchref), for side-by-side profiles

Runs 4 steps to warm up (compilation, allocator), profiles the 5th, and prints the step's wall
time, the GPU's busy time, and the kernel time by category (matrix products, attention, the
loss, fused elementwise/normalisation kernels, optimizer, copies, communication); where the GPU
idles between kernels, and where its compute kernels alone do (collectives left out: the time
compute waits for a collective, or for the host); then each category's 8 most expensive kernels
with their launches per step, and the host's most expensive operations. Under torchrun, rank 0 prints all
this and every other rank one line: its step time and its compute kernels' idle time.
"""

import builtins
import dataclasses
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.options import Parser, train_config, train_parser  # noqa: E402
from braidtrain.train import Trainer, gc_by_hand  # noqa: E402

CATEGORIES = [  # first match wins
    ("attention", ("flash", "fmha", "attention", "_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_delta_kernel", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "matmul")),
    ("optimizer", ("adam",)),
    ("communication", ("nccl",)),
    ("loss", ("nll", "log_softmax", "cross_entropy", "softmax", "_ce_kernel")),
    ("fused (inductor)", ("triton_",)),
    ("copy/cast", ("copy", "convert", "cast", "fill", "memcpy", "memset")),
]


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")


def annotation(e) -> bool:
    """A named GPU range around kernels (e.g. "nccl:all_reduce"), not a kernel: counting it would
    count its kernels twice."""
    return getattr(e, "is_user_annotation", False) or e.key.startswith("nccl:")


def idle(kernels):
    """Gaps between consecutive kernels: [(microseconds, the kernel before, the kernel after)]."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    gaps, end, prev = [], spans[0][1] if spans else 0, spans[0][2] if spans else ""
    for a, e, name in spans[1:]:
        if a > end:
            gaps.append((a - end, prev, name))
        if e > end:
            end, prev = e, name
    return gaps


def report(prof, wall, tokens_per_s, is_main=True, rank=0):
    """Print where the profiled step's time went (rank 0 all of it, another rank one line)."""
    print = builtins.print if is_main else (lambda *a, **k: None)  # noqa: A001
    by_cat, by_name, calls = defaultdict(float), defaultdict(float), defaultdict(int)
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))  # us, kernels only below
        if e.device_type == torch.autograd.DeviceType.CUDA and t > 0 and not annotation(e):
            by_cat[category(e.key)] += t
            by_name[e.key] += t
            calls[e.key] += e.count
    busy = sum(by_cat.values()) / 1e6
    print(f"step {wall * 1e3:.1f} ms wall ({tokens_per_s:,.0f} tokens/s), GPU kernels {busy * 1e3:.1f} ms "
          f"({100 * busy / wall:.0f}% of the wall time; summed over streams, so communication that overlaps "
          f"compute can take it past 100%)")
    for c, t in sorted(by_cat.items(), key=lambda x: -x[1]):
        print(f"  {c:18s} {t / 1e3:8.1f} ms  {100 * t / 1e6 / wall:5.1f}%")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.time_range.end > e.time_range.start and not annotation(e)]
    waits = idle([e for e in kernels if category(e.name) != "communication"])
    for what, gaps in (("the GPU", idle(kernels)), ("compute (collectives left out: where it waits for them or the "
                                                    "host)", waits)):
        print(f"{what} idle between kernels: {sum(g for g, _, _ in gaps) / 1e3:.1f} ms in {len(gaps)} gaps; the "
              "largest:")
        for g, before, after in sorted(gaps, reverse=True)[:8]:
            print(f"  {g / 1e3:7.2f} ms  after {before[:50]}  before {after[:50]}")
    if not is_main:  # the other ranks: one line each, to see which of them waits
        builtins.print(f"rank {rank}: step {wall * 1e3:.1f} ms wall, compute idle between kernels "
                       f"{sum(g for g, _, _ in waits) / 1e3:.1f} ms in {len(waits)} gaps", flush=True)
    print("the largest kernels of each category:")
    for c, _ in sorted(by_cat.items(), key=lambda x: -x[1]):
        print(f"  {c}:")
        for n, t in sorted(((n, t) for n, t in by_name.items() if category(n) == c), key=lambda x: -x[1])[:8]:
            print(f"    {t / 1e3:8.1f} ms  {calls[n]:5d}x  {n[:110]}")
    print("top host operations by their own CPU time (where a host-bound step spends it):")
    cpu = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: -e.self_cpu_time_total)
    for e in cpu[:12]:
        print(f"  {e.self_cpu_time_total / 1e3:8.1f} ms  {e.count:6d} calls  {e.key[:90]}")


def profiled(step, sync):
    """Four steps to warm up, then the fifth under the profiler: (profile, its wall seconds, its result)."""
    with gc_by_hand():  # as in training: Python's collector does not strike inside the steps
        for s in range(4):
            step(s)
        sync()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t0 = time.time()
            out = step(4)
            sync()
            wall = time.time() - t0
    return prof, wall, out


def torch_peer(argv):
    """--torch MODE: the same step through braidtrain.bench.torchref (bench train's yardstick)."""
    from braidtrain.bench import torchref

    a = torchref.parse(argv + ["--steps", "10", "--json", os.devnull])
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    device, bf16, cfg, plan, mcfg, loader = torchref.setup(a)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prof, wall, _ = profiled(torchref.dense(a, mcfg, loader, plan, cfg, device, bf16), sync)
    report(prof, wall, plan.total_tokens / wall, dist.get_rank() == 0, dist.get_rank())


def main(argv):
    if argv[:1] == ["--torch"]:
        return torch_peer(["--mode", *argv[1:]])
    cfg = train_config(train_parser(Parser().add_subparsers(parser_class=Parser)).parse_args(argv))
    cfg = dataclasses.replace(cfg, max_steps=10, val_every=0, sample_tokens=0, progress=False)
    trainer = Trainer(cfg)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    prof, wall, rec = profiled(trainer.step, sync)
    report(prof, wall, rec["tokens_per_s"], trainer.rt.is_main, trainer.rt.rank)
    trainer.guard.close(clean=True)
    trainer.rt.close()


if __name__ == "__main__":
    main(sys.argv[1:])
