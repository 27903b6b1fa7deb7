"""Float8 matrix products for the blocks' linear layers (`--fp8 tensorwise|rowwise`).

A linear layer's three products, each in float8 with dynamic scales (the amax of the tensor at
hand, this micro-batch's), through torch._scaled_mm; its output, the input's gradient and the
weight's gradient come out in high precision (the autocast dtype, the input's dtype, fp32):

    forward    y  = x W^T     x e4m3, W e4m3               (M, K) x (K, N)   M tokens, K in, N out
    backward   dX = dY W      dY e5m2 (rowwise: e4m3), W    (M, N) x (N, K)
               dW = dY^T X    dY as above, X e4m3           (N, M) x (M, K)

e4m3 (max 448, 3 mantissa bits) for values, e5m2 (max 57344, 2 bits) for gradients, whose range
is wider (Micikevicius et al. 2022, "FP8 formats for deep learning", arXiv:2209.05433). The
recipes are torchao.float8's (the yardstick, not a dependency):

    tensorwise  one scale for each tensor. The backward reuses the forward's float8 x and W: a
                transpose does not change a tensor's one scale.
    rowwise     one scale per row of the first operand and per column of the second -- along the
                dim each product does not sum over, so a scale factors out of the sum. Each
                product sums over another dim (forward K, dX N, dW M), so x and W are cast twice
                in the forward (along K for y, along M or N for the backward) and the backward
                casts dY twice. dY is e4m3 as in torchao's rowwise recipe: the CUTLASS rowwise
                kernel torch uses where cuBLAS has none takes e4m3 only, and outputs bf16 only.

Scales are powers of two: s = 2^floor(log2(max / amax)), so amax * s <= max. Multiplying by
one is exact, so the cast is the only rounding (the reference a test builds is then exact too),
and dividing back in the matmul is exact. It gives away less than one binade at the top of the
float8 range (torchao does the same for rowwise). Casts saturate: a value beyond the format's
largest finite one becomes it (a rounding past the top; a cast alone gives inf or NaN). An amax
of 0 (an all-zero tensor or row) takes the scale of a tiny amax and casts to zeros; a non-finite
amax gives a scale of 0 or NaN, so a non-finite input gives non-finite outputs (and the step is
skipped, as ever), never finite garbage.

What autograd keeps for the backward is float8 only -- x and W once each, 1 byte an element
(rowwise: the copies scaled for the backward; the forward's are transient) -- never the fp32
weight, so ZeRO-3 releases a gathered block after its forward, as it does under bf16 autocast
(parallel/zero.py sees what is saved).

Where torch._scaled_mm does not run -- on CUDA, dims it rejects (K and N multiples of 16; the
M of dW too) -- and always on the CPU, `emulated_mm` does the same product from the same float8
tensors in fp32: each element decoded exactly (a float8 value is exact in fp32), divided by its
power-of-two scale (exact), then an fp32 matmul. On the CPU that is what torch._scaled_mm itself
does where the CPU lacks AMX (torch 2.13: decode, scale, fp32 matmul), and the bits are the same
(tests/test_fp8.py); where it has AMX, torch hands float8 to oneDNN instead, whose sums and speed
we have not measured -- braidtrain never calls it. What the CPU pays over fp32 is the casts and
the decoding (torch's float8-to-fp32 conversion is not vectorised there): a step of the tiny
model costs about twice fp32's.

The model package owns this file, not parallel/: the layers call it (layers.py, which the model
families build from), and model code imports nothing of parallel/ or the layout. It knows no
mesh: under tp each rank scales its own shard (so exact mode's bits hold at a fixed tp, as ever).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TINY_AMAX = 1e-12  # an amax below this (0: all zeros) scales as this one does
KERNEL_ALIGN = 16  # torch._scaled_mm on CUDA: K and N multiples of this


@dataclass(frozen=True)
class Recipe:
    name: str
    rowwise: bool  # scales per row/column (else one per tensor)
    grad: torch.dtype  # dY's float8 type


RECIPES = {"tensorwise": Recipe("tensorwise", False, E5M2), "rowwise": Recipe("rowwise", True, E4M3)}


# -- scaling and casting -------------------------------------------------------------------------

def scale_of(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """The fp32 power of two s with amax(|x|) * s <= the float8 type's max: one for the tensor
    (dim None, a 0-d tensor) or one per slice along `dim`'s complement (amax over `dim`, kept:
    dim -1 of (M, K) gives (M, 1), one per row; dim 0 gives (1, K), one per column)."""
    a = x.abs()
    amax = (a.amax() if dim is None else a.amax(dim, keepdim=True)).float().clamp(min=TINY_AMAX)
    return torch.exp2(torch.floor(torch.log2(torch.finfo(dtype).max / amax)))


def to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in the float8 type, saturated at its largest finite value (NaN stays NaN)."""
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-top, top).to(dtype)


def cast(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float8, its scale): x ~ result / scale."""
    s = scale_of(x, dtype, dim)
    return to_float8(x, s, dtype), s


# -- the product ---------------------------------------------------------------------------------

def available(device_type: str) -> bool:
    """Does --fp8 run here? CUDA: torch._scaled_mm, on compute capability 8.9 or later (float8
    tensor cores: Ada, Hopper, Blackwell). CPU: always (emulated_mm)."""
    if device_type == "cuda":
        return (hasattr(torch, "_scaled_mm") and torch.cuda.is_available()
                and torch.cuda.get_device_capability() >= (8, 9))
    return device_type == "cpu"


def _kernel_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Does torch._scaled_mm take these operands? CUDA's, at dims it accepts. (Shapes are static:
    no sync, and torch.compile sees one branch.) Never the CPU's: emulated_mm gives its bits
    without its cost (the module docstring)."""
    return a.device.type == "cuda" and a.shape[1] % KERNEL_ALIGN == 0 and b.shape[1] % KERNEL_ALIGN == 0


def scaled_mm(a, sa, b, sb, out_dtype: torch.dtype, fast: bool = False) -> torch.Tensor:
    """(a / sa) @ (b / sb) in out_dtype. a (M, K) float8, row-major; b (K, N) float8,
    column-major (torch._scaled_mm's layout: b.t() contiguous); sa () or (M, 1), sb () or (1, N):
    their scales. fast: the kernel's fast accumulation (the forward's, as torchao does; the
    gradients' products accumulate precisely)."""
    if not _kernel_runs(a, b):
        return emulated_mm(a, sa, b, sb, out_dtype)
    rowwise = sa.dim() > 0
    # CUDA's rowwise kernel outside cuBLAS (compute capability 8.9, or cuBLAS < 12.9) makes bf16 only
    kernel_dtype = torch.bfloat16 if rowwise and a.is_cuda else out_dtype
    out = torch._scaled_mm(a, b, scale_a=sa.reciprocal().contiguous(), scale_b=sb.reciprocal().contiguous(),
                           out_dtype=kernel_dtype, use_fast_accum=fast and a.is_cuda)
    return out.to(out_dtype)


def emulated_mm(a, sa, b, sb, out_dtype: torch.dtype) -> torch.Tensor:
    """scaled_mm's product without the kernel: each float8 element decoded exactly into fp32 and
    divided by its power-of-two scale (exact), then an fp32 matmul (never autocast's bf16)."""
    with torch.autocast(a.device.type, enabled=False):
        return ((a.float() / sa) @ (b.float() / sb)).to(out_dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """t (R, C) with the same values, laid out column by column (the second operand's layout)."""
    return t.t().contiguous().t()


def _needed(ctx, i: int) -> bool:
    """Will autograd use the gradient of input i? Both, in a plain backward; zero bubble's split
    backward (parallel/zb.py) asks first for the input's alone (B), later for the weight's (W),
    so each product is computed once. (Compiled code asks what its graph was traced for.)"""
    if not ctx.needs_input_grad[i]:
        return False
    if torch.compiler.is_compiling():
        return True
    node = ctx.next_functions[i][0]
    try:
        return node is not None and torch._C._will_engine_execute_node(node)
    except RuntimeError:  # (a leaf's node under autograd.grad: torch cannot say)
        return True


class Float8Linear(torch.autograd.Function):
    """y = x W^T with its forward and both backward products in float8 (the module docstring).
    x (..., K) of any float dtype, W (N, K) the fp32 parameter; y (..., N) in out_dtype."""

    @staticmethod
    def forward(ctx, x, w, recipe: Recipe, out_dtype: torch.dtype, backward: bool):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K), row-major (the kernel's first operand)
        if recipe.rowwise:
            x8, sx = cast(x2, E4M3, -1)  # a scale per token, (M, 1)
            w8, sw = cast(w, E4M3, -1)  # per output feature, (N, 1)
            y = scaled_mm(x8, sx, w8.t(), sw.t(), out_dtype, fast=True)
            # for the backward (if one can come), scaled along the dims dW and dX sum over: per input
            # feature -- X (M, K) over tokens, W (N, K) over outputs: (1, K) each
            saved = (*cast(x2, E4M3, 0), *cast(w, E4M3, 0)) if backward else ()
        else:
            x8, sx = cast(x2, E4M3)
            w8, sw = cast(w, E4M3)
            y = scaled_mm(x8, sx, w8.t(), sw, out_dtype, fast=True)
            saved = (x8, sx, w8, sw)
        ctx.save_for_backward(*saved)
        ctx.recipe, ctx.x_dtype = recipe, x.dtype
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x8, sx, w8, sw = ctx.saved_tensors
        r = ctx.recipe
        g = gy.reshape(-1, gy.shape[-1]).contiguous()  # (M, N)
        dx = dw = None
        if _needed(ctx, 0):  # dX = dY W: dY per token (rowwise), W per input feature
            g8, sg = cast(g, r.grad, -1 if r.rowwise else None)
            dx = scaled_mm(g8, sg, _column_major(w8), sw, ctx.x_dtype).view(*gy.shape[:-1], w8.shape[1])
        if _needed(ctx, 1):  # dW = dY^T X: dY^T per output feature (rowwise), X per input feature
            if r.rowwise or dx is None:
                g8, sg = cast(g, r.grad, 0 if r.rowwise else None)  # rowwise: (1, N)
            dw = scaled_mm(g8.t().contiguous(), sg.t(), _column_major(x8), sx, torch.float32)
        return dx, dw, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe) -> torch.Tensor:
    """F.linear(x, weight, bias) through Float8Linear: the output in the dtype F.linear would give
    (autocast's, else x's), the bias added in it. (The weight goes in as a view: a node of its
    own, whose execution the backward can ask about, _needed.) Where no backward can come
    (validation and sampling, under no_grad), rowwise skips the copies cast for one."""
    kind = x.device.type
    dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    y = Float8Linear.apply(x, weight.view_as(weight), recipe, dt, backward)
    return y if bias is None else y + bias.to(dt)
