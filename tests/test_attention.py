"""The deterministic Triton causal attention (model/attention.py), run on CPU through Triton's
interpreter: forward and dq, dk, dv against torch's math attention in float64 (fp32 inputs,
relative 1e-4), ragged T, the gpt.py (B, T, H, D)-strided layout, bitwise repeatability and
batch invariance; and that the module imports and refuses cleanly without triton.

TRITON_INTERPRET=1 must be set before triton is first imported, and pytest shares one process
between test files, so the kernels run in one subprocess: this file run as a script, which
prints its measurements as JSON for the tests here to judge.

The interpreter runs programs one after another, so repeatability and batch invariance can only
fail here through the code's own logic (e.g. a block size that depends on B or T); the GPU's
scheduling is checked by benchmarks/kernels/attention_gpu.py on the H200 (docs/performance.md)."""

import json
import os
import sys

import pytest
import torch

from helpers import ROOT, run_interpreted

TOL = 1e-4
SHAPES = [(1, 1, 1, 16), (2, 3, 37, 32), (1, 2, 130, 64), (2, 2, 100, 16)]  # (B, H, T, D)
TINY = (1, 2, 77, 32)  # run with tiny blocks too: many diagonal sub-blocks, every ragged edge
CFG16 = [(1, 2, 300, 64), (1, 1, 150, 128)]  # run with the 16-bit dtypes' (larger) blocks


@pytest.fixture(scope="module")
def measured():
    return run_interpreted(__file__)


def test_matches_math_attention(measured):
    """Output and the three gradients within 1e-4 relative of float64 math attention, for T = 1
    (the only key; dq, dk vanish), T not a multiple of any block, B, H > 1, D = 16 ... 128, with
    the fp32 tiles, tiny tiles and the bf16/fp16 tiles."""
    checks = {k: v for k, v in measured.items() if k.startswith(("ref.", "tiny.", "cfg16.", "strided."))}
    assert len(checks) == 4 * (len(SHAPES) + len(CFG16) + 3), sorted(checks)
    bad = {k: v for k, v in checks.items() if not v <= TOL}
    assert not bad, bad


def test_strided_layout(measured):
    """q, k, v as gpt.py makes them (views of one (B, T, 3C) tensor) are read in place, and the
    output and gradients come back stored as (B, T, H, D), like their inputs. (Their accuracy,
    and that of a zero-strided dO, is in test_matches_math_attention.)"""
    assert measured["layout.out_bthd"] and measured["layout.grads_bthd"], measured


def test_bitwise_repeatable(measured):
    """Two forward+backward runs give the same bits for o, dq, dk, dv."""
    assert all(measured[f"repeat.{n}"] for n in ("o", "dq", "dk", "dv")), measured


def test_batch_invariant(measured):
    """A sequence's output and gradients have the same bits alone as inside a batch of 3."""
    assert all(measured[f"batch.{n}"] for n in ("o", "dq", "dk", "dv")), measured


def test_custom_operators_pass_opcheck(measured):
    """torch.library.opcheck on both operators: the fake implementations' shapes and strides match
    the kernels' outputs, and the autograd registration is sound (what --compile relies on)."""
    assert measured["opcheck.fwd"] == "" and measured["opcheck.bwd"] == "", measured


def test_without_triton(measured):
    """With triton unimportable the module still imports, says it is unavailable, and refuses."""
    assert measured["no_triton.available"] is False
    assert "needs triton" in measured["no_triton.error"]


def test_bad_inputs():
    from braidtrain.model.attention import causal_attention
    x = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="one shape"):
        causal_attention(x, x, torch.zeros(1, 2, 9, 16))
    with pytest.raises(ValueError, match="one dtype"):
        causal_attention(x, x, x.double())
    with pytest.raises(ValueError, match="head dims"):
        y = torch.zeros(1, 2, 8, 24)
        causal_attention(y, y, y)


# ---- the subprocess ------------------------------------------------------------------------

def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (a - b).norm().item()  # T=1: dq = dk = 0


def _run(fn, q, k, v, do):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _ref(q, k, v, do):
    import torch.nn.functional as F
    return _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                q.double(), k.double(), v.double(), do.double())


def _measure() -> dict:
    out = {}
    # 1. No triton: import and refuse. (Before anything imports triton in this process.)
    sys.modules["triton"] = None  # makes `import triton` raise ImportError
    from braidtrain.model import attention as A
    out["no_triton.available"] = A.available("cpu")
    try:
        A.causal_attention(*(torch.zeros(1, 1, 4, 16) for _ in range(3)))
        out["no_triton.error"] = ""
    except RuntimeError as e:
        out["no_triton.error"] = str(e)
    del sys.modules["triton"]
    assert A.available("cpu"), "TRITON_INTERPRET=1 is set and triton is installed"

    torch.manual_seed(0)
    names = ("o", "dq", "dk", "dv")

    def compare(tag, fn, q, k, v):
        do = torch.randn_like(q)
        for n, a, b in zip(names, _run(fn, q, k, v, do), _ref(q, k, v, do)):
            out[f"{tag}.{n}"] = _rel(a, b)

    # 2. Accuracy: default blocks; tiny blocks; the gpt.py layout.
    for B, H, T, D in SHAPES:
        compare(f"ref.{B}x{H}x{T}x{D}", A.causal_attention, *(torch.randn(B, H, T, D) for _ in range(3)))
    A.register()  # (the operators, which causal_attention defines on first use)

    def with_config(cfg):
        return lambda q, k, v: torch.ops.braidtrain.causal_attention(q, k, v, list(cfg))[0]

    tiny = A._Config(32, 16, 16, 32, 32, 16, fwd_warps=4, bwd_warps=4, stages=1)
    compare("tiny", with_config(tiny), *(torch.randn(TINY) for _ in range(3)))
    for shape in CFG16:  # the GPU's bf16 tiles, here on fp32 inputs (those get 32 x 32 tiles)
        cfg = A._config(shape[-1], torch.bfloat16)
        compare(f"cfg16.{shape[-1]}", with_config(cfg), *(torch.randn(shape) for _ in range(3)))

    B, T, H, D = 2, 45, 3, 16
    qkv = torch.randn(B, T, 3 * H * D, requires_grad=True)
    q, k, v = (z.view(B, T, H, D).transpose(1, 2) for z in qkv.split(H * D, dim=2))
    o = A.causal_attention(q, k, v)
    out["layout.out_bthd"] = o.transpose(1, 2).is_contiguous()
    grads = torch.autograd.grad(o, (q, k, v), torch.randn_like(o))  # as the kernels wrote them
    out["layout.grads_bthd"] = all(g.transpose(1, 2).is_contiguous() for g in grads)
    compare("strided", A.causal_attention, q.detach(), k.detach(), v.detach())

    # o.sum().backward(): dO arrives as an expanded tensor with all strides 0 (copied first).
    q, k, v = (torch.randn(2, 2, 20, 16) for _ in range(3))
    do = torch.ones(()).expand(2, 2, 20, 16)
    for n, a, b in zip(names, _run(A.causal_attention, q, k, v, do), _ref(q, k, v, do)):
        out[f"strided.zero_do.{n}"] = _rel(a, b)

    # 3. Bitwise: two runs; one sequence alone vs. inside a batch of 3.
    q, k, v, do = (torch.randn(2, 3, 37, 32) for _ in range(4))
    r1, r2 = _run(A.causal_attention, q, k, v, do), _run(A.causal_attention, q, k, v, do)
    for n, a, b in zip(names, r1, r2):
        out[f"repeat.{n}"] = torch.equal(a, b)
    q, k, v, do = (torch.randn(3, 2, 70, 32) for _ in range(4))
    batch = _run(A.causal_attention, q, k, v, do)
    alone = _run(A.causal_attention, q[1:2], k[1:2], v[1:2], do[1:2])
    for n, a, b in zip(names, batch, alone):
        out[f"batch.{n}"] = torch.equal(a[1:2], b)

    # 4. The custom operators against torch's checks (schema, autograd registration, fake
    #    tensors -- the strides torch.compile plans with), gpt.py's layout. Not AOT dispatch:
    #    its trace of a triton_op sees the kernels through wrap_triton, which the interpreter's
    #    kernels escape (attention._launch); on the GPU the compiled exact runs use that trace.
    from torch.library import opcheck
    qkv = torch.randn(1, 20, 3 * 2 * 16)
    q, k, v = (z.view(1, 20, 2, 16).transpose(1, 2).requires_grad_() for z in qkv.split(32, dim=2))
    cfg = list(A._config(16, torch.float32))
    o, lse = torch.ops.braidtrain.causal_attention(q, k, v, cfg)
    checks_here = ("test_schema", "test_autograd_registration", "test_faketensor")
    for tag, op, args, checks in (
            ("fwd", torch.ops.braidtrain.causal_attention.default, (q, k, v, cfg), checks_here),
            ("bwd", torch.ops.braidtrain.causal_attention_backward.default,
             (q.detach(), k.detach(), v.detach(), o.detach(), lse, torch.randn_like(o), cfg), checks_here)):
        try:
            opcheck(op, args) if checks is None else opcheck(op, args, test_utils=checks)
            out[f"opcheck.{tag}"] = ""
        except Exception as e:  # reported to the test, which shows it
            out[f"opcheck.{tag}"] = f"{type(e).__name__}: {e}"[:500]
    return out


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_attention.py with TRITON_INTERPRET=1"
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_measure()))
