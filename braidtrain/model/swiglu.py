"""SwiGLU's pointwise part, h = silu(gate) * up, as one opaque operator: `braidtrain::swiglu`.

The MLP's packed projection writes gate_up (..., 2F): gate the first F columns, up the last F (each
tp rank its share of both, packed the same way: llama.py). The operator reads gate_up and writes
h (..., F); it saves gate_up, and its backward (`braidtrain::swiglu_backward`) reads gate_up and dh
and writes d(gate_up) (..., 2F) -- both halves, in one pass:

    s = sigmoid(g)      h = g s u      dg = dh u s (1 + g (1 - s))      du = dh g s

Each way is one Triton kernel on a GPU, computing in fp32 and storing in the input's dtype: one read
of each input and one write of each output, the memory floor of the pointwise part. Why not leave it
to torch.compile: inductor's backward of `F.silu(gate) * up` moves those bytes at about half the
forward's bandwidth (issue #58's profile; benchmarks/kernels/swiglu_gpu.py times both). A custom
op (torch.library.custom_op) is opaque to torch.compile, which calls it as it is inside a compiled
block (and a CUDA graph captures its launches); register_fake gives the traces its output's shape.

Elsewhere -- off CUDA, or without triton -- the same operator runs `reference` and
`reference_backward`, the same maths in torch (fp32 inside), which the tests also hold the kernels
to. With TRITON_INTERPRET=1 set before triton's first import, the kernels run on CPU tensors through
Triton's interpreter (the tests). Triton is imported on first use: this module imports without it.

Used by llama.py's MLP and moe.py's SwiGLUExperts (their grouped GEMM path) when their `fused_swiglu`
is set (Stage.use_fused_kernels; build.py sets it on CUDA, not under --exact, whose bits keep the
plain expression's kernels, nor under --fp8).
"""

from __future__ import annotations  # the kernels' annotations stay strings until triton is imported

import torch

from braidtrain.model import lazy_triton

triton = tl = None  # bound on first use (lazy_triton.Kernels, at the end of this file)
BLOCK = 1024  # columns a program at most (of one row's F): 8 a thread at 4 warps, 16-byte loads in bf16
WARPS = 4


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the packed gate_up (..., 2F): (..., F), in gate_up's dtype; differentiable."""
    return torch.ops.braidtrain.swiglu(gate_up)


# ---- the torch reference (and the path off CUDA) --------------------------------------------

def reference(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(gate_up.dtype)


def reference_backward(gate_up: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.float().chunk(2, dim=-1)
    d, s = dh.float(), torch.sigmoid(g)
    return torch.cat([d * u * s * (1 + g * (1 - s)), d * g * s], dim=-1).to(gate_up.dtype)


# ---- the operator ------------------------------------------------------------------------------

def _width(gate_up: torch.Tensor) -> int:
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu wants gate_up (..., 2F), gate and up packed; got shape {tuple(gate_up.shape)}")
    return gate_up.shape[-1] // 2


@torch.library.custom_op("braidtrain::swiglu", mutates_args=())
def _swiglu_op(gate_up: torch.Tensor) -> torch.Tensor:
    F2 = _width(gate_up)
    if not _kernels_run(gate_up):
        return reference(gate_up).contiguous()
    gu = gate_up.contiguous()
    h = torch.empty(*gu.shape[:-1], F2, dtype=gu.dtype, device=gu.device)
    _launch(_kernels.jitted[0], gu.shape[:-1].numel(), F2, gu, h)
    return h


@_swiglu_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], _width(gate_up))


@torch.library.custom_op("braidtrain::swiglu_backward", mutates_args=())
def _swiglu_backward_op(gate_up: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    F2 = _width(gate_up)
    if not _kernels_run(gate_up):
        return reference_backward(gate_up, dh).contiguous()
    gu, dh = gate_up.contiguous(), dh.contiguous()
    dgu = torch.empty(gu.shape, dtype=gu.dtype, device=gu.device)
    _launch(_kernels.jitted[1], gu.shape[:-1].numel(), F2, gu, dh, dgu)
    return dgu


@_swiglu_backward_op.register_fake
def _(gate_up, dh):
    return gate_up.new_empty(gate_up.shape)


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _grad(ctx, dh):
    return torch.ops.braidtrain.swiglu_backward(ctx.saved_tensors[0], dh)


_swiglu_op.register_autograd(_grad, setup_context=_save)


# ---- the kernels -------------------------------------------------------------------------------

def _kernels_run(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run for t (lazy_triton.Kernels.run_on)."""
    return _kernels.run_on(t)


def _launch(kernel, rows: int, F2: int, *tensors) -> None:
    """One program per (row, BLOCK columns of its F); nothing to do for no rows."""
    if rows == 0 or F2 == 0:
        return
    block = min(BLOCK, triton.next_power_of_2(F2))
    with lazy_triton.on(tensors[0].device):
        kernel[(rows * triton.cdiv(F2, block),)](*tensors, F2, BLOCK=block, num_warps=WARPS)


def _fwd(GU, H, F2, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nb = tl.cdiv(F2, BLOCK)
    row, col = pid // nb, (pid % nb) * BLOCK + tl.arange(0, BLOCK)
    mask = col < F2
    g = tl.load(GU + row * 2 * F2 + col, mask=mask).to(tl.float32)
    u = tl.load(GU + row * 2 * F2 + F2 + col, mask=mask).to(tl.float32)
    tl.store(H + row * F2 + col, (g * tl.sigmoid(g) * u).to(H.dtype.element_ty), mask=mask)


def _bwd(GU, DH, DGU, F2, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nb = tl.cdiv(F2, BLOCK)
    row, col = pid // nb, (pid % nb) * BLOCK + tl.arange(0, BLOCK)
    mask = col < F2
    g = tl.load(GU + row * 2 * F2 + col, mask=mask).to(tl.float32)
    u = tl.load(GU + row * 2 * F2 + F2 + col, mask=mask).to(tl.float32)
    d = tl.load(DH + row * F2 + col, mask=mask).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DGU + row * 2 * F2 + col, (d * u * s * (1 + g * (1 - s))).to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * 2 * F2 + F2 + col, (d * g * s).to(DGU.dtype.element_ty), mask=mask)


_kernels = lazy_triton.Kernels(__name__, _fwd, _bwd)
