"""Context parallelism's local kernels on one GPU (issue #20): ring attention at cp = 1 against
torch's flash SDPA -- accuracy and speed -- and the longest sequence gpt2 trains at b = 1.

    python benchmarks/kernels/context_gpu.py                # from the repo root; a few minutes
    python benchmarks/kernels/context_gpu.py --kernels      # only the kernel part
    python benchmarks/kernels/context_gpu.py --lengths 32768 65536 --data data/shakespeare_gpt2

Kernels (B=1, H=12, D=64, bf16, causal; T from --kernel-lengths): ring attention at cp = 1 is the
same code path as at any cp -- the two chunks, three block pairs (two diagonal, one full), merged
by log-sum-exp -- with no transfer. For each of torch's flash SDPA, the ring on flash's kernels
(default mode on CUDA) and the ring's fp32 plain pairs (exact mode): the relative error of o, dq,
dk, dv against the math SDPA in fp32, and the median forward and forward+backward time
(triton.testing.do_bench).

Lengths: `braidtrain train --config gpt2 -b 1 -t T --block-size T` for 2 steps, each T with and
without --recompute; the peak memory (mem_gb) of the last step, or the error line it ended with.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.parallel.context import Context  # noqa: E402


def sdpa(backend):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return fn


def ring(exact: bool):
    cx = Context(SimpleNamespace(size=1, index=0, comm=None), exact=exact)
    return cx.attend


def grads(fn, q, k, v, do):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kernels(lengths):
    from triton.testing import do_bench
    print("| T | kernel | err o | err dq | err dk | err dv | fwd ms | fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|---|")
    for T in lengths:
        g = torch.Generator(device="cuda").manual_seed(T)
        q, k, v, do = (torch.randn(1, 12, T, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
        ref = grads(sdpa(SDPBackend.MATH), q.float(), k.float(), v.float(), do.float()) if T <= 16384 else None
        for name, fn in (("torch flash SDPA", sdpa(SDPBackend.FLASH_ATTENTION)), ("ring, flash pairs", ring(False)),
                         ("ring, fp32 pairs (exact)", ring(True))):
            out = grads(fn, q, k, v, do)
            errs = [f"{rel(a, b):.1e}" for a, b in zip(out, ref)] if ref is not None else ["-"] * 4

            def step():
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                torch.autograd.grad(fn(qq, kk, vv), (qq, kk, vv), do)
            with torch.no_grad():
                f_ms = do_bench(lambda: fn(q, k, v), warmup=5, rep=50)
            fb_ms = do_bench(step, warmup=5, rep=50)
            print(f"| {T} | {name} | {' | '.join(errs)} | {f_ms:.3f} | {fb_ms:.3f} |", flush=True)


def lengths(ts, data, val, modes):
    print("| T | recompute | mem_gb | tokens/s | result |")
    print("|---|---|---|---|---|")
    for T in ts:
        for rc in modes:
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, "-m", "braidtrain", "train", "--config", "gpt2", "-i", data, "-b", "1",
                       "-j", val, "-t", str(T), "--block-size", str(T), "-d", str(T), "-x", "2", "--val-every", "0", "-m", "1",
                       "--sample-tokens", "0", "--no-progress", "--ckpt-every", "0", "--out", out, *rc]
                p = subprocess.run(cmd, capture_output=True, text=True)
                m = Path(out, "metrics.jsonl")
                rows = [json.loads(x) for x in m.read_text().splitlines()] if m.exists() else []
                rows = [r for r in rows if "mem_gb" in r]
                tail = (p.stderr.strip().splitlines() or ["?"])[-1][:120]
                res = "trains" if p.returncode == 0 else f"exit {p.returncode}: {tail}"
                mem = f"{rows[-1]['mem_gb']:.1f}" if rows else "-"
                tps = f"{rows[-1]['tokens_per_s']:,.0f}" if rows else "-"
                print(f"| {T} | {'yes' if rc else 'no'} | {mem} | {tps} | {res} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", action="store_true", help="only the kernels")
    ap.add_argument("--kernel-lengths", type=int, nargs="*", default=[4096, 16384, 65536])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    ap.add_argument("--data", default="data/shakespeare_gpt2")
    ap.add_argument("--val", default="data/shakespeare_gpt2/shakespeare_train_000000.bin",
                    help="validation tokens (the corpus's own val split is shorter than the longest T)")
    ap.add_argument("--recompute-only", action="store_true")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if a.kernel_lengths:
        kernels(a.kernel_lengths)
    if not a.kernels:
        lengths(a.lengths, a.data, a.val, [["--recompute"]] if a.recompute_only else [[], ["--recompute"]])
