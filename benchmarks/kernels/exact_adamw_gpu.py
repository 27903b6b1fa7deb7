"""Exact mode's one-pass AdamW kernel (braidtrain/parallel/exact_kernels.py) on one GPU: bit for bit against
its reference optim.exact_adamw, and what each costs.

    python benchmarks/kernels/exact_adamw_gpu.py [--n 100000000] [--time-n 1240000000]

1. Bitwise, on --n random elements (odd length) a case: the kernel against exact_adamw's torch
   kernels on the GPU, and against exact_adamw on the host (the first 4M elements: what
   --offload optimizer computes there), with the edge cases -- v = 0 and subnormal, g over 50
   binades (g * g overflowing to inf), grad_scale != 1, skip = 0 and skip = 1 with NaN and inf in
   the gradient. Then the kernel compiled WITH multiply-add contraction (enable_fp_fusion=True),
   which must differ: the check can fail.
2. Time (CUDA events, the median of 5) over --time-n elements, Llama-3.2-1B's 1.24 B parameters
   in one shard: torch's fused AdamW (default mode), exact_adamw's torch kernels (exact mode before
   exact_kernels), the kernel; each against the bytes it must move (p, g, m, v read, p, m, v written:
   28 a parameter).
Prints one line per finding; --json PATH writes them.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain import optim  # noqa: E402
from braidtrain.parallel import exact_kernels  # noqa: E402
from kernel_probe_gpu import timed  # noqa: E402  (this folder is sys.path[0]: a sibling script)

B1, B2, EPS = 0.9, 0.95, 1e-8


def shards(n, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda: torch.rand(n, device="cuda", generator=gen)  # noqa: E731
    p = torch.randn(n, device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen) * 10 ** (r() * 50 - 25)
    m = torch.randn(n, device="cuda", generator=gen) * 1e-3
    v = r() * 10 ** (-r() * 46)  # down to 1e-46: subnormal and 0
    v[::7], g[::11] = 0.0, 0.0
    g[3::101] = 1e30  # g * g = inf
    return [p, g, m, v]


def differ(a, b):
    return sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(a, b))


def scalars(device):
    return torch.tensor(3e-4 / (1 - B1**7), device=device), torch.tensor(1 / (1 - B2**7) ** 0.5, device=device)


def bitwise(n, out):
    c1, c2 = scalars("cuda")
    cases = {"plain": (None, None), "scaled": (2.7, None), "scaled, skip 0": (0.31, 0.0), "skip 1, NaN/inf g": (1.7, 1.0)}
    for k, (name, (scale, skip)) in enumerate(cases.items()):
        ref = shards(n, k)
        if skip:
            ref[1][::5], ref[1][1::5] = float("nan"), float("inf")
        new, host = [t.clone() for t in ref], [t[: 1 << 22].to("cpu", copy=True) for t in ref]
        s = None if scale is None else torch.tensor(scale, device="cuda")
        f = None if skip is None else torch.tensor(skip, device="cuda")
        optim.exact_adamw(*ref, B1, B2, EPS, c1, c2, s, f)
        exact_kernels.exact_adamw(*new, B1, B2, EPS, c1, c2, s, f)
        hc1, hc2 = c1.cpu(), c2.cpu()
        optim.exact_adamw(*host, B1, B2, EPS, hc1, hc2, None if s is None else s.cpu(), None if f is None else f.cpu())
        keep = (new[0], new[2], new[3])
        out[f"{name}: kernel vs torch on the GPU, elements differing of {3 * n:,}"] = differ(keep, (ref[0], ref[2], ref[3]))
        out[f"{name}: kernel vs exact_adamw on the host, of {3 * min(n, 1 << 22):,}"] = differ(
            [t[: 1 << 22].cpu() for t in keep], (host[0], host[2], host[3]))
        if k == 1:  # the broken kernel: multiply-adds contracted
            fused = [t.clone() for t in shards(n, k)]
            exact_kernels._kernel[(-(-n // exact_kernels.BLOCK),)](
                *fused, c1, c2, s, c1, c1, c1, c1, c1, n, *(exact_kernels._f32(x) for x in (B1, 1 - B1, B2, 1 - B2, EPS)),
                HAS_SCALE=True, HAS_SKIP=False, DECAY=False, HAS_OUT=False, BLOCK=exact_kernels.BLOCK, num_warps=4,
                enable_fp_fusion=True)
            out[f"{name}: the kernel WITH fp fusion vs torch (must differ), of {3 * n:,}"] = differ(
                (fused[0], fused[2], fused[3]), (ref[0], ref[2], ref[3]))
        del ref, new, host
        torch.cuda.empty_cache()


def timing(n, out):
    p, g, m, v = (torch.rand(n, device="cuda") for _ in range(4))
    step = torch.tensor(7.0, device="cuda")
    c1, c2 = scalars("cuda")
    scale = torch.tensor(1.3, device="cuda")
    runs = {
        "torch._fused_adamw_ (default mode)": lambda: torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], lr=3e-4, beta1=B1, beta2=B2, weight_decay=0.0, eps=EPS, amsgrad=False,
            maximize=False, grad_scale=scale, found_inf=None),
        "optim.exact_adamw (torch kernels)": lambda: optim.exact_adamw(p, g, m, v, B1, B2, EPS, c1, c2, scale),
        "exact_kernels.exact_adamw (one kernel)": lambda: exact_kernels.exact_adamw(p, g, m, v, B1, B2, EPS, c1, c2, scale),
    }
    for name, fn in runs.items():
        ms = timed(fn, rounds=5, warm=1)
        out[f"{name} over {n:,} elements, ms"] = round(ms, 2)
        out[f"{name}: GB/s of the 28 bytes an element it must move"] = round(28 * n / ms / 1e6, 1)


def main(doc=__doc__, bitwise=bitwise, timing=timing, n=100_000_007, align=1):
    """The command line of this script and of exact_norm_gpu.py (its checks; lengths a multiple of align)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--n", type=int, default=n)
    ap.add_argument("--time-n", type=int, default=1_240_000_000, help="0: no timing")
    ap.add_argument("--json")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    out = {}
    bitwise(a.n // align * align, out)
    if a.time_n:
        timing(a.time_n // align * align, out)
    for k, v in out.items():
        print(f"{k}: {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
