"""Exact mode's optimizer step in one pass on a GPU: the update (exact_adamw) and the gradient norm's
chunk sums (chunk_squares), each one Triton kernel a shard with the bits of its torch reference; and
the optimizer's whole GPU update in either mode (adamw), the same kernel with the decay and the bf16
weights folded in.

exact_adamw: optim.exact_adamw's IEEE operations, in its order, each rounded once -- the same bits
as exact_adamw (and so as the host's update under --offload optimizer) at about the cost of torch's
fused AdamW.

exact_adamw writes the update as about fifteen torch kernels a shard, each a pass over memory with
a temporary (the float64 square root's twice as wide): 58.55 ms over Llama-3.2-1B's 1.24 B
parameters on an H200, against fused AdamW's 11.61. Here each element is loaded once and its p, m, v
stored once, with the same operations -- 8.35 ms (docs/performance.md, "exact mode's update in one pass"):

    r = 1 / grad_scale             div.rn (torch.reciprocal: 1.0f / x, correctly rounded on CUDA)
    g = g * r
    m' = m * b1 + g * (1 - b1)      the scalars rounded to float32 on the host, as torch rounds a
    v' = v * b2 + (g * g) * (1 - b2)   Python scalar for a float32 tensor's operation
    p' = p - (m' * c1) / (sqrt(v') * c2 + eps)
    none of it stored where skip > 0

Why the bits are exact_adamw's: every product and sum is its own IEEE operation because the kernel
is compiled with `enable_fp_fusion=False` (no multiply-add contracted into one rounding: LLVM's
contraction and ptxas's --fmad are both off); the quotients are tl.div_rn (div.rn.f32: correctly
rounded; fp32 `/` in Triton is an approximate division); the square root is tl.sqrt_rn (sqrt.rn.f32,
correctly rounded), which equals exact_adamw's float64 square root rounded once to float32: double
rounding through a wider format is innocuous for sqrt when that format has at least 2p + 2 bits
(p = 24 for float32; float64 has 53 >= 50), so sqrt64 rounded to float32 is the correctly rounded
float32 sqrt. Neither div.rn nor sqrt.rn flushes subnormals (no .ftz: Triton 3.6 lowers the precise
forms to the NVVM intrinsics without it; tests/test_exact_kernels.py and the GPU check in
benchmarks/kernels/exact_adamw_gpu.py compare subnormal moments bit for bit). Addition being
commutative, the operand order of a sum moves no bit.

adamw: the optimizer's update on a GPU in either mode (optim.AdamW.one_pass), where torch's path is three launches
-- the decay (`_foreach_mul_` on the 2-D weights' ranges), fused AdamW, publish()'s bf16 `copy_` --
and each a pass over memory: the same kernel, over the same aligned blocks, with the decay p * keep
(rounded once, as `_foreach_mul_` rounds it) on the elements of the shard's decayed ranges (which a
block meets: decay_table, made once a shard; most blocks meet one or none) before the update, and
after it, where a lean bucket's compute weights are given, p rounded to bf16 into them -- to
nearest even in integer operations (torch's conversion: u + 0x7FFF + (u >> 16 & 1), the top half;
NaN 0x7FC0), not Triton's float conversion, which the interpreter truncates. So its bits are the
decay, exact_adamw and `copy_` in a row (tests/test_one_pass_adamw.py, interpreted; the GPU check
in benchmarks/kernels/adamw_gpu.py), and an element's do not depend on the ranges around it.

chunk_squares: parallel/norm.py's ExactNorm sums each Q-element chunk of a gradient shard's squares in
float64 by a pairwise tree, in torch four passes over memory with float64 temporaries (the fp32 ->
fp64 copy, the squares, the tree's levels: +16.5 ms a Llama-3.2-1B step against the default norm's
1.2). Here each element is read once and each chunk's sum written once, by the same tree: a float32
squared in float64 is exact (24-bit significands give a 48-bit product; fp32's range squared stays
inside fp64's, subnormals included), so only the additions round, and each is one IEEE float64
addition of the same two operands as the reference's -- node (l, i) = node (l-1, 2i) + node (l-1,
2i+1), written out level by level (tl.reshape to pairs, tl.split), never left to tl.sum's order. A
chunk's tree depends only on its Q elements, not on which program reads it or how many chunks a
program takes, so the sums keep ExactNorm's independence of the layout.

Used for CUDA shards only (optim.AdamW.apply, ExactNorm); the CPU, and the host under --offload, keep
the torch references (default mode's: torch's fused AdamW). Without triton this module imports and
`usable` says False. With TRITON_INTERPRET=1 set before triton's first import, they run on CPU
tensors (the tests).
"""

from __future__ import annotations  # the kernel's annotations stay strings until triton is imported

import torch

triton = tl = None  # bound by _load(), on first use: importing braidtrain does not import triton
_kernel = _squares = None
_missing = False  # triton failed to import: usable() stops asking
BLOCK = 1024  # elements a program: 8 a thread at 4 warps, two 16-byte loads of each tensor
CHUNKS = 64  # chunks a program of chunk_squares (4,096 elements at Q = 64): 1.21 ms over 1.24 B on an H200, 32: 1.51


def usable(t: torch.Tensor) -> bool:
    """Whether the kernel runs for t: t is on a GPU and triton imports."""
    global _missing
    if not t.is_cuda or _missing:
        return False
    try:
        _load()
    except ImportError:  # a CPU-only install: optim keeps exact_adamw (asked once, not every step)
        _missing = True
        return False
    return True


def _load() -> None:
    """Import triton (ImportError if absent) and jit the kernel, once. Whether it compiles for the
    GPU or runs in Triton's interpreter is fixed by TRITON_INTERPRET at triton's first import."""
    global triton, tl, _kernel, _squares
    if _kernel is not None:
        return
    import triton as _triton
    import triton.language as _tl

    tl = _tl
    _kernel = _triton.jit(_update)
    _squares = _triton.jit(_chunk_squares)
    triton = _triton


def _f32(x: float) -> float:
    """x rounded to float32 (to nearest), as torch rounds a Python scalar for a float32 operation."""
    return torch.tensor(x, dtype=torch.float32).item()


def exact_adamw(p, g, m, v, beta1, beta2, eps, c1, c2, grad_scale=None, skip=None) -> None:
    """optim.exact_adamw's update of p, m, v (float32, contiguous, one length) in one kernel; the
    same arguments, and the same bits."""
    n = p.numel()
    for t in (p, g, m, v):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n, "flat float32 shards"
    if n == 0:
        return
    _load()
    _kernel[(triton.cdiv(n, BLOCK),)](
        p, g, m, v, c1, c2, c1 if grad_scale is None else grad_scale, c1 if skip is None else skip, c1, c1, c1, c1, n,
        _f32(beta1), _f32(1 - beta1), _f32(beta2), _f32(1 - beta2), _f32(eps),
        HAS_SCALE=grad_scale is not None, HAS_SKIP=skip is not None, DECAY=False, HAS_OUT=False, BLOCK=BLOCK,
        num_warps=4, enable_fp_fusion=False)  # no multiply-add contraction: see the module docstring


def adamw(p, g, m, v, table, out, keep, c1, c2, beta1, beta2, eps, grad_scale=None, skip=None) -> None:
    """The whole update of one shard on a GPU (either mode), in one pass: p *= keep (1 - lr * wd) on the
    table's decayed ranges, exact_adamw's update, and where `out` is given (a lean bucket's bf16
    compute weights of the shard) the new p rounded to nearest even into it. table: decay_table's,
    on p's device; keep, c1, c2 (optim.AdamW.prepare's), grad_scale, skip: 0-dim device tensors."""
    n = p.numel()
    for t in (p, g, m, v):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n, "flat float32 shards"
    assert out is None or (out.dtype == torch.bfloat16 and out.is_contiguous() and out.numel() == n), "bf16, p's length"
    if n == 0:
        return
    _load()
    bounds, ranges = table
    _kernel[(triton.cdiv(n, BLOCK),)](
        p, g, m, v, c1, c2, c1 if grad_scale is None else grad_scale, c1 if skip is None else skip, keep, bounds,
        ranges, c1 if out is None else out.view(torch.int16), n, _f32(beta1), _f32(1 - beta1), _f32(beta2),
        _f32(1 - beta2), _f32(eps), HAS_SCALE=grad_scale is not None, HAS_SKIP=skip is not None, DECAY=True,
        HAS_OUT=out is not None, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)


def decay_table(decay, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """adamw's decayed ranges of a shard of n elements (decay: sorted, disjoint (start, end)): per
    BLOCK-element block k, the ranges j in [bounds[2k], bounds[2k + 1]) that it meets (int32); range
    j's start and end at ranges[2j], ranges[2j + 1] (int64; an empty (n, n) last, so that it is never
    empty). The blocks stay aligned, so their loads and stores keep 16-byte vectors."""
    ranges = torch.tensor([*decay, (n, n)], dtype=torch.int64).reshape(-1, 2)
    lo = torch.arange(0, n, BLOCK, dtype=torch.int64)  # each block's first element
    first = torch.searchsorted(ranges[:, 1].contiguous(), lo, right=True)  # the first range ending after lo
    last = torch.searchsorted(ranges[:, 0].contiguous(), lo + BLOCK)  # past the last one starting before lo + BLOCK
    bounds = torch.stack([first, torch.maximum(first, last)], 1).to(torch.int32)
    return bounds.reshape(-1).to(device), ranges.reshape(-1).to(device)


def chunk_squares(g: torch.Tensor, q: int) -> torch.Tensor:
    """ExactNorm's chunk sums of a flat float32 gradient shard (its length a multiple of q, a power
    of two): out[c] = the pairwise tree's float64 sum of g[c*q : (c+1)*q] squared -- the bits of
    `pairwise_sum(g.double().pow(2).view(-1, q).T)` (parallel/norm.py), in one pass."""
    n = g.numel()
    assert g.dtype == torch.float32 and g.is_contiguous() and n % q == 0 and q & (q - 1) == 0, "flat fp32, q | n"
    out = torch.empty(n // q, dtype=torch.float64, device=g.device)
    if n == 0:
        return out
    _load()
    _squares[(triton.cdiv(n // q, CHUNKS),)](g, out, n // q, Q=q, LEVELS=q.bit_length() - 1, CHUNKS=CHUNKS,
                                              num_warps=4, enable_fp_fusion=False)
    return out


def _chunk_squares(G, OUT, chunks, Q: tl.constexpr, LEVELS: tl.constexpr, CHUNKS: tl.constexpr):
    c = tl.program_id(0).to(tl.int64) * CHUNKS + tl.arange(0, CHUNKS)
    x = tl.load(G + c[:, None] * Q + tl.arange(0, Q)[None, :], mask=(c < chunks)[:, None], other=0.0)
    x = x.to(tl.float64)
    x = x * x  # exact: see the module docstring
    for level in tl.static_range(LEVELS):  # the tree: element j of a level = 2j + (2j + 1) of the one below
        left, right = tl.split(tl.reshape(x, (CHUNKS, Q >> (level + 1), 2)))
        x = left + right
    tl.store(OUT + c, tl.reshape(x, (CHUNKS,)), mask=c < chunks)


def _update(P, G, M, V, C1, C2, SCALE, SKIP, KEEP, BOUNDS, RANGES, OUT, n, b1, omb1, b2, omb2, eps,
            HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr, DECAY: tl.constexpr, HAS_OUT: tl.constexpr,
            BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_SKIP:  # a non-finite step changes nothing: nothing is stored
        mask = mask & ((tl.load(SKIP) > 0) == 0)  # where(skip > 0, old, new)
    g = tl.load(G + offs, mask=mask)
    m = tl.load(M + offs, mask=mask)
    v = tl.load(V + offs, mask=mask)
    p = tl.load(P + offs, mask=mask)
    if DECAY:  # p * (1 - lr * wd), rounded once (as _foreach_mul_), on the decayed ranges this block meets
        decayed = offs < 0
        j, end = tl.load(BOUNDS + 2 * tl.program_id(0)), tl.load(BOUNDS + 2 * tl.program_id(0) + 1)
        while j < end:  # (not range(): the interpreter's loaded scalars are no Python ints)
            decayed = decayed | ((offs >= tl.load(RANGES + 2 * j)) & (offs < tl.load(RANGES + 2 * j + 1)))
            j += 1
        p = tl.where(decayed, p * tl.load(KEEP), p)
    if HAS_SCALE:
        g = g * tl.div_rn(1.0, tl.load(SCALE))
    m = m * b1 + g * omb1
    v = v * b2 + (g * g) * omb2
    p = p - tl.div_rn(m * tl.load(C1), tl.sqrt_rn(v) * tl.load(C2) + eps)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    tl.store(P + offs, p, mask=mask)
    if HAS_OUT:  # the bf16 compute weights: p rounded to nearest even, in integers (as torch's conversion)
        u = p.to(tl.uint32, bitcast=True)
        b = tl.where(p != p, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)  # NaN: torch's CPU one (CUDA's may differ)
        tl.store(OUT + offs, b.to(tl.int16), mask=mask)
