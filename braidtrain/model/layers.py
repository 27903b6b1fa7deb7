"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053) and sequence parallelism
(Korthikanti et al. 2022, arXiv:2205.05198): the collectives autograd must see, the parallel linear
and embedding layers, the vocab-parallel cross-entropy, and the slicing of full tensors into shards.

Everything takes the mesh's tp group (`mesh.groups["tp"]`, a group.Group); None -- a one-rank tp
axis -- makes every collective the identity, so a tp=1 model runs the plain dense code.
Activations are batch-first, (B, T, C): the sequence is tensor dim 1. Every collective goes
through the group's Comm, inline (on the issuing stream, waited for at once: the layer needs its
result), so a hang inside a tp layer is named in the flight log like any other.

Each layer says how its parameters split over tp (`tp_split`: parameter name -> ShardSpec); the
placement table (parallel/placement.py) reads it, and nothing infers a split from a name."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from braidtrain.model import flash4, fp8
from braidtrain.model.attention import causal_attention

SEQ = 1  # the sequence dim of a (B, T, C) activation


# -- raw collectives along a tensor dim (the collectives themselves work on dim 0) ------------------

def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    x = torch.clone(x, memory_format=torch.contiguous_format)  # never write into a caller's tensor
    group.comm.all_reduce(x, group, op, inline=True)
    return x


def _tp(group):
    return (1, 0) if group is None else (group.size, group.index)


def _all_gather_dim(x, dim, group):
    """Concatenate every rank's x along `dim`, in tp-rank order."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    group.comm.all_gather(out, x, group, inline=True)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x, dim, group):
    """Sum x over the ranks and keep this rank's chunk along `dim`."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    group.comm.reduce_scatter(out, x, group, inline=True)
    return out.movedim(0, dim)


# -- the collectives autograd sees ---------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """Megatron's f (Shoeybi et al. 2019, fig. 3): forward identity -- every tp rank already holds
    the whole input of a column-parallel layer; backward all-reduce -- each rank's layer produced a
    partial input gradient (from its own output features), the true gradient is their sum."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g (Shoeybi et al. 2019, fig. 3): forward all-reduce -- the row-parallel layer's
    partial sums become the full output on every rank; backward identity -- the output is replicated,
    so its gradient already is the gradient of each rank's partial sum."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllGatherSeq(torch.autograd.Function):
    """Sequence parallelism's g (Korthikanti et al. 2022, sec. 4.2.2): forward all-gather along the
    sequence dim -- each rank's T/tp rows make the whole sequence for a column-parallel layer;
    backward reduce-scatter -- partial input gradients summed (f's job), each rank keeps its rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, SEQ, ctx.group), None


class ReduceScatterSeq(torch.autograd.Function):
    """Sequence parallelism's g-bar (Korthikanti et al. 2022, sec. 4.2.2): forward reduce-scatter
    along the sequence dim -- the row-parallel partial sums are added and each rank keeps T/tp rows
    (the same bytes as half of an all-reduce); backward all-gather of the row gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, SEQ, ctx.group), None


class GatherLastDim(torch.autograd.Function):
    """Forward all-gather along the last dim (the output features of a column-parallel layer, e.g.
    the vocab of the logits when sampling); backward keeps this rank's chunk -- every rank holds the
    same full gradient, so no communication is needed (Shoeybi et al. 2019, sec. 3)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        tp, rank = _tp(ctx.group)
        return grad.chunk(tp, -1)[rank].contiguous(), None


def enter_tp(x, group, sp):
    """Into a tp region (the input of a column-parallel layer): the whole sequence on every rank."""
    return x if group is None else (AllGatherSeq if sp else CopyToTP).apply(x, group)


def leave_tp(x, group, sp):
    """Out of a tp region (the partial sums of a row-parallel layer): summed, and under sp only
    this rank's rows of the sequence kept."""
    return x if group is None else (ReduceScatterSeq if sp else ReduceFromTP).apply(x, group)


def gather_last_dim(x, group):
    return x if group is None else GatherLastDim.apply(x, group)


# -- layers ------------------------------------------------------------------------------------------
# They subclass nn.Linear / nn.Embedding, holding only the local shard, so that at tp=1 they are
# exactly those modules (same parameters, same numerics, same default init). A linear layer's
# `fp8` is None (F.linear) or a float8 recipe (model/fp8.py), which the stage sets for the blocks'
# layers under --fp8 (protocol.Stage.use_fp8).

def _linear(x, weight, bias, recipe):
    return F.linear(x, weight, bias) if recipe is None else fp8.linear(x, weight, bias, recipe)


class ColumnParallelLinear(nn.Linear):
    """y = x W^T + b with W split along the output features (tensor dim 0 of the (out, in) weight):

          W (out, in)        tp rank      y = [ y_0 | y_1 | ... ]   (each rank: its out/tp features)
        [ rows 0   .. o/tp )   0
        [ rows o/tp.. 2o/tp)   1          input x: replicated (f), or its T/tp rows gathered (sp)

    The output stays split unless gather_output (then all-gathered along the last dim). `packed`:
    the output is blocks of features side by side, of these relative widths (GPT-2's c_attn: q, k,
    v as (1, 1, 1); grouped-query attention's (H, H_kv, H_kv); SwiGLU's gate and up (1, 1)), each
    split over tp on its own ("packed" in shard_of)."""

    def __init__(self, in_features, out_features, group, bias=True, sp=False, gather_output=False, packed=()):
        tp, _ = _tp(group)
        super().__init__(in_features, out_features // tp, bias=bias)
        self.group, self.sp, self.gather_output = group, sp, gather_output
        split = ShardSpec(0, "packed", 1, tuple(packed)) if packed else ShardSpec(0, "contiguous")
        self.tp_split = {"weight": split, "bias": split}
        self.fp8 = None

    def forward(self, x):
        if self.group is None:
            return _linear(x, self.weight, self.bias, self.fp8)
        y = _linear(enter_tp(x, self.group, self.sp), self.weight, self.bias, self.fp8)
        return gather_last_dim(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Linear):
    """y = x W^T + b with W split along the input features (tensor dim 1 of the (out, in) weight):

          W (out, in) = [ W_0 | W_1 | ... ]      rank r holds W_r (out, in/tp) and x_r (its in/tp
                          in/tp columns each     features, from a column-parallel layer)

    y = sum_r x_r W_r^T: all-reduced (g), or reduce-scattered along the sequence (sp). The bias is
    added once, after the reduction (added before, it would be counted tp times)."""

    def __init__(self, in_features, out_features, group, bias=True, sp=False):
        tp, _ = _tp(group)
        super().__init__(in_features // tp, out_features, bias=bias)
        self.group, self.sp = group, sp
        self.tp_split = {"weight": ShardSpec(1, "contiguous"), "bias": REPLICATED}
        self.fp8 = None

    def forward(self, x):
        if self.group is None:
            return _linear(x, self.weight, self.bias, self.fp8)
        y = leave_tp(_linear(x, self.weight, None, self.fp8), self.group, self.sp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Each tp rank holds a contiguous range of the (padded) vocabulary's rows:

          rows [0, V/tp) -> rank 0,  [V/tp, 2V/tp) -> rank 1, ...

    A token outside this rank's range looks up row 0 and is zeroed, so the sum over ranks (all-reduce,
    or reduce-scatter along the sequence under sp) is the full embedding (Shoeybi et al. 2019, sec. 3).
    The same shard, as a (V/tp, C) weight, is the tied output head's column-parallel slice.
    `align`: the caller padded the vocabulary to a multiple of align*tp rows (zero rows past the
    tp = 1 padding: ShardSpec.align)."""

    def __init__(self, num_embeddings, embedding_dim, group, sp=False, align=1):
        tp, rank = _tp(group)
        super().__init__(num_embeddings // tp, embedding_dim)
        self.group, self.sp = group, sp
        self.tp_split = {"weight": ShardSpec(0, "contiguous", align)}
        self.vocab_start = rank * self.num_embeddings
        self.vocab_end = self.vocab_start + self.num_embeddings

    def forward(self, idx):
        if self.group is None:
            return F.embedding(idx, self.weight)
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(out, self.group, self.sp)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy per token from logits split over the vocabulary (Shoeybi et al. 2019, sec. 3:
    fusing the head with the loss cuts its communication from b*s*v to b*s). Forward: this rank's
    logits (N, V/tp) for columns [vocab_start, vocab_start + V/tp); the max and then (sum of exp,
    target logit) are all-reduced over tp -- 3N numbers, never the full logits. Columns at or beyond
    `vocab_size` are padding rows of the embedding and are masked to -inf, so never predicted.
    Backward: softmax - onehot on the local columns, no communication; it overwrites the saved
    softmax (the model's largest activation) in place, so it runs once (no retain_graph)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        n_local = logits.shape[-1]
        logits = logits.to(torch.float32, copy=True)
        logits[:, max(0, vocab_size - vocab_start):] = float("-inf")  # the padding this rank holds
        logits -= _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)
        mine = (target >= vocab_start) & (target < vocab_start + n_local)
        local_target = (target - vocab_start).masked_fill(~mine, 0)
        target_logit = logits.gather(1, local_target.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        exp = logits.exp_()
        sum_exp, target_logit = _all_reduce(torch.stack([exp.sum(dim=-1), target_logit]), group)  # one collective
        exp /= sum_exp.unsqueeze(-1)  # now the softmax
        ctx.save_for_backward(exp, local_target, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, mine = ctx.saved_tensors
        g = softmax  # in place (see above)
        g[torch.arange(g.shape[0], device=g.device), local_target] -= mine.to(g.dtype)
        g *= grad.unsqueeze(-1)
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, vocab_start, vocab_size, group):
    """Per-token loss (N,) from this rank's (N, V/tp) logits; see VocabParallelCrossEntropy."""
    if group is None:
        return F.cross_entropy(logits[:, :vocab_size].float(), target, reduction="none")
    return VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group)


# -- norms ----------------------------------------------------------------------------------------------

class _RMSNorm(torch.autograd.Function):
    """y = w * x * r, r = 1/sqrt(mean(x^2) + eps) over the last dim (Zhang and Sennrich 2019), computed
    as HuggingFace's Llama does. It keeps x and r for the backward -- what a fused kernel keeps, on
    every device (torch's CPU rms_norm is composite and keeps x twice and the normalised x too) -- and
    computes dx = r * (g w - x^ mean(g w x^)), x^ = x r, and dw = the sum over tokens of g x^."""

    @staticmethod
    def forward(ctx, x, w, eps: float):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, w)
        return w * (x * r)

    @staticmethod
    def backward(ctx, g):
        x, r, w = ctx.saved_tensors
        xhat, gw = x * r, g * w
        dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = (g * xhat).flatten(0, -2).sum(0)
        return dx, dw, None


class RMSNorm(nn.Module):
    """`tp_partial`: the norm acts on what each tp rank holds of a split tensor (a head's q or k, each
    rank its own heads), so each rank's gradient of its weight is a part, summed over tp (the
    placement table reads it)."""

    def __init__(self, dim: int, eps: float = 1e-5, tp_partial: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        if tp_partial:
            self.tp_partial = {"weight"}

    def forward(self, x):
        return _RMSNorm.apply(x, self.weight, self.eps)


# -- attention ----------------------------------------------------------------------------------------

def attend(q, k, v, cp=None, kernel: str = "sdpa"):
    """softmax(q kᵀ/√D, causal) v for queries (B, H, T, D) and keys and values (B, H_kv, T, D): with
    grouped-query attention (H_kv < H) each key/value head serves H/H_kv consecutive query heads.
    Over the whole sequence through context parallelism's `cp` (parallel/context.py: only the H_kv
    heads travel); else by the attention module's `kernel` (Stage.use_attention): "exact",
    attention.py's deterministic kernels (exact mode on the GPU); "flash4", flash-attn-4's (flash4.py;
    bf16 and fp16 only -- under autocast its dtype, as SDPA's inputs -- so SDPA takes other dtypes);
    "sdpa", torch's SDPA (its cuDNN or flash kernels on CUDA)."""
    if cp is not None and cp.active:
        return cp.attend(q, k, v)
    if kernel == "exact":
        return causal_attention(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]))
    if kernel == "flash4":
        if torch.is_autocast_enabled(q.device.type):  # the inputs autocast gives SDPA (a qk-norm's q, k are fp32)
            q, k, v = (z.to(torch.get_autocast_dtype(q.device.type)) for z in (q, k, v))
        if q.dtype in flash4.DTYPES and k.dtype == v.dtype == q.dtype:
            return flash4.attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def repeat_kv(x, heads: int):
    """(B, H_kv, T, D) -> (B, heads, T, D), each head repeated heads/H_kv times in place. An expand:
    its backward sums the copies' gradients, a plain (deterministic) reduction."""
    B, H, T, D = x.shape
    return x if H == heads else x[:, :, None].expand(B, H, heads // H, T, D).reshape(B, heads, T, D)


# -- shard specs: how a full tensor is split over tp -----------------------------------------------

class ShardSpec(NamedTuple):
    """How a parameter's full tensor is split over the tp axis: `kind` is "replicated" (every rank
    holds it all; dim None), "contiguous" (tp equal chunks along tensor dim `dim`) or "packed" (blocks
    side by side along `dim`, of relative widths `parts`, each split into tp chunks on its own:
    GPT-2's c_attn q, k, v; grouped-query attention's q, k, v of unequal widths). `align`: under tp the
    split dim is padded with zero rows to a multiple of align*tp (the vocabulary: 128), so that
    every rank holds the same number of rows. ("qkv", in checkpoints of before wave 3, is packed
    (1, 1, 1).)"""
    dim: int | None
    kind: str
    align: int = 1
    parts: tuple = ()

    @staticmethod
    def from_json(v: list) -> ShardSpec:
        dim, kind, align, *parts = v
        if kind == "qkv":
            return ShardSpec(dim, "packed", align, (1, 1, 1))
        return ShardSpec(dim, kind, align, tuple(parts[0]) if parts else ())


REPLICATED = ShardSpec(None, "replicated")


def _part_sizes(n: int, parts: tuple) -> list[int]:
    unit = n // sum(parts)
    return [w * unit for w in parts]


def shard_of(full: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor:
    """Tp rank `rank`'s shard of the full tensor, a new contiguous tensor. "packed" (1, 1, 1), tp=2,
    4 heads (GPT-2's q, k, v; with (4, 2, 2), grouped-query attention, k and v have 2 heads each):

        full (3C, ...):   [ q: h0 h1 | h2 h3 ][ k: h0 h1 | h2 h3 ][ v: h0 h1 | h2 h3 ]
        rank 0 (3C/2):    [ q: h0 h1 ][ k: h0 h1 ][ v: h0 h1 ]
        rank 1 (3C/2):    [ q: h2 h3 ][ k: h2 h3 ][ v: h2 h3 ]
    """
    if spec.kind == "replicated":
        return full.clone()
    if spec.kind == "contiguous":
        return full.chunk(tp, spec.dim)[rank].contiguous()
    if spec.kind == "packed":
        d = spec.dim % full.dim()
        blocks = full.split(_part_sizes(full.shape[d], spec.parts), d)
        return torch.cat([b.chunk(tp, d)[rank] for b in blocks], d).contiguous()
    raise ValueError(f"unknown shard kind {spec.kind!r}")


def unshard(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from the shards of tp ranks 0, 1, ... (the inverse of shard_of)."""
    if spec.kind == "replicated":
        return pieces[0].clone()
    if spec.kind == "contiguous":
        return torch.cat(pieces, spec.dim)
    if spec.kind == "packed":
        d = spec.dim % pieces[0].dim()
        split = [p.split(_part_sizes(p.shape[d], spec.parts), d) for p in pieces]
        return torch.cat([torch.cat([blocks[j] for blocks in split], d) for j in range(len(spec.parts))], d)
    raise ValueError(f"unknown shard kind {spec.kind!r}")
