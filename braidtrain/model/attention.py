"""Deterministic causal attention: FlashAttention-2 in Triton, with an atomic-free backward.

What. `causal_attention(q, k, v)` is softmax(q kᵀ/√D + causal mask) v for q, k, v of shape
(B, H, T, D) (bf16, fp16 or fp32; D in {16, 32, 64, 128}; any T ≥ 1), differentiable, with
every sum accumulated in fp32 — the same maths as
`F.scaled_dot_product_attention(q, k, v, is_causal=True)`.

Why. torch's flash, memory-efficient and cuDNN attention backward passes add partial dQ
(or dK, dV) tiles into global memory with atomics from many thread blocks at once, so the
order of the additions, and their rounding, changes from run to run: two identical backward
passes can differ in the last bits (benchmarks/kernels/attention_gpu.py shows whether they do). Exact
mode needs the same bits every run, and
the same bits for a sequence whatever batch it is computed in. Here each output element is
written by exactly one program, each program adds its terms in a fixed order, and the
block sizes depend only on (D, dtype), never on B or T — so (batch, head) pairs are
independent and the bits depend only on that pair's own q, k, v (and T).

Algorithm (Dao, "FlashAttention-2", arXiv:2307.08691; the split backward is the one in
Triton's fused-attention tutorial). Four kernels, each one program per (batch·head, block):

    forward  per query block: stream key blocks 0 … diagonal, online softmax (exp2, scores
             pre-scaled by log2 e / √D); write O and L = log2-sum-exp2 of the row (fp32)
    delta    per query block: Δ_i = Σ_d dO_id · O_id (fp32)
    dK, dV   per key block: stream query blocks diagonal … end, recompute Pᵀ = exp2(S - L),
             dV += Pᵀ dO,  dSᵀ = Pᵀ ∘ (V dOᵀ - Δ),  dK += dSᵀ Q
    dQ       per query block: stream key blocks diagonal, then 0 … diagonal - 1,
             dQ += dS K  (dS recomputed the same way)

Blocks strictly below the diagonal run without the mask; the diagonal blocks are masked,
and a ragged last block is zero-padded on load (a padded row has dO = 0, so it adds
nothing) and masked on store.

Cost vs. flash. FA2's backward does 5 block matmuls per (query block, key block) and adds
dQ with atomics; computing dQ in its own pass recomputes S and dP, so 7 — the backward does
1.4× the matmul FLOPs (fwd+bwd 9/7 ≈ 1.29×), on top of Triton vs. hand-written CUDA.
`benchmarks/kernels/attention_gpu.py` measures it. Memory is flash's: O(B·H·T) for L and Δ.

The kernels are in attention_kernels.py. The public entry points never import triton; it is
imported on first use, so this module imports on machines without it (see `available`). Set
TRITON_INTERPRET=1 before the first use to run the kernels on CPU tensors through Triton's
interpreter (slow; for tests).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from braidtrain.model import attention_kernels as kernels, lazy_triton

_LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128)


def available(device, load=None) -> bool:
    """True when Triton kernels can run on `device`: triton imports and the device is CUDA, or
    TRITON_INTERPRET=1 (the CPU interpreter, for tests). `load` jits a module's kernels
    (attention_kernels.py's by default; loss.py passes its own)."""
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    try:
        (load or kernels.load)()
    except ImportError:
        return False
    return True


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q kᵀ/√D) v, bitwise deterministic forward and backward.

    q, k, v: (B, H, T, D), one dtype (bf16/fp16/fp32), one device, D in {16, 32, 64, 128}.
    Any strides with a unit last stride are read in place (the (B, T, H, D) → (B, H, T, D)
    transpose in gpt.py costs no copy); others (and dO with, e.g., zero strides from
    `o.sum().backward()`) are made contiguous first. The output (and
    each gradient) is laid out like its input: (B, T, H, D) storage when the input's head
    stride is below its time stride, so `y.transpose(1, 2).reshape(B, T, C)` is free.
    A torch operator (braidtrain::causal_attention, `register`) defined by torch.library.triton_op:
    torch.compile sees its kernels (wrap_triton) and launches them from its own code, as it does
    its generated kernels -- not through the operator's Python and Triton's launcher, whose host
    time a call added up over an exact step (docs/performance-history.md).
    """
    _check(q, k, v)
    register()
    return torch.ops.braidtrain.causal_attention(q, k, v, list(_config(q.shape[-1], q.dtype)))[0]


class _Config(NamedTuple):
    fwd_m: int       # forward, delta: query rows per program
    fwd_n: int       # forward: key rows per step          (fwd_m % fwd_n == 0)
    kv_m: int        # dK,dV: query rows per step          (kv_n % kv_m == 0)
    kv_n: int        # dK,dV: key rows per program
    q_m: int         # dQ: query rows per program          (q_m % q_n == 0)
    q_n: int         # dQ: key rows per step
    fwd_warps: int
    bwd_warps: int
    stages: int


def _config(D: int, dtype: torch.dtype) -> _Config:
    """Fixed block sizes by (D, dtype) only — never by B, H or T, which the bits must not
    depend on. 16-bit: the tiles of Triton's fused-attention tutorial for H100 (forward
    128 x 64, 128 x 32 for D = 128; backward 32 x 128 and 128 x 32); 8 warps in the backward
    keep its fp32 accumulators in registers (with 4, ptxas for sm_90a reports dK,dV spilling
    at D = 64). fp32 (true fp32 products, no tensor cores) takes 32 x 32 tiles, which fit
    without spills at D <= 64."""
    if dtype == torch.float32:
        w = 4 if D <= 32 else 8
        return _Config(32, 32, 32, 32, 32, 32, fwd_warps=w, bwd_warps=w, stages=2)
    if D <= 64:
        return _Config(128, 64, 32, 128, 128, 32, fwd_warps=4, bwd_warps=8, stages=3)
    return _Config(128, 32, 32, 128, 128, 32, fwd_warps=8, bwd_warps=8, stages=3)


def _check(q, k, v) -> None:
    if not (q.dim() == 4 and q.shape == k.shape == v.shape):
        raise ValueError(f"causal_attention wants q, k, v of one shape (B, H, T, D); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"causal_attention wants q, k, v of one dtype in bf16/fp16/fp32; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v on different devices: {q.device}, {k.device}, {v.device}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"causal_attention supports head dims {HEAD_DIMS}; got D={q.shape[-1]}")
    if q.shape[2] == 0:
        raise ValueError("causal_attention needs T >= 1")


# ---- autograd ------------------------------------------------------------------------------

def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself if the kernels can read it in place: unit last stride, and the offsets within
    one (batch, head), which the kernels compute in int32, below 2^31."""
    return x if x.stride(-1) == 1 and x.stride(2) * x.shape[2] < 2**31 else x.contiguous()


def _empty_like_layout(x: torch.Tensor) -> torch.Tensor:
    """An empty (B, H, T, D) tensor stored as (B, T, H, D) when x is, else contiguous."""
    B, H, T, D = x.shape
    if x.stride(1) < x.stride(2):
        return torch.empty(B, T, H, D, dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty(B, H, T, D, dtype=x.dtype, device=x.device)


def _s(x):  # the (batch, head, time) strides; the last one is 1
    return x.stride(0), x.stride(1), x.stride(2)


def _launch(kernel, grid, *args, **kwargs):
    """Run a kernel of attention_kernels.py: through wrap_triton on CUDA, so that torch.compile (and a fake
    tensor's trace) sees the launch; under the CPU interpreter, which wrap_triton cannot trace,
    directly -- and not at all on a trace's tensors (fake, functional: opcheck's), which need only
    the outputs' shapes and strides, made by the code around the launches."""
    if args[0].device.type == "cuda":
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    elif type(args[0]) is torch.Tensor:
        kernel[grid](*args, **kwargs)


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  config: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: O = softmax(Q Kᵀ/√D, causal) V, and L (row log2-sum-exp2, fp32), saved for backward."""
    if not available(q.device):
        raise RuntimeError(f"causal_attention needs triton and a CUDA device (or TRITON_INTERPRET=1); got {q.device}")
    cfg = _Config(*config)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, H, T, D = q.shape
    o = _empty_like_layout(q)
    lse = torch.empty(B * H, T, dtype=torch.float32, device=q.device)
    sm_scale = 1.0 / math.sqrt(D)
    assert cfg.fwd_m % cfg.fwd_n == 0 and cfg.kv_n % cfg.kv_m == 0 and cfg.q_m % cfg.q_n == 0, cfg
    with lazy_triton.on(q.device):
        grid = (kernels.triton.cdiv(T, cfg.fwd_m) * B * H,)
        _launch(kernels._fwd_kernel, grid, q, k, v, o, lse, *_s(q), *_s(k), *_s(v), *_s(o), H, T, sm_scale * _LOG2E,
                D=D, BM=cfg.fwd_m, BN=cfg.fwd_n, PREC=_prec(q.dtype), num_warps=cfg.fwd_warps, num_stages=cfg.stages)
    return o, lse


def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                           do: torch.Tensor, config: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: Δ = rowsum(dO ∘ O); dK, dV per key block; dQ per query block — no atomics."""
    cfg = _Config(*config)
    q, k, v, o, do = (_unit_last(x) for x in (q, k, v, o, do))
    B, H, T, D = q.shape
    sm_scale = 1.0 / math.sqrt(D)
    dq, dk, dv = _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(v)
    delta = torch.empty(B * H, T, dtype=torch.float32, device=q.device)
    common = dict(D=D, num_warps=cfg.bwd_warps, num_stages=cfg.stages)
    with lazy_triton.on(q.device):
        _launch(kernels._delta_kernel, (kernels.triton.cdiv(T, cfg.fwd_m) * B * H,),
                o, do, delta, *_s(o), *_s(do), H, T, BM=cfg.fwd_m, **common)
        _launch(kernels._dkdv_kernel, (kernels.triton.cdiv(T, cfg.kv_n) * B * H,),
                q, k, v, do, lse, delta, dk, dv, *_s(q), *_s(k), *_s(v), *_s(do), *_s(dk), *_s(dv),
                H, T, sm_scale * _LOG2E, sm_scale, BM=cfg.kv_m, BN=cfg.kv_n, PREC=_prec(q.dtype), **common)
        _launch(kernels._dq_kernel, (kernels.triton.cdiv(T, cfg.q_m) * B * H,),
                q, k, v, do, lse, delta, dq, *_s(q), *_s(k), *_s(v), *_s(do), *_s(dq),
                H, T, sm_scale * _LOG2E, sm_scale, BM=cfg.q_m, BN=cfg.q_n, PREC=_prec(q.dtype), **common)
    return dq, dk, dv


def _save(ctx, inputs, output):
    q, k, v, config = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.config = config


def _grad(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return (*torch.ops.braidtrain.causal_attention_backward(q, k, v, o, lse, do, ctx.config), None)


_registered = False


def register() -> None:
    """Define the operators (braidtrain::causal_attention, its backward), once, on first use: a
    triton_op imports torch's inductor and dynamo (~1.4 s), which most processes that import
    braidtrain -- every rank of a run outside exact mode on a GPU -- never need."""
    global _registered
    if not _registered:
        fwd = torch.library.triton_op("braidtrain::causal_attention", _attention_op, mutates_args=())
        torch.library.triton_op("braidtrain::causal_attention_backward", _attention_backward_op, mutates_args=())
        fwd.register_autograd(_grad, setup_context=_save)
        _registered = True


def _prec(dtype) -> str:
    # fp32 inputs get true fp32 products (torch's default for fp32 matmul), not TF32.
    return "ieee" if dtype == torch.float32 else "tf32"
