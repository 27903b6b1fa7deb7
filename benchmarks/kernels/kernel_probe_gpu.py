"""The fusion candidates of issue #25, each timed alone at gpt2's shapes on one GPU (CUDA events,
median of 20 after 5 warm-up rounds), before any of them is built into the model:

  1. attention: torch's SDPA backends (cuDNN, flash, memory-efficient) forward + backward,
     B 16, 12 heads, T 1024, head dim 64, bf16, causal;
  2. the weight gradient: bf16 matmul, cast to fp32 and added into the fp32 gradient (what autograd
     does under autocast), against one cuBLAS call accumulating into the fp32 buffer
     (aten.addmm.dtype_out, beta 1);
  3. bias + GELU: addmm then a compiled tanh-GELU, against cuBLASLt's GELU epilogue
     (torch._addmm_activation).

    python benchmarks/kernels/kernel_probe_gpu.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, T, D, C = 16, 12, 1024, 64, 768
N = B * T
dev, bf = "cuda", torch.bfloat16


def timed(fn, rounds=20, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def attention():
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, T, D, device=dev, dtype=bf)
    ref = None
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(be=be):
            with sdpa_kernel([be]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(g)
            return out

        def fwd(be=be):
            with sdpa_kernel([be]), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            out = run()
        except RuntimeError as e:
            print(f"attention {name}: unavailable ({str(e)[:80]})")
            continue
        ref = out.float() if ref is None else ref
        q.grad = k.grad = v.grad = None
        tf, tb = timed(fwd), timed(run)
        print(f"attention {name:9s} fwd {tf:.3f} ms  fwd+bwd {tb:.3f} ms  x12 layers x8 micro: {tb * 96:.1f} ms a step"
              f"  (max |diff| to cudnn {(out.float() - ref).abs().max().item():.2e})")


def weight_grad():
    total_a = total_b = 0.0
    for o, i in ((3 * C, C), (C, C), (4 * C, C), (C, 4 * C)):
        dy, x = torch.randn(N, o, device=dev, dtype=bf), torch.randn(N, i, device=dev, dtype=bf)
        grad = torch.zeros(o, i, device=dev)
        grad2 = grad.clone()

        def autograd_way():
            grad.add_((dy.t() @ x).float())

        def fused():
            torch.ops.aten.addmm.dtype_out(grad2, dy.t(), x, torch.float32, out=grad2)
        ta, tb = timed(autograd_way), timed(fused)
        grad.zero_(), grad2.zero_()
        autograd_way(), fused()  # once each from zero: they differ by the bf16 rounding of the first
        diff = (grad - grad2).abs().max().item()
        print(f"weight grad ({o}, {i}): mm + cast + add {ta:.3f} ms, addmm into fp32 {tb:.3f} ms (max |diff| "
              f"{diff:.2e})")
        total_a, total_b = total_a + ta, total_b + tb
    print(f"weight grad, a block's four: {total_a:.3f} against {total_b:.3f} ms; x96 a step: "
          f"{total_a * 96:.1f} against {total_b * 96:.1f} ms")


def bias_gelu():
    x = torch.randn(N, C, device=dev, dtype=bf)
    w, b = torch.randn(4 * C, C, device=dev, dtype=bf) * 0.02, torch.randn(4 * C, device=dev, dtype=bf)
    gelu = torch.compile(lambda h: F.gelu(h, approximate="tanh"))
    ta = timed(lambda: gelu(torch.addmm(b, x, w.t())))
    tb = timed(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
    diff = (gelu(torch.addmm(b, x, w.t())).float() - torch._addmm_activation(b, x, w.t(), use_gelu=True).float()).abs().max()
    print(f"bias + GELU forward: addmm + compiled GELU {ta:.3f} ms, cuBLASLt epilogue {tb:.3f} ms "
          f"(max |diff| {diff.item():.2e}); x96 a step: {ta * 96:.1f} against {tb * 96:.1f} ms")


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    attention()
    weight_grad()
    bias_gelu()
