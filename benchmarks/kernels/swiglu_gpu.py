"""Llama's MLP, down(silu(gate x) * up x), fwd+bwd on one GPU: inductor's SwiGLU (the plain expression
compiled, as a block is under --compile) against braidtrain's operator (braidtrain/model/swiglu.py,
`braidtrain::swiglu`: one Triton kernel each way, opaque to torch.compile), which a model built for
CUDA runs (not under --exact or --fp8). Issue #58's profile put inductor's SwiGLU backward at 0.331 ms
a layer of Llama-1B b4 (2.0 TB/s over the 671 MB it moves) where ~0.16 ms is the memory floor.

    python benchmarks/kernels/swiglu_gpu.py           # from the repo root; about a minute
    python benchmarks/kernels/swiglu_gpu.py --sweep   # also: the operator's pointwise part at other (BLOCK, warps)
    TRITON_INTERPRET=1 python benchmarks/kernels/swiglu_gpu.py --check   # on the CPU: the kernels' maths

Rows, for "inductor" (torch.compile of silu(gate) * up) and "op" (the operator, also inside
torch.compile): the pointwise part alone (gate_up -> h; fwd alone, no grad, and fwd+bwd given dh) and
the whole MLP (gate_up and down matmuls) fwd+bwd; median ms (do_bench), the kernels' sum by name
from one profiled run, peak MB above the inputs, and the error of h and d(gate_up) against fp32
autograd of the same inputs: ||x - ref|| / ||ref|| and the largest element's |x - ref| / max |ref|.
Exit status 1 if the operator's largest error passes bf16's rounding (2^-8 of max |ref|) or its
relative error inductor's by 1.5x. (Under --check's interpreter bf16 stores round toward zero, an ulp.)
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.model import swiglu  # noqa: E402
from loss_gpu import peak_mb  # noqa: E402  (this folder is sys.path[0]: a sibling script)

CUDA = torch.device("cuda")


def plain(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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


def errors(got, ref):
    """(||got - ref|| / ||ref||, max |got - ref| / max |ref|)"""
    d = got.double() - ref
    return (d.norm() / ref.norm()).item(), (d.abs().max() / ref.abs().max()).item()


def main(sweep: bool):
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    failed = False
    for name, (N, C, Fw) in {"llama3.2-1b b4 t2048": (8192, 2048, 8192),
                             "llama3.2-3b b2 t2048": (4096, 3072, 8192)}.items():
        torch.manual_seed(0)
        bf = torch.bfloat16
        x = torch.randn(N, C, device="cuda", dtype=bf)
        w1 = torch.randn(2 * Fw, C, device="cuda", dtype=bf) / C**0.5
        w2 = torch.randn(C, Fw, device="cuda", dtype=bf) / Fw**0.5
        gu = torch.randn(N, 2 * Fw, device="cuda", dtype=bf)
        dh, dy = torch.randn(N, Fw, device="cuda", dtype=bf), torch.randn(N, C, device="cuda", dtype=bf)
        bwd_bytes = 3 * N * 2 * Fw * 2  # read gate_up, write d(gate_up) (2F each), read dh (F): bf16
        print(f"\n== {name}: N={N} C={C} F={Fw}; the backward moves {bwd_bytes / 1e6:.0f} MB "
              f"({bwd_bytes / 4.3e9:.3f} ms at 4.3 TB/s), the forward {N * 3 * Fw * 2 / 1e6:.0f} MB")
        gref = gu.float().requires_grad_()
        h_ref = plain(gref)
        d_ref = torch.autograd.grad(h_ref, gref, dh.float())[0]
        err = {}
        for label, act in (("inductor", plain), ("op", swiglu.swiglu)):
            pw = torch.compile(act)
            g = gu.detach().requires_grad_()
            h = pw(g)
            d = torch.autograd.grad(h, g, dh)[0]
            err[label] = (*errors(h, h_ref.detach()), *errors(d, d_ref))

            def fwd(pw=pw):
                with torch.no_grad():
                    pw(gu)

            def step_pw(pw=pw, g=g):
                torch.autograd.grad(pw(g), g, dh)

            whole = torch.compile(mlp(act))
            xs, w1s, w2s = (t.detach().requires_grad_() for t in (x, w1, w2))

            def step_mlp(whole=whole):
                torch.autograd.grad(whole(xs, w1s, w2s), (xs, w1s, w2s), dy)

            fwd(), step_pw(), step_mlp()
            t_f, t_pw, t_mlp = (do_bench(f, return_mode="median") for f in (fwd, step_pw, step_mlp))
            k_pw, top_pw = kernels_ms(step_pw)
            k_mlp, top_mlp = kernels_ms(step_mlp)
            e = err[label]
            print(f"  {label:8s} pointwise fwd {t_f:.3f} ms, f+b {t_pw:.3f} ms (bwd ~{t_pw - t_f:.3f}: "
                  f"{bwd_bytes / max(t_pw - t_f, 1e-3) / 1e9:.2f} TB/s) (kernels {k_pw:.3f}: {top_pw})  peak "
                  f"{peak_mb(step_pw, CUDA):.0f} MB")
            print(f"  {label:8s} whole MLP f+b {t_mlp:.3f} ms (kernels {k_mlp:.3f}: {top_mlp})  peak "
                  f"{peak_mb(step_mlp, CUDA):.0f} MB")
            print(f"  {label:8s} error vs fp32: h {e[0]:.1e} (max {e[1]:.1e}), d(gate_up) {e[2]:.1e} (max {e[3]:.1e})")
        worst = max(err["op"][1], err["op"][3])
        if worst > 2.0**-8 or any(err["op"][i] > 1.5 * err["inductor"][i] for i in (0, 2)):
            print(f"  FAIL: the operator's error {err['op']} against inductor's {err['inductor']}")
            failed = True
        if sweep:
            block, warps = swiglu.BLOCK, swiglu.WARPS
            for swiglu.BLOCK, swiglu.WARPS in ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)):
                g = gu.detach().requires_grad_()

                def fb(g=g):
                    torch.autograd.grad(swiglu.swiglu(g), g, dh)

                def f():
                    with torch.no_grad():
                        swiglu.swiglu(gu)

                t_f, t_fb = do_bench(f, return_mode="median"), do_bench(fb, return_mode="median")
                print(f"  op BLOCK {swiglu.BLOCK:4d} warps {swiglu.WARPS}: fwd {t_f:.3f} ms, f+b {t_fb:.3f} ms "
                      f"(bwd ~{t_fb - t_f:.3f})")
            swiglu.BLOCK, swiglu.WARPS = block, warps
    sys.exit(1 if failed else 0)


def check():
    """The operator's kernels against float64 autograd (fp32 tensors, ragged F; bf16 to its rounding)."""
    assert swiglu._kernels_run(torch.zeros(1)), "run with TRITON_INTERPRET=1 (and triton installed)"
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2.0**-7)):
        for N, Fw in ((3, 5), (4, 1500)):
            gu, dh = torch.randn(N, 2 * Fw).to(dtype), torch.randn(N, Fw).to(dtype)
            ref_gu = gu.double().requires_grad_()
            ref_h = plain(ref_gu)
            ref_d = torch.autograd.grad(ref_h, ref_gu, dh.double())[0]
            g = gu.clone().requires_grad_()
            h = swiglu.swiglu(g)
            d = torch.autograd.grad(h, g, dh)[0]
            errs = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in ((h, ref_h), (d, ref_d))]
            print(f"{dtype} N={N} F={Fw}: max rel err h {errs[0]:.1e}, dgate_up {errs[1]:.1e}")
            assert max(errs) < tol, errs


if __name__ == "__main__":
    check() if "--check" in sys.argv[1:] else main("--sweep" in sys.argv[1:])
