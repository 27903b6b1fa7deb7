"""Llama's MLP, down(silu(gate x) * up x), compiled as a block is (torch.compile), fwd+bwd on one
GPU: is inductor's SwiGLU backward at the memory floor, and would saving gate_up (a custom
autograd.Function whose backward is one pointwise pass) be faster? Issue #58's profile put
"SwiGLU backward" at 4.9 ms of the 1B step (16 layers) against ~0.16 ms x 16 of traffic.

    python benchmarks/kernels/swiglu_gpu.py     # from the repo root; under a minute

Rows: the pointwise part alone (gate_up -> h, given dh) and the whole MLP (gate_up and down
matmuls), each as braidtrain writes it today and with the candidate; median ms (do_bench), the
kernels' sum by name from one profiled run, peak MB above the inputs, max rel err vs fp32.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def today(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    """The candidate: keeps gate_up; backward in one pass, fp32 inside."""

    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return today(gate_up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors[0].float().chunk(2, dim=-1)
        s, d = torch.sigmoid(gate), dy.float()
        return torch.cat([d * up * s * (1 + gate * (1 - s)), d * gate * s], dim=-1).to(dy.dtype)


def candidate(gate_up):
    return _SwiGLU.apply(gate_up)


def mlp(act):
    def fn(x, w1, w2):
        return F.linear(act(F.linear(x, w1)), w2)
    return fn


def kernels_ms(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    top = sorted(ev, key=lambda e: -e.self_device_time_total)[:4]
    return sum(e.self_device_time_total for e in ev) / 1e3, "; ".join(
        f"{e.key[:40]} {e.self_device_time_total / 1e3:.3f}" for e in top)


def peak_mb(fn):
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name, (N, C, Fw) in {"llama3.2-1b b4 t2048": (8192, 2048, 8192),
                             "llama3.2-3b b2 t2048": (4096, 3072, 8192)}.items():
        torch.manual_seed(0)
        bf = torch.bfloat16
        x = torch.randn(N, C, device="cuda", dtype=bf)
        w1 = torch.randn(2 * Fw, C, device="cuda", dtype=bf) / C**0.5
        w2 = torch.randn(C, Fw, device="cuda", dtype=bf) / Fw**0.5
        gu = torch.randn(N, 2 * Fw, device="cuda", dtype=bf)
        dh, dy = torch.randn(N, Fw, device="cuda", dtype=bf), torch.randn(N, C, device="cuda", dtype=bf)
        floor = (3 * N * 2 * Fw * 2 + N * Fw * 2) / 4.3e9  # ms: read gate_up, dh; write dgate_up; write h (fwd)
        print(f"\n== {name}: N={N} C={C} F={Fw}; pointwise fwd+bwd traffic at 4.3 TB/s: {floor:.3f} ms")
        gref = gu.float().requires_grad_()
        ref_pw = torch.autograd.grad(today(gref), gref, dh.float())[0]
        for label, act in (("today", today), ("candidate", candidate)):
            pw = torch.compile(act)
            g = gu.detach().requires_grad_()
            err = ((torch.autograd.grad(pw(g), g, dh)[0].float() - ref_pw).norm() / ref_pw.norm()).item()

            def step_pw(pw=pw, g=g):
                torch.autograd.grad(pw(g), g, dh)
            whole = torch.compile(mlp(act))
            xs, w1s, w2s = (t.detach().requires_grad_() for t in (x, w1, w2))

            def step_mlp(whole=whole):
                torch.autograd.grad(whole(xs, w1s, w2s), (xs, w1s, w2s), dy)
            step_pw(), step_mlp()
            t_pw, t_mlp = do_bench(step_pw, return_mode="median"), do_bench(step_mlp, return_mode="median")
            k_pw, top_pw = kernels_ms(step_pw)
            k_mlp, top_mlp = kernels_ms(step_mlp)
            print(f"  {label:9s} pointwise f+b {t_pw:.3f} ms (kernels {k_pw:.3f}: {top_pw})  rel err {err:.1e}"
                  f"  peak {peak_mb(step_pw):.0f} MB")
            print(f"  {label:9s} whole MLP f+b {t_mlp:.3f} ms (kernels {k_mlp:.3f}: {top_mlp})  peak {peak_mb(step_mlp):.0f} MB")


if __name__ == "__main__":
    main()
