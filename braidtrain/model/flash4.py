"""Causal attention by FlashAttention 4 (the `flash-attn-4` package's CuTe kernels), where installed.

What. `attention(q, k, v)` is `F.scaled_dot_product_attention(q, k, v, is_causal=True,
enable_gqa=...)` for q (B, H, T, D) and k, v (B, H_kv, T, D) in bf16 or fp16 -- the same maths, by
flash-attn-4's kernels for Hopper (compute capability 9.x) and Blackwell (10.x): its forward keeps
the log-sum-exp of each row (fp32), its backward reads it, as SDPA's flash and cuDNN kernels do. Grouped
keys and values (H_kv < H) go in as they are: the kernels share each key/value head among its
H/H_kv query heads, as torch's enable_gqa does.

Why. Issue #58's profile of Llama-3.2-1B's step: attention 13.3 ms of 139, cuDNN's kernels at ~290
TFLOP/s where the chip's matmuls run at ~770; flash-attn-4 is the fastest Hopper kernel the package
index offers (FlashAttention 3's successor, from the same authors), and torch has none faster.

How. Two operators of braidtrain's own, `braidtrain::flash4` (q, k, v) -> (o, lse) and
`braidtrain::flash4_backward` (q, k, v, o, lse, do) -> (dq, dk, dv), wrap the package's forward and
backward functions: a custom op is opaque to torch.compile, which calls it inside a compiled block as
it is (a CUDA graph captures its launches), and register_fake gives the traces its outputs' shapes.
The package's own autograd.Function would be traced into instead. The operators take (B, T, H, D)
-- the projections' layout, from which attend's (B, H, T, D) views come -- so no copy is made on the
way in or out.

Where used: attend (layers.py), for an attention module whose `kernel` is "flash4" (Stage.use_attention):
build.py sets it on a CUDA device where `available` says yes, in a bf16 run, for a head size that `fits`,
never under --exact (its bits are attention.py's deterministic kernels'; flash-attn-4's backward adds
dQ with atomics); under context parallelism parallel/context.py's attention runs instead (it merges
its own partial results), flash4 only where a cp rank sees whole sequences. It is optional: `pip install
flash-attn-4` (with nvidia-cutlass-dsl's CUDA libraries); without it SDPA runs, as before.
`benchmarks/kernels/flash4_gpu.py` compares the two on the GPU; tests/test_flash4.py checks the
operators' wiring on the CPU with SDPA standing in for the kernels, and the kernels against SDPA on
a GPU that has them.
"""

from __future__ import annotations

import torch

_kernels = None  # (forward, backward) of flash_attn.cute.interface, bound by available()
DTYPES = (torch.bfloat16, torch.float16)


def available(device) -> bool:
    """Can attention run here? A CUDA device of compute capability 9 or 10 (the package's Hopper and
    Blackwell kernels) where flash_attn.cute imports."""
    global _kernels
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return False
    if _kernels is None:
        try:
            from flash_attn.cute import interface
        except Exception:  # not installed, or its CUDA libraries do not load: SDPA runs
            return False
        _kernels = (interface._flash_attn_fwd, interface._flash_attn_bwd)
    return True


def fits(head_dim: int) -> bool:
    """A head size the kernels take on Hopper and Blackwell alike (the package's _validate_head_dims, q, k and
    v of one size in bf16 or fp16): a multiple of 8 up to 128, or 256. Others would fail its assertion."""
    return head_dim % 8 == 0 and (8 <= head_dim <= 128 or head_dim == 256)


def _loaded():
    if _kernels is None:
        raise RuntimeError("flash4: the package's kernels are not loaded: ask available(device) first (as build.settle "
                           "does), on a device where it says yes")
    return _kernels


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
    """softmax(q kᵀ/√D, causal) v: q (B, H, T, D), k and v (B, H_kv, T, D), H a multiple of H_kv, in
    bf16 or fp16; the output (B, H, T, D), a view of (B, T, H, D) memory (attend's callers transpose
    it back, for free). `deterministic`: the package's backward that adds dQ's tiles in a fixed order
    (repeatable bits; whether they are also the same for a sequence in any batch, as exact mode needs,
    benchmarks/kernels/flash4_gpu.py --exact asks on the GPU; exact mode does not use it)."""
    if q.dtype not in DTYPES:
        raise ValueError(f"flash4 attention takes bf16 or fp16, not {q.dtype}")
    o, _ = torch.ops.braidtrain.flash4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), deterministic)
    return o.transpose(1, 2)


# ---- the operators (tensors (B, T, H, D); lse (B, H, T), fp32) ---------------------------------

# Each operator allocates its outputs as its fake kernel does and has the package write into them:
# compiled code relies on the fake kernels' layouts (the package would otherwise choose its own).

def _forward_outputs(q, v):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, v.shape[-1]), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("braidtrain::flash4", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _forward_outputs(q, v)
    _loaded()[0](q, k, v, causal=True, return_lse=True, out=o, lse=lse)
    return o, lse


@_forward.register_fake
def _(q, k, v, deterministic):
    return _forward_outputs(q, v)


def _backward_outputs(q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("braidtrain::flash4_backward", mutates_args=())
def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
              do: torch.Tensor, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _backward_outputs(q, k, v)
    _loaded()[1](q, k, v, o, do.contiguous(), lse, causal=True, deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    return dq, dk, dv


@_backward.register_fake
def _(q, k, v, o, lse, do, deterministic):
    return _backward_outputs(q, k, v)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.deterministic = inputs[3]


def _grad(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return *torch.ops.braidtrain.flash4_backward(q, k, v, o, lse, do, ctx.deterministic), None


_forward.register_autograd(_grad, setup_context=_save)

