"""Exact mode's gradient-norm chunk sums in one pass (exact_kernels.chunk_squares) on one GPU: bit for
bit against their torch reference (parallel/norm.py's chunk_squares, what ExactNorm ran before),
and what each costs.

    python benchmarks/kernels/exact_norm_gpu.py [--n 100000000] [--time-n 1240000000] [--json PATH]

1. Bitwise, on --n random fp32 elements a case (a multiple of Q): unit normals (every chunk's sum
   rounds: another tree would give other bits), values over 80 binades with fp32's largest, values
   below 1e-37 alone (fp32 subnormals, which the largest squares would swamp: a flush shows here),
   and inf / NaN / +-0 among unit normals. NaN counts as equal to NaN.
2. Time (CUDA events, the median of 5) over --time-n elements, Llama-3.2-1B's 1.24 B parameters in
   one shard: the default norm's read (torch.linalg.vector_norm, fp32), the reference's torch
   kernels (the fp64 copy, the squares, the tree's levels), the kernel at three chunks a program
   (CHUNKS; the module's default is what training runs); GB/s of the 4 bytes an element it reads.
Prints one line per finding; --json PATH writes them.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.parallel import exact_kernels  # noqa: E402
from braidtrain.parallel import norm  # noqa: E402
from braidtrain.parallel.buckets import Q  # noqa: E402
from exact_adamw_gpu import main  # noqa: E402  (the same command line)
from kernel_probe_gpu import timed  # noqa: E402  (this folder is sys.path[0]: a sibling script)


def cases(n):
    gen = torch.Generator(device="cuda").manual_seed(0)
    unit = torch.randn(n, device="cuda", generator=gen)
    wide = unit * 10 ** (torch.rand(n, device="cuda", generator=gen) * 80 - 42)
    wide[::13], wide[1::17], wide[2::19] = 3.4e38, -1e-45, -0.0
    odd = unit.clone()
    odd[5::97], odd[7::131], odd[::3] = float("inf"), float("nan"), 0.0
    tiny = unit * 10 ** (torch.rand(n, device="cuda", generator=gen) * 8 - 45)  # fp32 subnormals, not swamped
    return {"unit normals": unit, "80 binades": wide, "below 1e-37 (subnormals)": tiny, "inf, NaN, 0": odd}


def bitwise(n, out):
    for name, g in cases(n).items():
        a, b = exact_kernels.chunk_squares(g, Q), norm.chunk_squares(g)
        same = (a.view(torch.int64) == b.view(torch.int64)) | (a.isnan() & b.isnan())
        out[f"{name}: kernel vs torch, chunk sums differing of {n // Q:,}"] = int((~same).sum())
        if name == "unit normals":  # the check can fail: a sum in another order differs
            other = g.double().pow(2).view(-1, Q).sum(1)
            out[f"{name}: torch's .sum(1) vs the tree (must differ), of {n // Q:,}"] = int((other != b).sum())
        del a, b
    torch.cuda.empty_cache()


def timing(n, out):
    g = torch.randn(n, device="cuda")
    runs = {"torch.linalg.vector_norm (default mode)": lambda: torch.linalg.vector_norm(g, dtype=torch.float32),
            "norm.chunk_squares (torch kernels, before)": lambda: norm.chunk_squares(g)}
    for c in (16, 32, 64):
        runs[f"exact_kernels.chunk_squares, {c} chunks a program" + (" (used)" if c == exact_kernels.CHUNKS else "")] = (
            lambda c=c: run_with(c, g))
    for name, fn in runs.items():
        ms = timed(fn, rounds=5, warm=1)
        out[f"{name} over {n:,} elements, ms"] = round(ms, 2)
        out[f"{name}: GB/s of the 4 bytes an element it reads"] = round(4 * n / ms / 1e6, 1)


def run_with(chunks, g):
    keep, exact_kernels.CHUNKS = exact_kernels.CHUNKS, chunks
    try:
        return exact_kernels.chunk_squares(g, Q)
    finally:
        exact_kernels.CHUNKS = keep


if __name__ == "__main__":
    main(__doc__, bitwise, timing, 100_000_000, Q)
