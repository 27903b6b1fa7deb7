"""The tied LM head and the summed cross-entropy, fused (llm.c's "fused classifier"), for tp = 1.

What. `head_loss(h, weight, targets, vocab_size)` is

    F.cross_entropy(F.linear(h, weight)[:, :vocab_size].float(), targets, reduction="sum")

-- the logits computed in h's dtype (bf16 under autocast), the softmax in fp32 over the real
vocabulary only (the padding rows of the embedding take no part) -- differentiable w.r.t. h and
weight.

Why. The plain version materialises the (N, Vp) logits in bf16, a float32 copy of them, the
float32 log-probs that the cross-entropy keeps for the backward pass, and there float32 gradients
of the log-probs and of the logits, then a bf16 one: gigabytes at GPT-2's vocabulary, and several
times the time its memory traffic needs (docs/performance-history.md). Here, per row, one pass:

    forward   logits = h @ wᵀ                   one cuBLAS matmul, (N, Vp) in h's dtype
              per row (one Triton program):      read the row in chunks: online max m and
                                                 s = Σ exp(x - m) in fp32; lse = m + log s
                                                 loss_row = lse - x[target]
                                                 read it again, overwrite it in place with
                                                 softmax(x) - onehot(target) (0 in the padding)
              loss = loss_rows.sum()             fixed-order torch reduction
    backward  dh = (dlogits @ w) · g,  dw = (dlogitsᵀ @ h) · g      (g: dloss, a scalar)

Memory: the logits buffer is the only (N, Vp) tensor, ever -- no fp32 logits or log-probs, no
separate gradient buffer: it becomes dlogits, which is what the backward pass keeps. Under bf16
autocast that is 2 bytes per token x vocabulary entry, kept and peak, where the plain version
keeps 4 (fp32 log-probs) and peaks at ~12 (as the planner counted it before this). The scale g is known only
in the backward pass, so it is applied to the small results, dh and dw, never to the big buffer.
Outside grad mode (evaluation) the second pass is skipped.

Determinism: each row is one program whose sums run in a fixed order with chunk sizes that depend
only on vocab_size; the per-row losses go to an (N,) fp32 buffer summed by torch; no atomics. So
loss, dh and dw are bitwise repeatable (given cuBLAS's, which are for fixed shapes).

Autocast. Under torch.autocast (on h's device type) h is cast to the autocast dtype first, as
F.linear would have done: so ln_f's output, which LayerNorm leaves in fp32, can be passed as is.
Otherwise the logits are computed in h's dtype (the weight is cast to it). dh comes back in h's
dtype before that cast (autograd casts it back), dw in the weight's dtype (fp32 for the master
weights): the product in the compute dtype, cast, then scaled by g.

Devices. On CUDA with triton, the fused pass is a Triton kernel; with TRITON_INTERPRET=1 (set
before triton is first imported) it is the same kernel run on CPU tensors by Triton's interpreter,
for tests. Otherwise the same autograd.Function does that pass with plain torch ops (fp32
temporaries, on the CPU that is fine). Triton is imported on first use only.

Preconditions, not checked on the device (a check would cost a host sync): every target lies in
[0, vocab_size); there is no ignore_index.
"""

from __future__ import annotations  # kernel annotations stay strings until triton is imported

import os
from contextlib import nullcontext
from typing import NamedTuple

import torch

from braidtrain.model.attention import available

triton = tl = None  # bound by _load_triton(); the kernel resolves `tl` through this module


class _Config(NamedTuple):
    block: int   # vocabulary columns per chunk (a power of two)
    warps: int


_MAX_BLOCK = 4096


def _config(vocab_size: int) -> _Config:
    """Chunk size by vocab_size only (never by N: a row's bits must not depend on the batch),
    16 columns a thread. Chosen by measurement: 4096 columns with 8 warps ran fastest of the
    chunk sizes tried (benchmarks/kernels/loss_gpu.py --configs; docs/performance-history.md)."""
    block = min(_MAX_BLOCK, 1 << max(vocab_size - 1, 1).bit_length())
    return _Config(block, max(4, min(32, block // 512)))


def head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Σ_rows -log softmax(h @ weightᵀ [:, :vocab_size])[target], a float32 scalar.

    h: (N, C) -- or (..., C), flattened -- the final LayerNorm's output; cast to the autocast
    dtype when autocast is on for h's device type. weight: (Vp, C), Vp >= vocab_size, the tied
    embedding (rows >= vocab_size are padding and take no part). targets: (N,) -- or (...) --
    integers in [0, vocab_size).
    Inside a torch.compile'd function it runs eagerly, behind a graph break. (Not a decorator:
    `torch.compiler.disable` at import would import dynamo, 1.2 s, into every process.)"""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(head_loss)(h, weight, targets, vocab_size)
    h = h.reshape(-1, h.shape[-1])
    targets = targets.reshape(-1)
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"head_loss: weight must be (Vp, C={h.shape[1]}); got {tuple(weight.shape)}")
    if targets.shape[0] != h.shape[0] or targets.is_floating_point():
        raise ValueError(f"head_loss: targets must be {h.shape[0]} integers; got {tuple(targets.shape)} "
                         f"{targets.dtype}")
    if not 1 <= vocab_size <= weight.shape[0]:
        raise ValueError(f"head_loss: vocab_size={vocab_size} must be in [1, {weight.shape[0]}] (the weight's rows)")
    if torch.is_autocast_enabled(h.device.type):
        h = h.to(torch.get_autocast_dtype(h.device.type))  # what autocast's F.linear would do
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _HeadLoss.apply(h, weight, targets.long(), vocab_size, need_grad, None)


class _HeadLoss(torch.autograd.Function):
    """Forward: logits = h wᵀ, then per row the loss and, in place, dlogits = softmax - onehot.
    Backward: dh = g·dlogits w, dw = g·dlogitsᵀ h. Saves dlogits, h and w (in h's dtype)."""

    @staticmethod
    def forward(ctx, h, weight, targets, vocab_size, need_grad, cfg):  # cfg: None, or tests' _Config
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(h.dtype)  # no copy when they match
            logits = torch.mm(h, w.t())  # (N, Vp): becomes dlogits below
            losses = _fused_pass(logits, targets, vocab_size, need_grad, cfg)
            loss = losses.sum()  # fixed order for a given N: deterministic
        if need_grad:
            ctx.save_for_backward(logits, h, w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        dlogits, h, w = ctx.saved_tensors
        dh = dw = None
        with torch.autocast(h.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dh = torch.mm(dlogits, w).mul_(g)
            if ctx.needs_input_grad[1]:
                dw = torch.mm(dlogits.t(), h).to(ctx.weight_dtype).mul_(g)
        return dh, dw, None, None, None, None


def _fused_pass(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, write_grad: bool,
                cfg: _Config | None = None) -> torch.Tensor:
    """Per-row losses (N,) fp32 of the (N, Vp) logits, overwriting them with softmax - onehot
    over the first vocab_size columns and zeros in the rest when write_grad."""
    N, Vp = logits.shape
    losses = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return losses
    if not available(logits.device, _load_triton):
        return _fused_pass_torch(logits, targets, vocab_size, write_grad)
    cfg = cfg or _config(vocab_size)
    assert logits.stride(1) == 1 and targets.is_contiguous()
    with torch.cuda.device(logits.device) if logits.device.type == "cuda" else nullcontext():
        _ce_kernel[(N,)](logits, targets, losses, logits.stride(0), vocab_size, Vp,
                         BLOCK=cfg.block, WRITE_GRAD=write_grad, num_warps=cfg.warps)
    return losses


def _fused_pass_torch(logits, targets, vocab_size, write_grad):
    """The kernel's maths with torch ops, for devices without triton (fp32 temporaries)."""
    x = logits[:, :vocab_size].float()
    lse = torch.logsumexp(x, 1)
    losses = lse - x.gather(1, targets[:, None]).squeeze(1)
    if write_grad:
        p = torch.exp(x - lse[:, None])
        p[torch.arange(len(p), device=p.device), targets] -= 1.0
        logits[:, :vocab_size] = p
        logits[:, vocab_size:] = 0
    return losses


# ---- the kernel ----------------------------------------------------------------------------
# A plain function here; _load_triton() replaces it with triton.jit(fn) in this module's
# namespace, which is where it finds `tl`. One program per row of the contiguous-rowed LOGITS.

def _ce_kernel(LOGITS, TARGETS, LOSSES, stride, V, VP, BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    LOGITS += row * stride
    t = tl.load(TARGETS + row)
    # The target's logit, read before anything is overwritten; it also seeds the running max
    # (any element of the row is a valid start), which keeps -inf out of exp(m - m_new).
    x_t = tl.load(LOGITS + t).to(tl.float32)
    m = x_t
    s = x_t * 0.0  # Σ exp(x - m) over the chunks so far
    # Both passes load up to VP (a multiple of 128) and set the padding to -inf after the load:
    # a mask at V (50257: odd) would cost the 16-byte vector loads, since Triton vectorises a
    # masked load only where it knows the mask constant over the vector.
    for start in range(0, VP, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(LOGITS + cols, mask=cols < VP).to(tl.float32)
        x = tl.where(cols < V, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(LOSSES + row, lse - x_t)
    if WRITE_GRAD:
        # Each column is read and then written by the same thread, so in place is safe.
        for start in range(0, VP, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(LOGITS + cols, mask=cols < VP).to(tl.float32)
            p = tl.exp(tl.where(cols < V, x, float("-inf")) - lse)  # softmax; 0 in the padding
            p = tl.where(cols == t, p - 1.0, p)
            tl.store(LOGITS + cols, p.to(LOGITS.dtype.element_ty), mask=cols < VP)


def _load_triton() -> None:
    """Import triton (ImportError if absent) and jit the kernel, once per process. Whether it
    compiles for the GPU or runs in the interpreter is fixed here, by TRITON_INTERPRET."""
    global triton, tl, _ce_kernel
    if triton is not None:
        return
    import triton as _triton
    import triton.language as _tl
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        from braidtrain.model.attention_kernels import fix_interpreter_index
        fix_interpreter_index()
    tl = _tl
    _ce_kernel = _triton.jit(_ce_kernel)
    triton = _triton  # last: marks the kernel ready
