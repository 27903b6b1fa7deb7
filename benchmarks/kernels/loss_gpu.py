"""The fused LM head + cross-entropy (braidtrain/model/loss.py) on one GPU, against torch:
accuracy, bitwise repeatability, speed, memory.

    python benchmarks/kernels/loss_gpu.py            # from the repo root; meant to take under a minute
    python benchmarks/kernels/loss_gpu.py --configs  # also: time the fused pass at other (block, warps)
    python benchmarks/kernels/loss_gpu.py --tokens 8192 --width 2048 --vocab 128256   # llama3.2-1b's head, b 4 x t 2048
    ... --chunks 2 4 8   # also a chunked linear-cross-entropy (the logits a chunk of tokens at a time)
    TRITON_INTERPRET=1 python benchmarks/kernels/loss_gpu.py --smoke   # tiny, on CPU: checks this script

By default gpt2's head at B=16, T=1024: h (16384, 768) bf16 -- as under autocast -- w (50304, 768)
fp32 (the vocabulary padded to a multiple of 128), V = 50257, upstream gradient g = 1/N (the
training loop's loss / tokens); --tokens, --width, --vocab give another head. The torch rows are
what a transformers model does under bf16 autocast (its lm_head in bf16, the logits made fp32 for
the cross-entropy): `bench train --torch hf`'s loss, and under torch.compile hf-compile's:
  * relative error ||x - ref|| / ||ref|| of loss, dh, dw against an fp32 reference (fp32 h, no
    TF32), for ours and, as the yardstick, for eager torch in bf16 (ours must be within 1.5x of it);
  * 3 forward+backward runs: loss, dh, dw bitwise equal? (ours must be; torch's are reported);
  * ours called inside a torch.compile'd function (a graph break): the same bits as eager;
  * median time (triton.testing.do_bench) of forward+backward and of a no-grad forward, and the
    peak memory above the inputs of forward+backward, for ours, eager torch
    (F.linear + slice + float + cross_entropy) and torch.compile of that same function;
  * ours taken apart: the forward matmul, the fused pass alone (its effective bandwidth: it reads
    the bf16 logits twice and writes them once), the two backward matmuls.
Exit status 1 if any of ours fails.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.model import loss as L  # noqa: E402
from braidtrain.model.loss import head_loss  # noqa: E402
from braidtrain.model.protocol import VOCAB_ALIGN  # noqa: E402

NAMES = ("loss", "dh", "dw")
HBM_TBPS = 4.8  # H200


def torch_loss(h, w, t, V):
    """What GPT.loss did: the tied head in h's dtype, the loss in fp32 over the real vocabulary."""
    return F.cross_entropy(F.linear(h, w.to(h.dtype))[:, :V].float(), t, reduction="sum")


class _Chunked(torch.autograd.Function):
    """A candidate (issue #58): the linear cross-entropy chunk of tokens by chunk, never all the
    logits at once -- per chunk the bf16 logits (N/k, Vp), ours's fused pass over them (the loss,
    and softmax - onehot in place), dh's rows, and dw accumulated in fp32 by the matmul itself
    (beta = 1). Both gradients are computed in the forward, scaled by g in the backward."""

    @staticmethod
    def forward(ctx, h, w, t, V, k):
        wc = w.to(h.dtype)
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device)
        losses = []
        for hc, tc, dhc in zip(h.chunk(k), t.chunk(k), dh.chunk(k)):
            logits = torch.mm(hc, wc.t())
            losses.append(L._fused_pass(logits, tc, V, True))
            torch.mm(logits, wc, out=dhc)
            if h.is_cuda:
                torch.addmm(dw, logits.t(), hc, out_dtype=torch.float32, out=dw)
            else:
                dw.add_(torch.mm(logits.t(), hc).float())
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = w.dtype
        return torch.cat(losses).sum()

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        return dh * g, (dw * g).to(ctx.w_dtype), None, None, None


def chunked(k):
    def fn(h, w, t, V):
        return _Chunked.apply(h, w, t, V, k)
    return fn


def run(fn, h, w, t, V, g):
    """loss, dh, dw of fn for upstream gradient g."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(h, w, t, V)
    dh, dw = torch.autograd.grad(loss, (h, w), g)
    return loss.detach(), dh, dw


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def same_bits(fn, h, w, t, V, g, n=3):
    runs = [run(fn, h, w, t, V, g) for _ in range(n)]
    return {name: all(torch.equal(runs[0][i], r[i]) for r in runs[1:]) for i, name in enumerate(NAMES)}


def bench(fn, smoke):
    if smoke:  # CPU: a plain timer, a couple of runs
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, return_mode="median")


def peak_mb(fn, device):
    """Peak memory allocated while fn runs, above what was allocated before, in MB."""
    if device.type != "cuda":
        return float("nan")
    fn()  # warm (compilation, autocast caches, cuBLAS workspaces)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", action="store_true", help="also time the fused pass at other (block, warps)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (with TRITON_INTERPRET=1)")
    ap.add_argument("--tokens", type=int, default=16384, help="rows of h: b x t (default gpt2's 16 x 1024)")
    ap.add_argument("--width", type=int, default=768, help="columns of h: n_embd (default gpt2's)")
    ap.add_argument("--vocab", type=int, default=50257, help="the real vocabulary (default gpt2's)")
    ap.add_argument("--chunks", type=int, nargs="*", default=[], help="also the chunked candidate at these chunk counts")
    a = ap.parse_args(argv)
    t_start = time.time()
    if a.smoke:
        device, (N, C, Vp, V) = torch.device("cpu"), (64, 32, 640, 600)
    else:
        assert torch.cuda.is_available(), "needs a CUDA GPU"
        device, (N, C, Vp, V) = torch.device("cuda"), (a.tokens, a.width, -(-a.vocab // VOCAB_ALIGN) * VOCAB_ALIGN, a.vocab)
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    assert L.available(device, L._load_triton), "needs triton (and, on the CPU, TRITON_INTERPRET=1)"
    print(f"triton {L.triton.__version__}  N={N} C={C} Vp={Vp} V={V}  fused pass {L._config(V)}")
    ok = True

    torch.manual_seed(0)
    h = torch.randn(N, C, device=device).to(torch.bfloat16)  # a LayerNorm's output, in bf16
    w = torch.randn(Vp, C, device=device) * 0.02  # GPT-2's init
    w[V:] = 0  # the padding rows, as full_init makes them
    t = torch.randint(0, V, (N,), device=device)
    g = torch.tensor(1.0 / N, device=device)
    compiled = torch.compile(torch_loss)
    fns = {"ours": head_loss, "torch eager": torch_loss, "torch.compile": compiled,
           **{f"chunked {k}": chunked(k) for k in a.chunks}}

    # 1. Accuracy against fp32 (true fp32 products: TF32 off for the reference only).
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = run(torch_loss, h.float(), w, t, V, g)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    errs = {label: [rel(x, r) for x, r in zip(run(fn, h, w, t, V, g), ref)] for label, fn in fns.items()}
    del ref
    print("\n== relative error vs fp32 reference      loss       dh       dw")
    for label, e in errs.items():
        print(f"  {label:36s} " + " ".join(f"{x:8.1e}" for x in e))
    good = all(o <= 1.5 * r + 1e-5 for o, r in zip(errs["ours"], errs["torch eager"]))
    ok &= good
    print(f"  ours within 1.5x of eager torch's error: {'ok' if good else 'FAIL'}")

    # 2. Bitwise repeatability; inside torch.compile.
    print("\n== 3 forward+backward runs bitwise equal")
    for label, fn in fns.items():
        rep = same_bits(fn, h, w, t, V, g)
        if label == "ours":
            ok &= all(rep.values())
        print(f"  {label:14s} {rep}" + ("" if label == "ours" else "  (reported, not required)"))
    inside = torch.compile(lambda h, w, t, V: head_loss(h, w, t, V))
    same = all(torch.equal(x, y) for x, y in zip(run(inside, h, w, t, V, g), run(head_loss, h, w, t, V, g)))
    ok &= same
    print(f"  ours inside torch.compile == eager: {same}")

    # 3. Speed and memory.
    hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
    rows = []
    for label, fn in fns.items():
        def fwd_bwd(fn=fn):
            torch.autograd.grad(fn(hg, wg, t, V), (hg, wg), g)

        def fwd_eval(fn=fn):
            with torch.no_grad():
                fn(h, w, t, V)
        rows.append((label, bench(fwd_bwd, a.smoke), bench(fwd_eval, a.smoke), peak_mb(fwd_bwd, device)))
    print(f"\n== median ms{' (CPU smoke: one run)' if a.smoke else ' (triton.testing.do_bench)'}, "
          f"peak MB above the inputs")
    print(f"  {'':14s} {'fwd+bwd':>9s} {'eval fwd':>9s} {'peak MB':>9s} {'f+b vs ours':>12s}")
    for label, fb, ev, mb in rows:
        print(f"  {label:14s} {fb:9.3f} {ev:9.3f} {mb:9.0f} {fb / rows[0][1]:11.2f}x")

    wc = w.to(h.dtype)
    taken_apart(h, wc, t, V, a.smoke)
    if a.configs:
        configs(h, wc, t, V, a.smoke)
    print(f"\n{'ALL OK' if ok else 'SOME CHECKS FAILED'}  ({time.time() - t_start:.0f} s)")
    return 0 if ok else 1


def taken_apart(h, wc, t, V, smoke):
    """Ours, piece by piece: the forward matmul, the fused pass, the backward matmuls."""
    buf = torch.mm(h, wc.t())
    dl = buf.clone()
    t_mm = bench(lambda: torch.mm(h, wc.t()), smoke)
    t_pass = bench(lambda: L._fused_pass(buf, t, V, True), smoke)  # overwrites buf: the same work each time
    t_pass_eval = bench(lambda: L._fused_pass(buf, t, V, False), smoke)
    t_bwd = bench(lambda: (torch.mm(dl, wc), torch.mm(dl.t(), h)), smoke)
    gb = buf.numel() * buf.element_size() / 1e9
    print(f"\n== ours taken apart (ms)\n  forward matmul {t_mm:.3f}  fused pass {t_pass:.3f} "
          f"(no-grad, one read: {t_pass_eval:.3f})  backward matmuls {t_bwd:.3f}")
    print(f"  fused pass: 3 x {gb:.2f} GB (read, read, write) in {t_pass:.3f} ms = {3 * gb / t_pass:.2f} TB/s "
          f"effective; if the second read hits L2, 2 x {gb:.2f} GB at {HBM_TBPS} TB/s needs {2 * gb / HBM_TBPS:.3f} ms")


def configs(h, wc, t, V, smoke):
    """The fused pass (forward, gradient written) at a few (block, warps): time, and the same
    losses as the default to fp32 rounding."""
    buf0 = torch.mm(h, wc.t())
    ref = L._fused_pass(buf0.clone(), t, V, True)
    print(f"\n== fused pass by config (default {L._config(V)})")
    print(f"  {'block':>6s} {'warps':>5s} {'ms':>8s} {'TB/s':>6s}  losses vs default")
    for block, warps in [(4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 16),
                         (32768, 32), (65536, 32)]:
        cfg = L._Config(block, warps)
        try:
            buf = buf0.clone()
            err = rel(L._fused_pass(buf, t, V, True, cfg), ref)
            ms = bench(lambda: L._fused_pass(buf, t, V, True, cfg), smoke)
            print(f"  {block:6d} {warps:5d} {ms:8.3f} {3 * buf.numel() * buf.element_size() / ms / 1e9:6.2f}  {err:.1e}"
                  + ("  (default)" if cfg == L._config(V) else ""))
        except Exception as e:  # e.g. a configuration that does not fit
            print(f"  {block:6d} {warps:5d} ERROR {type(e).__name__}: {str(e)[:200]}")
        finally:
            buf = None


if __name__ == "__main__":
    sys.exit(main())
