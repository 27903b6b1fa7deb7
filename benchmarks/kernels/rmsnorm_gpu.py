"""Llama's RMSNorms fwd+bwd on one GPU: inductor's (the plain expression compiled, as a block is under
--compile) against braidtrain's operators (braidtrain/model/rmsnorm.py, `braidtrain::rmsnorm` and
`braidtrain::add_rmsnorm`: one Triton kernel each way, opaque to torch.compile), which a model built for
CUDA runs (not under --exact or --fp8). Issue #58's profile put inductor's norm kernels at ~3.0 ms of
the Llama-1B b4 step (33 norms: backward 1.3 ms, forward 1.2 + 0.5), where ~1.2 ms is the memory floor.

    python benchmarks/kernels/rmsnorm_gpu.py           # from the repo root; about a minute
    python benchmarks/kernels/rmsnorm_gpu.py --sweep   # also: the operators' backward at other PROGRAMS
    TRITON_INTERPRET=1 python benchmarks/kernels/rmsnorm_gpu.py --check   # on the CPU: the kernels' maths

The dtypes are a bf16 run's: the residual stream x fp32, the attention's output r bf16, the weight
fp32, the norm's output read by bf16 matmuls (inductor: the plain fp32 expression cast to bf16, the
cast autocast's matmul does, fused into its kernel; the operators write bf16), its gradient bf16.
Rows, for "inductor" (torch.compile of the expression) and "op" (the operator, also inside
torch.compile): "norm", y = rmsnorm(x) (input_layernorm, the final norm), and "add+norm", (h, y) =
(x + r, rmsnorm(x + r)) (the attention's residual add and post_attention_layernorm); fwd alone (no
grad) and fwd+bwd given dy (and dh); median ms (do_bench), the bytes the pass must move over that
time, the kernels' sum by name from one profiled run, peak MB above the inputs, and the error of
each output and gradient against float64 autograd of the same inputs: ||x - ref|| / ||ref|| and the
largest element's |x - ref| / max |ref|. Exit status 1 if an operator's largest error passes bf16's
rounding (2^-8 of max |ref|) or its relative error passes inductor's by 1.5x (and 1e-5). (Under
--check's interpreter bf16 stores round toward zero, an ulp.)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.model import rmsnorm  # noqa: E402
from loss_gpu import peak_mb  # noqa: E402  (this folder is sys.path[0]: a sibling script)
from swiglu_gpu import errors, kernels_ms  # noqa: E402

CUDA = torch.device("cuda")
EPS = 1e-5
BF = torch.bfloat16


def plain(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def inductor_norm(x, w):
    return plain(x, w).to(BF)


def inductor_add(x, r, w):
    h = x + r
    return h, plain(h, w).to(BF)


def op_norm(x, w):
    return rmsnorm.rmsnorm(x, w, EPS, BF)


def op_add(x, r, w):
    return rmsnorm.add_rmsnorm(x, r, w, EPS, BF)


def reference(add: bool, x, r, w, dy, dh):
    """float64 autograd of the plain expression: the outputs, then the gradients (x, r, w)."""
    x64, r64, w64 = (t.double().requires_grad_() for t in (x, r, w))
    if not add:
        y = plain(x64, w64)
        return [y.detach(), *torch.autograd.grad(y, (x64, w64), dy.double())]
    h = x64 + r64
    y = plain(h, w64)
    return [h.detach(), y.detach(), *torch.autograd.grad((h, y), (x64, r64, w64), (dh.double(), dy.double()))]


def main(sweep: bool):
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    failed = False
    for name, (N, C) in {"llama3.2-1b b4 t2048": (8192, 2048), "llama3.2-3b b2 t2048": (4096, 3072)}.items():
        torch.manual_seed(0)
        x = torch.randn(N, C, device="cuda") * 3
        r = torch.randn(N, C, device="cuda", dtype=BF)
        w = 1 + 0.5 * torch.randn(C, device="cuda")
        dy, dh = torch.randn(N, C, device="cuda", dtype=BF), torch.randn(N, C, device="cuda")
        NC = N * C
        moved = {"norm": (6 * NC, 10 * NC), "add+norm": (12 * NC, 16 * NC)}  # bytes (fwd, bwd) at the floor
        print(f"\n== {name}: N={N} C={C}; the floor at 4.3 TB/s: norm fwd {moved['norm'][0] / 4.3e9:.3f} ms, bwd "
              f"{moved['norm'][1] / 4.3e9:.3f}; add+norm fwd {moved['add+norm'][0] / 4.3e9:.3f}, bwd "
              f"{moved['add+norm'][1] / 4.3e9:.3f}")
        for kind, add in (("norm", False), ("add+norm", True)):
            ref = reference(add, x, r, w, dy, dh)
            err = {}
            for label, fn in (("inductor", inductor_add if add else inductor_norm), ("op", op_add if add else op_norm)):
                f = torch.compile(fn)
                leaves = [t.detach().requires_grad_() for t in ((x, r, w) if add else (x, w))]
                outs = f(*leaves)
                outs = list(outs) if add else [outs]
                grads = torch.autograd.grad(outs, leaves, [dh, dy] if add else [dy])
                err[label] = [errors(g, rf) for g, rf in zip([*outs, *grads], ref)]

                def fwd(f=f):
                    with torch.no_grad():
                        f(*((x, r, w) if add else (x, w)))

                def step(f=f, leaves=leaves):
                    o = f(*leaves)
                    torch.autograd.grad(list(o) if add else [o], leaves, [dh, dy] if add else [dy])

                fwd(), step()
                t_f, t_fb = do_bench(fwd, return_mode="median"), do_bench(step, return_mode="median")
                k, top = kernels_ms(step)
                b = moved[kind]
                print(f"  {label:8s} {kind:8s} fwd {t_f:.3f} ms ({b[0] / t_f / 1e9:.2f} TB/s), f+b {t_fb:.3f} ms (bwd "
                      f"~{t_fb - t_f:.3f}: {b[1] / max(t_fb - t_f, 1e-3) / 1e9:.2f} TB/s) (kernels {k:.3f}: {top})  "
                      f"peak {peak_mb(step, CUDA):.0f} MB")
                names = ["h", "y", "dx", "dr", "dw"] if add else ["y", "dx", "dw"]
                print(f"  {label:8s} {kind:8s} error vs fp64: " + ", ".join(
                    f"{n} {e[0]:.1e} (max {e[1]:.1e})" for n, e in zip(names, err[label])))
            op, ind = err["op"], err["inductor"]
            if max(e[1] for e in op) > 2.0**-8 or any(o[0] > max(1.5 * i[0], 1e-5) for o, i in zip(op, ind)):
                print(f"  FAIL: the operator's errors {op} against inductor's {ind}")
                failed = True
        if sweep:
            programs = rmsnorm.PROGRAMS
            for rmsnorm.PROGRAMS in (132, 264, 528, 1024, 2048, 4096):
                for kind, fn, args in (("norm", op_norm, (x, w)), ("add+norm", op_add, (x, r, w))):
                    leaves = [t.detach().requires_grad_() for t in args]

                    def fb(fn=fn, leaves=leaves, add=kind != "norm"):
                        o = fn(*leaves)
                        torch.autograd.grad(list(o) if add else [o], leaves, [dh, dy] if add else [dy])

                    def f(fn=fn, args=args):
                        with torch.no_grad():
                            fn(*args)

                    t_f, t_fb = do_bench(f, return_mode="median"), do_bench(fb, return_mode="median")
                    print(f"  op PROGRAMS {rmsnorm.PROGRAMS:4d} {kind:8s}: fwd {t_f:.3f} ms, f+b {t_fb:.3f} ms "
                          f"(bwd ~{t_fb - t_f:.3f})")
            rmsnorm.PROGRAMS = programs
    sys.exit(1 if failed else 0)


def check():
    """The operators' kernels against float64 autograd, in a bf16 run's dtypes (ragged C)."""
    assert rmsnorm._kernels_run(torch.zeros(1), 1), "run with TRITON_INTERPRET=1 (and triton installed)"
    torch.manual_seed(0)
    for N, C in ((3, 5), (4, 1500)):
        x, r, w = torch.randn(N, C) * 3, torch.randn(N, C).to(BF), 1 + 0.5 * torch.randn(C)
        dy, dh = torch.randn(N, C).to(BF), torch.randn(N, C)
        for kind, add in (("norm", False), ("add+norm", True)):
            ref = reference(add, x, r, w, dy, dh)
            leaves = [t.clone().requires_grad_() for t in ((x, r, w) if add else (x, w))]
            outs = list(op_add(*leaves)) if add else [op_norm(*leaves)]
            grads = torch.autograd.grad(outs, leaves, [dh, dy] if add else [dy])
            errs = [errors(g, rf)[1] for g, rf in zip([*outs, *grads], ref)]
            print(f"N={N} C={C} {kind}: max rel errs " + ", ".join(f"{e:.1e}" for e in errs))
            assert max(errs) < 2.0**-7, errs


if __name__ == "__main__":
    check() if "--check" in sys.argv[1:] else main("--sweep" in sys.argv[1:])
