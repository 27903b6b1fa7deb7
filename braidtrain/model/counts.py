"""A model's counts, from the model itself: what the planner and MFU use, never a formula typed apart.

    counts(cfg)                      parameters; per block and for the head, the parameters a token
                                     passes through (FLOPs: 6 per such parameter, protocol.py); per
                                     block the shapes of its tp linears (--fp8's float8 products)
    block_activations(cfg, tp, sp)   bytes a block keeps for its backward, per token: what autograd
                                     saves when the family's own block runs forward (with --fp8's
                                     float8 linears: model/fp8.py; compiled=True: what the forward
                                     graph of torch.compile's partition hands its backward)
    moe_activations(cfg, tp, sp)     what an MoE layer keeps beyond that: per routed row, per token

The second runs one block on fake tensors (no memory, no arithmetic: torch's FakeTensorMode) under
the precision training uses -- bf16 autocast over fp32 weights for the GPU, fp32 for the CPU -- and
adds the storage of every tensor autograd saves (saved_tensors_hooks), twice, at two sequence
lengths: the difference is the per-token part (the weights' bf16 copies do not grow with tokens).
Tensor parallelism: the block is built again on a fake tp group of 2 (its collectives are no-ops on
fake tensors), with and without sp; bytes(tp) = whole + split/tp then gives the part every tp rank
keeps whole (norm inputs, the inputs of column-parallel layers; under sp only their gathered copies)
and the part split over tp (heads, the MLP's columns).

One difference from a GPU the trace cannot see: on the CPU, SDPA returns its output laid out (B, T,
H, D), so merging the heads is free and the next projection saves the same storage; on CUDA its
output is (B, H, T, D) and the merge is a copy the projection saves: `HEAD_MERGE` bytes a channel of
the attention output, added for the GPU (the trace and the GPU's measured peak compared:
docs/design-notes.md).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn as nn

from braidtrain.model.fp8 import RECIPES
from braidtrain.model.layers import ColumnParallelLinear, RowParallelLinear
from braidtrain.model.moe import MoE

HEAD_MERGE = 2  # bytes per channel of the attention output, on the GPU (bf16): see the docstring


@functools.lru_cache(maxsize=64)
def counts(cfg) -> dict:
    """{"params": all, "blocks": [per block, the parameters a token passes through], "head": the
    final norm's and the head's, "linear": [per block, (out, in, the dim tp splits) of each weight of
    its column- and row-parallel linears: what --fp8 computes in float8 (Stage.use_fp8)]}: from the
    whole model at tp = 1 on the meta device."""
    with torch.device("meta"):
        model = cfg.model(cfg)
    share = {}  # parameter -> the share of tokens through it: k/E for an expert's
    for module in model.modules():
        if isinstance(module, MoE):
            for p in module.experts.parameters():
                share[p] = module.k / module.E
    lookups = {p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    used = lambda ps: sum(p.numel() * share.get(p, 1.0) for p in ps)
    head = used(p for n, p in model.named_parameters() if n in model.head_names() and p not in lookups)
    head += model.head_weight().numel() if cfg.tied else 0  # the tied head's matmul (the table is a lookup too)
    linear = [tuple((*m.weight.shape, 0 if isinstance(m, ColumnParallelLinear) else 1) for m in block.modules()
                    if isinstance(m, (ColumnParallelLinear, RowParallelLinear))) for block in model.blocks()]
    return {"params": sum(p.numel() for p in model.parameters()),
            "blocks": [used(block.parameters()) for block in model.blocks()], "head": head, "linear": linear}


class _FakeComm:
    """A tp group's collectives on fake tensors: nothing to move (the outputs' shapes are made by the
    layers around them)."""

    def all_reduce(self, *a, **k):
        pass

    def all_gather(self, *a, **k):
        pass

    def reduce_scatter(self, *a, **k):
        pass


def _fake_mesh(tp: int):
    group = SimpleNamespace(size=tp, index=0, comm=_FakeComm())
    return SimpleNamespace(size=lambda axis: tp if axis == "tp" else 1, coord=lambda axis: 0, groups={"tp": group})


def _kept(fn, params, x, extra=(), bf16: bool = True) -> int:
    """Bytes autograd keeps for fn(x, *extra)'s backward, its weights `params` not counted (on fake
    tensors: call inside FakeTensorMode)."""
    weights = {p.untyped_storage()._cdata for p in params}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in weights:
            seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        fn(x, *extra)
    return sum(seen.values())


def _stage(cfg, tp: int, sp: bool, at: int):
    """A stage of one block (block `at`) on a fake tp group (call inside FakeTensorMode)."""
    return cfg.model(cfg, _fake_mesh(tp) if tp > 1 else None, sp, range(at, at + 1), first=False, last=False)


def _saved(cfg, tp: int, sp: bool, T: int, bf16: bool, fp8: str | None = None, fused: bool = False) -> int:
    """Bytes autograd keeps for a block's backward at sequence length T (one sequence), tp rank 0's;
    fused: with the fused operators (Stage.use_fused_kernels: the SwiGLU operator keeps gate_up alone)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        stage = _stage(cfg, tp, sp, 0)
        if fp8:
            stage.use_fp8(RECIPES[fp8])
        if fused:
            stage.use_fused_kernels()
        x = torch.zeros(1, T // tp if sp else T, cfg.n_embd, requires_grad=True)
        block = stage.blocks()[0]
        return _kept(block, block.parameters(), x, stage.block_inputs(torch.arange(T)), bf16)


@functools.lru_cache(maxsize=64)
def _saved_compiled(cfg, tp: int, sp: bool, T: int, bf16: bool, fp8: str | None = None, fused: bool = False) -> int:
    """What _saved counts, for the block as --compile runs it: torch.compile's partition of the
    forward and backward graphs (inductor's, min-cut: it recomputes cheap pointwise results in the
    backward rather than keep them), traced on fake tensors -- the backward graph's inputs other
    than the incoming gradients are what the forward keeps. No kernel is generated or run. fused:
    with the fused operators, whose outputs the partition cannot rebuild (the norms' bf16 outputs,
    which it recomputes from the plain expression's, are then kept for the matmuls)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensorMode

    kept = []

    class Traced(Exception):
        pass

    def partition(joint, inputs, **kw):
        fwd, bwd = min_cut_rematerialization_partition(joint, inputs, **kw)
        inputs = [n for n in bwd.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        vals = [n.meta.get("val") for n in inputs]
        kept.append(sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)))
        raise Traced  # the partition is all we need

    def backend(gm, example):
        return aot_module_simplified(gm, example, fw_compiler=lambda g, _: g, partition_fn=partition)

    mode = FakeTensorMode()
    with mode:
        stage = _stage(cfg, tp, sp, 0)
        if fp8:
            stage.use_fp8(RECIPES[fp8])
        if fused:
            stage.use_fused_kernels()
        x = torch.zeros(1, T // tp if sp else T, cfg.n_embd, requires_grad=True)
        extra = stage.block_inputs(torch.arange(T))
    torch._dynamo.reset()
    try:
        with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            torch.compile(stage.blocks()[0].body, backend=backend, fullgraph=True, dynamic=False)(x, *extra)
    except Exception as e:  # dynamo wraps what the backend raises
        if not kept:
            raise e
    finally:
        torch._dynamo.reset()
    return kept[0]


@functools.lru_cache(maxsize=256)
def block_activations(cfg, tp: int = 1, sp: bool = False, gpu: bool = True, fp8: str | None = None,
                      compiled: bool = False, fused: bool = False) -> float:
    """Bytes one block keeps for its backward per token of a micro-batch, on tp rank 0 (a dense
    block: a mixture's extra is the planner's moe_layer_bytes). gpu: bf16 autocast (and the head
    merge's copy, HEAD_MERGE), else fp32. fp8: the linears in float8, with that recipe. compiled:
    as --compile runs the block (_saved_compiled). fused: with the fused operators (build.settle: on
    CUDA outside --exact and --fp8; eager, SwiGLU's keeps gate_up alone, compiled inductor does either
    way; compiled, the norms' outputs are kept where inductor rebuilds its own)."""
    dense = cfg if not cfg.moe_experts else type(cfg)(**{**cfg.__dict__, "moe_experts": 0})
    t1, t2 = (16, 32) if compiled else (8 * max(tp, 2), 16 * max(tp, 2))  # (compiled: the same two traces for every tp)
    saved = _saved_compiled if compiled else _saved

    def per_token(k, s):
        return (saved(dense, k, s, t2, gpu, fp8, fused) - saved(dense, k, s, t1, gpu, fp8, fused)) / (t2 - t1)

    one = per_token(1, False) + (HEAD_MERGE * dense.n_head * dense.head_dim if gpu else 0)
    if tp == 1:
        return one
    two = per_token(2, sp) + (HEAD_MERGE * dense.n_head * dense.head_dim / 2 if gpu else 0)
    whole = 2 * two - one  # bytes(k) = whole + (one - whole) / k, from bytes(1) and bytes(2)
    return whole + (one - whole) / tp


@functools.lru_cache(maxsize=64)
def moe_activations(cfg, tp: int = 1, sp: bool = False, gpu: bool = True) -> tuple[float, float]:
    """What one MoE layer keeps beyond the dense MLP that block_activations counted in its place:
    (bytes per routed row -- what its expert saves, and its output kept for the routing weights --,
    bytes per token of the sequence -- the router's fp32 probabilities and the shared experts', less
    the dense MLP's), tp rank 0's. Traced as block_activations is: the family's own expert, shared
    MLP and dense MLP, at two sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    at = next(i for i in range(cfg.n_layer) if cfg.is_moe(i))
    dense_cfg = type(cfg)(**{**cfg.__dict__, "moe_experts": 0})
    C, T1, T2 = cfg.n_embd, 8 * max(tp, 2), 16 * max(tp, 2)
    bpe = 2 if gpu else 4
    with FakeTensorMode():
        stage, dense = _stage(cfg, tp, sp, at), _stage(dense_cfg, tp, sp, at)
        name, moe = next((n, m) for n, m in stage.named_modules() if isinstance(m, MoE))
        mlp, experts = dense.get_submodule(name), moe.experts
        first = [w[0] for w in experts.weights()]  # the first expert: its slices of the stacks

        def slope(fn, params, rows: bool):
            params = list(params)

            def kept(T):
                shape = (T, C) if rows else (1, T // tp if sp else T, C)
                return _kept(fn, params, torch.zeros(shape, requires_grad=True), bf16=gpu)
            return (kept(T2) - kept(T1)) / (T2 - T1)

        per_row = slope(lambda x: experts.one(x, first), experts.parameters(), True) + C * bpe
        per_token = (cfg.moe_experts * 4 / (tp if sp else 1)
                     + (slope(moe.shared, moe.shared.parameters(), False) if moe.shared else 0)
                     - slope(mlp, mlp.parameters(), False))
    return per_row, per_token
