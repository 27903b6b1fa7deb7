"""Llama's MLP, down(silu(gate x) * up x), compiled as a block is (torch.compile), fwd+bwd on one
GPU: is inductor's SwiGLU backward at the memory floor, and would saving gate_up (a custom
autograd.Function whose backward is one pointwise pass) be faster? Issue #58's profile put
"SwiGLU backward" at 4.9 ms of the 1B step (16 layers) against ~0.16 ms x 16 of traffic.

    python benchmarks/kernels/swiglu_gpu.py     # from the repo root; under a minute
    TRITON_INTERPRET=1 python benchmarks/kernels/swiglu_gpu.py --check   # on the CPU: the kernels' maths

Rows: the pointwise part alone (gate_up -> h, given dh) and the whole MLP (gate_up and down
matmuls), each as braidtrain writes it today and with two candidates (an autograd.Function that
inductor compiles; a hand-written Triton kernel each way, an opaque custom op); median ms (do_bench), the
kernels' sum by name from one profiled run, peak MB above the inputs, max rel err vs fp32.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from loss_gpu import peak_mb  # noqa: E402  (this folder is sys.path[0]: a sibling script)


CUDA = torch.device("cuda")


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


# The hand-written candidate: one program per BLOCK columns of one row of the (N, F) halves; each
# loads gate, up (and dh) once and writes h (forward) or both halves of dgate_up (backward), in
# fp32 inside. An opaque custom op, so that torch.compile keeps it whole (and a CUDA graph
# captures it). Offsets in int64: N x 2F passes 2^31 at 1B b16.
@triton.jit
def _swiglu_fwd_kernel(GU, H, F, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nb = tl.cdiv(F, BLOCK)
    row, col = pid // nb, (pid % nb) * BLOCK + tl.arange(0, BLOCK)
    mask = col < F
    g = tl.load(GU + row * 2 * F + col, mask=mask).to(tl.float32)
    u = tl.load(GU + row * 2 * F + F + col, mask=mask).to(tl.float32)
    tl.store(H + row * F + col, (g * tl.sigmoid(g) * u).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(GU, DH, DGU, F, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nb = tl.cdiv(F, BLOCK)
    row, col = pid // nb, (pid % nb) * BLOCK + tl.arange(0, BLOCK)
    mask = col < F
    g = tl.load(GU + row * 2 * F + col, mask=mask).to(tl.float32)
    u = tl.load(GU + row * 2 * F + F + col, mask=mask).to(tl.float32)
    d = tl.load(DH + row * F + col, mask=mask).to(tl.float32)
    sg = tl.sigmoid(g)
    tl.store(DGU + row * 2 * F + col, (d * u * sg * (1 + g * (1 - sg))).to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * 2 * F + F + col, (d * g * sg).to(DGU.dtype.element_ty), mask=mask)


_BLOCK = 1024


@torch.library.custom_op("swiglu_bench::fwd", mutates_args=())
def _fwd(gate_up: torch.Tensor) -> torch.Tensor:
    gu = gate_up.contiguous()
    F2 = gu.shape[-1] // 2
    h = gu.new_empty(*gu.shape[:-1], F2)
    _swiglu_fwd_kernel[(h.numel() // F2 * triton.cdiv(F2, _BLOCK),)](gu, h, F2, BLOCK=_BLOCK, num_warps=4)
    return h


@_fwd.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("swiglu_bench::bwd", mutates_args=())
def _bwd(gate_up: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    gu, dh = gate_up.contiguous(), dh.contiguous()
    F2 = gu.shape[-1] // 2
    dgu = torch.empty_like(gu)
    _swiglu_bwd_kernel[(dh.numel() // F2 * triton.cdiv(F2, _BLOCK),)](gu, dh, dgu, F2, BLOCK=_BLOCK, num_warps=4)
    return dgu


@_bwd.register_fake
def _(gate_up, dh):
    return torch.empty_like(gate_up)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


_fwd.register_autograd(lambda ctx, dh: _bwd(ctx.saved_tensors[0], dh), setup_context=_setup)


def hand(gate_up):
    return _fwd(gate_up)


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


def main():
    from triton.testing import do_bench
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
        for label, act in (("today", today), ("candidate", candidate), ("triton", hand)):
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
                  f"  peak {peak_mb(step_pw, CUDA):.0f} MB")
            print(f"  {label:9s} whole MLP f+b {t_mlp:.3f} ms (kernels {k_mlp:.3f}: {top_mlp})  peak {peak_mb(step_mlp, CUDA):.0f} MB")


def check():
    """The Triton candidate against autograd's SwiGLU in float64 (fp32 tensors, ragged F)."""
    torch.manual_seed(0)
    for N, Fw in ((3, 5), (4, 1500)):
        gu, dh = torch.randn(N, 2 * Fw), torch.randn(N, Fw)
        ref_gu = gu.double().requires_grad_()
        ref_h = today(ref_gu)
        ref_d = torch.autograd.grad(ref_h, ref_gu, dh.double())[0]
        g = gu.clone().requires_grad_()
        h = hand(g)
        d = torch.autograd.grad(h, g, dh)[0]
        errs = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in ((h, ref_h), (d, ref_d))]
        print(f"N={N} F={Fw}: max rel err h {errs[0]:.1e}, dgate_up {errs[1]:.1e}")
        assert max(errs) < 1e-5, errs


if __name__ == "__main__":
    check() if "--check" in sys.argv[1:] else main()
