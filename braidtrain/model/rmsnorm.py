"""RMSNorm, and the residual add before it, as opaque operators: `braidtrain::rmsnorm`, `braidtrain::add_rmsnorm`.

The norm is layers._RMSNorm's (Zhang and Sennrich 2019): over the last dim of x (..., C),

    r = 1/sqrt(mean(x^2) + eps)      y = w (x r)
    dx = r (g w - x^ mean(g w x^)),  x^ = x r        dw = sum over rows of g x^

and add_rmsnorm(x, r, w) is a Llama block's residual add and the norm after it in one pass:
h = x + r (in their promoted dtype, as `x + r` gives), y = rmsnorm(h); its backward takes (dh, dy)
and writes d(x) = d(r) = dh + the norm's dx, each in its input's dtype (two buffers, one pass).

Each way is one Triton kernel on a GPU, computing in fp32. The forward: one program a row (the whole
row in registers), one read of x (and r) and one write of y (and h). The backward: a program takes
ROWS rows, recomputes r from the row it reads anyway (the forward saves x -- or h -- and w, not r),
writes dx (and dr) and keeps its rows' sum of g x^ in fp32: one (programs, C) fp32 partial that a
torch sum turns into dw -- no atomics, the same bits every run. Rows wider than MAX_BLOCK take the
torch reference. Why not leave it to torch.compile: inductor's norm kernels took ~3.0 ms of the 1B
step (issue #58's profile) where the memory floor is ~1.2 ms (benchmarks/kernels/rmsnorm_gpu.py).

y's dtype is the caller's `dtype`: by default the promoted dtype of x and w (what `w * (x * r)`
gives, an fp32 residual stream's norm fp32); `matmul_dtype` gives autocast's where autocast is on,
for a norm whose output only feeds autocast's matmuls (a Llama block at tp 1): the kernel then
writes y once in bf16, rounded from fp32 as autocast's cast would round it, and reads the matmul's
bf16 gradient as the cast's backward would widen it -- no cast kernel either way.

Elsewhere -- off CUDA, or without triton -- the same operators run the torch reference (`reference`,
`reference_backward`, `add_reference`, `add_reference_backward`, fp32 inside), which the tests also
hold the kernels to. With TRITON_INTERPRET=1 set before triton's first import, the kernels run on CPU
tensors through Triton's interpreter (the tests). Triton is imported on first use.

Used by llama.py's Block (input_layernorm; the attention's residual add with post_attention_layernorm)
and Llama.final_norm when their `fused_norm` is set (Stage.use_fused_kernels: build.py sets it on
CUDA, not under --exact, whose bits keep layers.RMSNorm's kernels, nor under --fp8). The RMSNorm
modules and their weights stay; only the forward's computation changes.
"""

from __future__ import annotations  # the kernels' annotations stay strings until triton is imported

import torch

from braidtrain.model import lazy_triton

triton = tl = None  # bound on first use (lazy_triton.Kernels, at the end of this file)
MAX_BLOCK = 32768  # the widest row a program holds (in registers); wider rows take the torch reference
PROGRAMS = 1024  # the backward's programs at most (each ROWS = cdiv(N, PROGRAMS) rows): dw's partial sums


def matmul_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of the norm's output computes in: autocast's where it is on for x's device,
    else what `w * (x * r)` gives (x's and w's promoted)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, w.dtype)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """w * (x * rsqrt(mean(x^2) + eps)) over x's last dim, in `dtype` (default: x's and w's promoted)."""
    return torch.ops.braidtrain.rmsnorm(x, w, eps, dtype or torch.promote_types(x.dtype, w.dtype))


def add_rmsnorm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x + r, y = rmsnorm(h, w, eps) in `dtype` (default: h's and w's promoted)."""
    h_dtype = torch.promote_types(x.dtype, r.dtype)
    return torch.ops.braidtrain.add_rmsnorm(x, r, w, eps, dtype or torch.promote_types(h_dtype, w.dtype))


# ---- the torch reference (and the path off CUDA) --------------------------------------------

def reference(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(dtype)


def reference_backward(x, w, dy, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in w's)"""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat, gw = xf * rstd, dy.float() * w.float()
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).reshape(x.shape[:-1].numel(), x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)


def add_reference(x, r, w, eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + r
    return h, reference(h, w, eps, dtype)


def add_reference_backward(h, w, dy, dh, eps: float, x_dtype: torch.dtype,
                           r_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in x_dtype, dr in r_dtype, dw in w's): dx = dr = dh + the norm's dx of h."""
    dn, dw = reference_backward(h.float(), w, dy, eps)
    d = dh.float() + dn
    return d.to(x_dtype), d.to(r_dtype, copy=True), dw  # (two tensors: an operator's outputs may not alias)


# ---- the operators -----------------------------------------------------------------------------

def _width(x: torch.Tensor, w: torch.Tensor) -> int:
    if x.dim() == 0 or w.shape != x.shape[-1:]:
        raise ValueError(f"rmsnorm wants x (..., C) and w (C,); got {tuple(x.shape)} and {tuple(w.shape)}")
    return x.shape[-1]


@torch.library.custom_op("braidtrain::rmsnorm", mutates_args=())
def _rmsnorm_op(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    C = _width(x, w)
    if not _kernels_run(x, C):
        return reference(x, w, eps, dtype).contiguous()
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    _forward(x, x, x, w, y, eps, add=False)
    return y


@_rmsnorm_op.register_fake
def _(x, w, eps, dtype):
    _width(x, w)
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op("braidtrain::rmsnorm_backward", mutates_args=())
def _rmsnorm_backward_op(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    C = _width(x, w)
    if not _kernels_run(x, C):
        dx, dw = reference_backward(x, w, dy, eps)
        return dx.contiguous(), dw
    x, w, dy = x.contiguous(), w.contiguous(), dy.contiguous()
    dx = torch.empty_like(x)
    return dx, _backward(x, w, dy, x, dx, dx, eps, add=False)


@_rmsnorm_backward_op.register_fake
def _(x, w, dy, eps):
    return x.new_empty(x.shape), w.new_empty(w.shape)


@torch.library.custom_op("braidtrain::add_rmsnorm", mutates_args=())
def _add_rmsnorm_op(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    C = _width(x, w)
    if x.shape != r.shape:
        raise ValueError(f"add_rmsnorm wants x and r of one shape; got {tuple(x.shape)} and {tuple(r.shape)}")
    if not _kernels_run(x, C):
        h, y = add_reference(x, r, w, eps, dtype)
        return h.contiguous(), y.contiguous()
    x, r, w = x.contiguous(), r.contiguous(), w.contiguous()
    h = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, r.dtype), device=x.device)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    _forward(x, r, h, w, y, eps, add=True)
    return h, y


@_add_rmsnorm_op.register_fake
def _(x, r, w, eps, dtype):
    _width(x, w)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, r.dtype)), x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op("braidtrain::add_rmsnorm_backward", mutates_args=())
def _add_rmsnorm_backward_op(h: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, dh: torch.Tensor, eps: float,
                             x_dtype: torch.dtype, r_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    C = _width(h, w)
    if not _kernels_run(h, C):
        dx, dr, dw = add_reference_backward(h, w, dy, dh, eps, x_dtype, r_dtype)
        return dx.contiguous(), dr.contiguous(), dw
    h, w, dy, dh = h.contiguous(), w.contiguous(), dy.contiguous(), dh.contiguous()
    dx = torch.empty(h.shape, dtype=x_dtype, device=h.device)
    dr = torch.empty(h.shape, dtype=r_dtype, device=h.device)  # its own buffer, even of dx's dtype
    return dx, dr, _backward(h, w, dy, dh, dx, dr, eps, add=True)


@_add_rmsnorm_backward_op.register_fake
def _(h, w, dy, dh, eps, x_dtype, r_dtype):
    return h.new_empty(h.shape, dtype=x_dtype), h.new_empty(h.shape, dtype=r_dtype), w.new_empty(w.shape)


def _save(ctx, inputs, output):
    x, w, eps, _ = inputs
    ctx.save_for_backward(x, w)
    ctx.eps = eps


def _grad(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = torch.ops.braidtrain.rmsnorm_backward(x, w, dy, ctx.eps)
    return dx, dw, None, None


def _add_save(ctx, inputs, output):
    x, r, w, eps, _ = inputs
    ctx.save_for_backward(output[0], w)  # h: what the backward reads (x and r need not stay)
    ctx.eps, ctx.dtypes = eps, (x.dtype, r.dtype)


def _add_grad(ctx, dh, dy):
    h, w = ctx.saved_tensors
    dh = torch.zeros_like(h) if dh is None else dh
    dy = torch.zeros_like(h) if dy is None else dy
    dx, dr, dw = torch.ops.braidtrain.add_rmsnorm_backward(h, w, dy, dh, ctx.eps, *ctx.dtypes)
    return dx, dr, dw, None, None


_rmsnorm_op.register_autograd(_grad, setup_context=_save)
_add_rmsnorm_op.register_autograd(_add_grad, setup_context=_add_save)


# ---- the kernels -------------------------------------------------------------------------------

def _kernels_run(t: torch.Tensor, C: int) -> bool:
    """Whether the Triton kernels run for t: rows of at most MAX_BLOCK, and lazy_triton.Kernels.run_on."""
    return C <= MAX_BLOCK and _kernels.run_on(t)


def _warps(block: int) -> int:
    return min(16, max(4, block // 512))  # 4 up to 2048 columns, 8 at 4096, 16 from 8192


def _forward(x, r, h, w, y, eps: float, add: bool) -> None:
    """One program a row; nothing to do for no rows or no columns."""
    C = x.shape[-1]
    N = x.numel() // C if C else 0
    if N == 0 or C == 0:
        return
    block = triton.next_power_of_2(C)
    with lazy_triton.on(x.device):
        _kernels.jitted[0][(N,)](x, r, h, w, y, C, eps, BLOCK=block, ADD=add, num_warps=_warps(block))


def _backward(x, w, dy, dh, dx, dr, eps: float, add: bool) -> torch.Tensor:
    """dx (and dr) written; returns dw, in w's dtype, from the programs' fp32 partial sums."""
    C = x.shape[-1]
    N = x.numel() // C if C else 0
    if N == 0 or C == 0:
        return torch.zeros_like(w)
    rows = triton.cdiv(N, PROGRAMS)
    programs = triton.cdiv(N, rows)
    block = triton.next_power_of_2(C)
    partial = torch.empty(programs, C, dtype=torch.float32, device=x.device)
    with lazy_triton.on(x.device):
        _kernels.jitted[1][(programs,)](x, w, dy, dh, dx, dr, partial, N, C, eps, ROWS=rows, BLOCK=block,
                                       ADD=add, num_warps=_warps(block))
    return partial.sum(0).to(w.dtype)


def _fwd(X, R, H, W, Y, C, eps, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < C
    x = tl.load(X + row * C + col, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # h = x + r, rounded to h's dtype as torch's add rounds it; the norm reads h as stored
        h = (x + tl.load(R + row * C + col, mask=mask, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row * C + col, h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)
    w = tl.load(W + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * C + col, (w * (x * rstd)).to(Y.dtype.element_ty), mask=mask)


def _bwd(X, W, DY, DH, DX, DR, DWP, N, C, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < C
    w = tl.load(W + col, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, ROWS):
        row = pid * ROWS + i
        m = mask & (row < N)
        x = tl.load(X + row * C + col, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * C + col, mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)
        xhat, gw = x * rstd, dy * w
        dx = rstd * (gw - xhat * (tl.sum(gw * xhat, axis=0) / C))
        if ADD:  # d(x) = d(r) = dh + the norm's dx, each in its own dtype
            dx += tl.load(DH + row * C + col, mask=m, other=0.0).to(tl.float32)
            tl.store(DR + row * C + col, dx.to(DR.dtype.element_ty), mask=m)
        tl.store(DX + row * C + col, dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * xhat
    tl.store(DWP + pid * C + col, dw, mask=mask)


_kernels = lazy_triton.Kernels(__name__, _fwd, _bwd)
