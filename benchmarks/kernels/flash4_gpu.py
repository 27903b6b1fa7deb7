"""Causal attention fwd+bwd on one GPU: torch's SDPA (cuDNN's kernels on Hopper, what braidtrain ran
before) against flash-attn-4's through braidtrain's operators (braidtrain/model/flash4.py), at the
shapes of #58's models, as a compiled block calls them. Issue #58's profile put cuDNN at ~290 TFLOP/s
(13.3 ms of Llama-3.2-1B's 139 ms step).

    python benchmarks/kernels/flash4_gpu.py          # from the repo root, flash-attn-4 importable
                                                      # (benchmarks/speed/flash4_gpu.sh installs it)
    python benchmarks/kernels/flash4_gpu.py --exact  # also: could exact mode use its deterministic backward?

A row a shape and kernel: median ms of forward alone and of forward+backward (do_bench), TFLOP/s of
the pair (causal: 3.5 x 2 B H T^2 D, forward 1, backward 2.5), and the errors of o, dq, dk and dv
against fp32 SDPA from the same bf16 inputs (||x - ref|| / ||ref||). Exit status 1 if flash4's error
passes 2e-2 on any of them, or 1.5x SDPA's own.

--exact asks what exact mode would need of flash-attn-4's `deterministic` backward (it uses
model/attention.py's Triton kernels today, +8.9 ms a 1B step over cuDNN): the same bits twice, and a
sequence's bits (o, dq, dk, dv) the same alone (B 1) as inside a batch of 4 -- then its time against
attention.py's kernels (GQA by repeat_kv, as exact mode runs them). Both modes' repeat checks are
printed; the non-deterministic one may differ (atomics).
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.model import flash4  # noqa: E402

SHAPES = {  # name: (B, H, H_kv, T, D)
    "llama3.2-1b b4 t2048": (4, 32, 8, 2048, 64),
    "llama3.2-3b b2 t2048": (2, 24, 8, 2048, 128),
    "mixtral-small b8 t1024": (8, 12, 4, 1024, 64),
}


def heads(B, h, T, D, g):
    """(B, h, T, D), a view of (B, T, h, D) memory: the layout a Llama block gives attend."""
    return torch.randn(B, T, h, D, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def errors(fn, q, k, v, do):
    out = fn(q, k, v)
    got = [out, *torch.autograd.grad(out, (q, k, v), do)]
    ref32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = sdpa(*ref32)
    want = [ref, *torch.autograd.grad(ref, ref32, do.float())]
    return [((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, want)]


def _run(fn, q, k, v, do):
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]


def exact_check() -> None:
    from braidtrain.model.attention import causal_attention
    from braidtrain.model.layers import repeat_kv

    def exact(q, k, v):
        return causal_attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]))

    print("\n--exact: flash-attn-4's backward, deterministic or not, for exact mode")
    for name, (B, H, Hk, T, D) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (heads(B, h, T, D, g) for h in (H, Hk, Hk))
        do = torch.randn_like(q)
        for det in (True, False):
            def fn(q, k, v, det=det):
                return flash4.attention(q, k, v, det)
            a, b = _run(fn, q, k, v, do), _run(fn, q, k, v, do)
            repeat = all(torch.equal(x, y) for x, y in zip(a, b))
            alone = []  # each sequence computed alone against its slice of the batch
            for i in range(B):
                qi, ki, vi = (t[i:i + 1].detach().clone().requires_grad_() for t in (q, k, v))
                one = _run(fn, qi, ki, vi, do[i:i + 1])
                alone.append(all(torch.equal(x, y[i:i + 1]) for x, y in zip(one, a)))
            ms = do_bench(lambda fn=fn: torch.autograd.grad(fn(q, k, v), (q, k, v), do), return_mode="median")
            print(f"{name:24} deterministic={det!s:5} same bits twice: {repeat}; a sequence alone as in the "
                  f"batch: {sum(alone)} of {B}; fwd+bwd {ms:.3f} ms", flush=True)
        ms = do_bench(lambda: torch.autograd.grad(exact(q, k, v), (q, k, v), do), return_mode="median")
        print(f"{name:24} exact mode's Triton kernels: fwd+bwd {ms:.3f} ms", flush=True)


def main() -> int:
    if not flash4.available("cuda"):
        print("flash4: not available here (needs flash-attn-4 and a GPU of compute capability 9 or 10)")
        return 2
    bad = []
    print(f"{'shape':24} {'kernel':7} {'fwd ms':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}  err o, dq, dk, dv")
    for name, (B, H, Hk, T, D) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (heads(B, h, T, D, g) for h in (H, Hk, Hk))
        do = torch.randn_like(q)
        flops = 3.5 * 2 * B * H * T * T * D
        errs = {}
        for kernel, fn in (("sdpa", sdpa), ("flash4", flash4.attention)):
            step = torch.compile(fn, fullgraph=True)  # as a compiled block calls it

            def fwd_bwd():
                torch.autograd.grad(step(q, k, v), (q, k, v), do)

            with torch.no_grad():
                fwd = do_bench(lambda: step(q, k, v), return_mode="median")
            both = do_bench(fwd_bwd, return_mode="median")
            errs[kernel] = errors(step, q, k, v, do)
            print(f"{name:24} {kernel:7} {fwd:8.3f} {both:11.3f} {flops / both / 1e9:8.0f}  "
                  + ", ".join(f"{e:.1e}" for e in errs[kernel]), flush=True)
        if any(e > 2e-2 or e > 1.5 * s for e, s in zip(errs["flash4"], errs["sdpa"])):
            bad.append(name)
    if "--exact" in sys.argv[1:]:
        exact_check()
    if bad:
        print("flash4's error passes the bound at: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
