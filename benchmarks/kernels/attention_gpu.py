"""The deterministic Triton causal attention (braidtrain/model/attention.py) on one GPU, against
torch's flash SDPA: accuracy, bitwise repeatability, batch invariance, speed.

    python benchmarks/kernels/attention_gpu.py            # from the repo root; meant to take 1-2 minutes
    python benchmarks/kernels/attention_gpu.py --configs  # only: time a few other fixed block configs
    python benchmarks/kernels/attention_gpu.py --llama    # only: torch's SDPA backends at the Llamas' shapes

For bf16 (B=16, H=12, T=1024, D=64) and (B=4, H=25, T=1024, D=64):
  * relative error ||x - ref|| / ||ref|| of o, dq, dk, dv against torch's math SDPA on fp32
    copies, for ours and (as the yardstick) for flash;
  * 3 forward+backward runs: are o, dq, dk, dv bitwise equal (torch.equal)? ours must be;
    torch's flash is reported, not failed on;
  * sequence 1 computed alone vs. inside the batch: the same bits? (ours must be);
  * median time (triton.testing.do_bench) of forward and forward+backward.
Then a small sweep (D in {16, 32, 64, 128} in bf16 and fp32, fp16, T = 1 and ragged T, gpt.py's
strided q/k/v) so that every kernel configuration is compiled and checked once on this GPU.
Exit status 1 if any of ours fails.
"""

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.model.attention import _config, available, causal_attention, register  # noqa: E402

NAMES = ("o", "dq", "dk", "dv")


def flash(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def math_fp32(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def run(fn, q, k, v, do):
    """o, dq, dk, dv of fn at (q, k, v) for upstream gradient do."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o.detach(), dq, dk, dv


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def reference(q, k, v, do):
    return run(math_fp32, q.float(), k.float(), v.float(), do.float())


def same_bits(fn, q, k, v, do, n=3):
    runs = [run(fn, q, k, v, do) for _ in range(n)]
    return {name: all(torch.equal(runs[0][i], r[i]) for r in runs[1:]) for i, name in enumerate(NAMES)}


def fwd_bwd(fn, q, k, v, do):
    def step():
        fn(q, k, v).backward(do)
    return step


def main():
    assert torch.cuda.is_available() and available("cuda"), "needs a CUDA GPU and triton"
    t_start = time.time()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    ok = True
    table = []
    for B, H, T, D in [(16, 12, 1024, 64), (4, 25, 1024, 64)]:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        print(f"\n== bf16 B={B} H={H} T={T} D={D}")
        ref = reference(q, k, v, do)
        ours, theirs = run(causal_attention, q, k, v, do), run(flash, q, k, v, do)
        for i, name in enumerate(NAMES):
            e_ours, e_flash = rel(ours[i], ref[i]), rel(theirs[i], ref[i])
            good = e_ours <= 2 * e_flash + 1e-3
            ok &= good
            print(f"  rel err {name}: ours {e_ours:.2e}  flash {e_flash:.2e}  {'ok' if good else 'FAIL'}")
        del ref, theirs

        rep_ours, rep_flash = same_bits(causal_attention, q, k, v, do), same_bits(flash, q, k, v, do)
        ok &= all(rep_ours.values())
        print(f"  3 runs bitwise equal: ours {rep_ours}")
        print(f"                        flash {rep_flash}  (reported, not required)")

        alone = run(causal_attention, q[1:2], k[1:2], v[1:2], do[1:2])
        inv = {name: torch.equal(ours[i][1:2], alone[i]) for i, name in enumerate(NAMES)}
        ok &= all(inv.values())
        print(f"  sequence 1 alone == in batch of {B}: {inv}")

        times = {}
        for label, fn in (("ours", causal_attention), ("flash", flash), ("cudnn", cudnn)):
            times[label, "fwd"] = do_bench(lambda: fn(q, k, v), return_mode="median")
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            times[label, "fwd+bwd"] = do_bench(fwd_bwd(fn, qg, kg, vg, do), grad_to_none=[qg, kg, vg],
                                               return_mode="median")
        table.append(((B, H, T, D), times, all(rep_ours.values()), all(rep_flash.values())))

    print("\n== sweep: every kernel configuration compiled and checked once (B=2, H=3)")
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = ([(bf16, D, 1000) for D in (16, 32, 64, 128)] + [(fp16, 64, 1000), (bf16, 64, 1), (bf16, 64, 77)]
             + [(fp32, D, 1000) for D in (16, 32, 64, 128)])
    for dtype, D, T in cases:
        name = f"{str(dtype)[6:]:8s} D={D:3d} T={T:4d}"
        try:
            torch.manual_seed(1)
            q, k, v, do = (torch.randn(2, 3, T, D, device="cuda", dtype=dtype) for _ in range(4))
            ref = reference(q, k, v, do)
            errs = [rel(a, b) if b.norm() > 0 else (a.float() - b).norm().item()  # T=1: dq = dk = 0
                    for a, b in zip(run(causal_attention, q, k, v, do), ref)]
            if dtype == fp32:
                tol = 1e-4
            else:  # flash's error in the same dtype is the yardstick
                tol = 2 * max(rel(a, b) for a, b in zip(run(flash, q, k, v, do), ref) if b.norm() > 0) + 1e-3
            rep = all(same_bits(causal_attention, q, k, v, do, n=2).values())
            good = max(errs) <= tol and rep
            print(f"  {name}  max rel err {max(errs):.1e} (tol {tol:.0e})  repeatable {rep}  "
                  f"{'ok' if good else 'FAIL'}")
        except Exception as e:  # e.g. a configuration that does not fit this GPU
            good = False
            print(f"  {name}  ERROR {type(e).__name__}: {str(e)[:300]}")
        ok &= good
    # gpt.py's layout: q, k, v strided views of one (B, T, 3C) tensor, read in place
    B, T, H, D = 4, 1024, 12, 64
    qkv = torch.randn(B, T, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (z.view(B, T, H, D).transpose(1, 2) for z in qkv.split(H * D, dim=2))
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    strided = run(causal_attention, q, k, v, do)
    errs = [rel(a, b) for a, b in zip(strided, reference(q, k, v, do))]
    good = max(errs) <= 2e-2
    ok &= good
    dense = run(causal_attention, q.contiguous(), k.contiguous(), v.contiguous(), do)
    same = all(torch.equal(a, b) for a, b in zip(strided, dense))
    print(f"  gpt.py strided q/k/v bf16 B={B} T={T} H={H} D={D}: max rel err {max(errs):.1e}  "
          f"{'ok' if good else 'FAIL'}  same bits as contiguous q/k/v: {same} (reported)")

    print("\n== median ms (triton.testing.do_bench), bf16, causal")
    print(f"  {'B,H,T,D':16s} {'ours fwd':>9s} {'flash fwd':>9s} {'ours f+b':>9s} {'flash f+b':>9s} "
          f"{'f+b ratio':>9s} {'cudnn fwd':>9s} {'cudnn f+b':>9s}  bitwise repeatable (ours / flash)")
    for shape, t, rep_o, rep_f in table:
        print(f"  {','.join(map(str, shape)):16s} {t['ours', 'fwd']:9.3f} {t['flash', 'fwd']:9.3f} "
              f"{t['ours', 'fwd+bwd']:9.3f} {t['flash', 'fwd+bwd']:9.3f} "
              f"{t['ours', 'fwd+bwd'] / t['flash', 'fwd+bwd']:8.2f}x {t['cudnn', 'fwd']:9.3f} "
              f"{t['cudnn', 'fwd+bwd']:9.3f}  {rep_o} / {rep_f}")
    print(f"\n{'ALL OK' if ok else 'SOME CHECKS FAILED'}  ({time.time() - t_start:.0f} s)")
    sys.exit(0 if ok else 1)


def configs():
    """Time fwd and fwd+bwd of bf16 (16, 12, 1024, 64) under a few fixed configurations, to
    choose _config()'s by measurement. Each is checked for accuracy and repeatability first."""
    assert torch.cuda.is_available() and available("cuda"), "needs a CUDA GPU and triton"
    base = _config(64, torch.bfloat16)
    candidates = {
        "default": base,
        "fwd 8 warps": base._replace(fwd_warps=8),
        "bwd 4 warps": base._replace(bwd_warps=4),
        "stages 2": base._replace(stages=2),
        "stages 4": base._replace(stages=4),
        "fwd 64x64": base._replace(fwd_m=64, fwd_n=64),
        "bwd 64x64, 4 warps": base._replace(kv_m=64, kv_n=64, q_m=64, q_n=64, bwd_warps=4),
        "bwd 32x64/64x32, 4 warps": base._replace(kv_n=64, q_m=64, bwd_warps=4),
    }
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(16, 12, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    ref = reference(q, k, v, do)
    print(f"{'config':28s} {'fwd ms':>8s} {'f+b ms':>8s}  max rel err  repeatable")
    for name, cfg in candidates.items():
        def fn(q, k, v, cfg=cfg):
            register()
            return torch.ops.braidtrain.causal_attention(q, k, v, list(cfg))[0]
        try:
            err = max(rel(a, b) for a, b in zip(run(fn, q, k, v, do), ref))
            rep = all(same_bits(fn, q, k, v, do, n=2).values())
            t_fwd = do_bench(lambda: fn(q, k, v), return_mode="median")
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            t_fb = do_bench(fwd_bwd(fn, qg, kg, vg, do), grad_to_none=[qg, kg, vg], return_mode="median")
            print(f"{name:28s} {t_fwd:8.3f} {t_fb:8.3f}  {err:.1e}      {rep}")
        except Exception as e:
            print(f"{name:28s} ERROR {type(e).__name__}: {str(e)[:200]}")


def llama():
    """torch's SDPA backends at the Llamas' training shapes (bf16, causal, grouped-query attention),
    as braidtrain's non-exact CUDA path calls it (layers.attend: `enable_gqa`, no backend named) and
    with each backend forced, k and v given as K heads (enable_gqa) or repeated to H: which backend
    torch picks (the kernels a profiled call runs), fwd and fwd+bwd median ms and TFLOP/s (causal:
    4 B H T^2 D / 2 forward, 2.5x that backward), and each backend's error against fp32 math."""
    from torch.profiler import ProfilerActivity, profile
    t_start = time.time()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cuDNN {torch.backends.cudnn.version()}")
    backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def sdpa(backend, gqa):
        def fn(q, k, v):
            if not gqa:
                k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
            with sdpa_kernel(backend) if backend is not None else nullcontext():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return fn

    rows = []
    for name, (B, H, K, T, D) in {"llama3.2-1b b4": (4, 32, 8, 2048, 64), "llama3.2-3b b2": (2, 24, 8, 2048, 128),
                                  "llama3.1-8b b1": (1, 32, 8, 2048, 128)}.items():
        torch.manual_seed(0)
        q, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(B, K, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = run(math_fp32, q.float(), k.float().repeat_interleave(H // K, 1), v.float().repeat_interleave(H // K, 1),
                  do.float())
        flops = 4 * B * H * T * T * D / 2
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(sdpa(None, True), q, k, v, do)
            torch.cuda.synchronize()
        picked = sorted({e.key[:60] for e in prof.key_averages() if e.device_type.name == "CUDA"
                         and any(s in e.key.lower() for s in ("flash", "fmha", "cudnn", "attention", "sdpa"))})
        print(f"\n== {name}: B={B} H={H} K={K} T={T} D={D}; the default call runs: {picked}")
        for label, backend in backends.items():
            for gqa in (True, False):
                fn = sdpa(backend, gqa)
                try:
                    out = run(fn, q, k, v, do)
                    err = max(rel(a, b) for a, b in zip(out[:2], ref[:2]))  # o, dq (dk, dv: summed over a group)
                    err = max(err, *(rel(a, b.unflatten(1, (K, H // K)).sum(2)) for a, b in zip(out[2:], ref[2:])))
                    t_f = do_bench(lambda: fn(q, k, v), return_mode="median")
                    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                    t_fb = do_bench(fwd_bwd(fn, qg, kg, vg, do), grad_to_none=[qg, kg, vg], return_mode="median")
                    rows.append((name, label, gqa, t_f, t_fb, flops / t_f / 1e9, 3.5 * flops / t_fb / 1e9, err))
                    print(f"  {label:9s} {'gqa   ' if gqa else 'repeat'} fwd {t_f:7.3f} ms ({rows[-1][5]:4.0f} TFLOP/s)  "
                          f"fwd+bwd {t_fb:7.3f} ms ({rows[-1][6]:4.0f})  max rel err {err:.1e}")
                except Exception as e:  # a backend that does not take this shape
                    print(f"  {label:9s} {'gqa   ' if gqa else 'repeat'} ERROR {type(e).__name__}: {str(e)[:150]}")
        del ref
    print(f"\n({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    if "--configs" in sys.argv[1:]:
        configs()
    elif "--llama" in sys.argv[1:]:
        llama()
    else:
        main()
