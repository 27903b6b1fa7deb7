"""What every family shares: the Stage -- the whole model, or one pipeline chunk of it -- with its
forward (embedding on the first chunk, blocks, final norm and head on the last: the fused loss at
tp 1, the vocab-parallel cross-entropy under tp), positions (cp's chunks), recompute, compile, the
tied head's TiedHead, the settings build.py applies, and what the engine and the placement table
read (param_units, tied_users, copies); and the Block every family's blocks derive from.

Positions. A Stage knows which tokens of each sequence it holds (all of them, or under context
parallelism its chunks: `cp.positions`) and hands their positions to the family's `embed` (GPT-2's
learned positions) and to every block (`block_inputs`: Llama's rotary tables).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from braidtrain.errors import UserError
from braidtrain.model import attention
from braidtrain.model.layers import (ColumnParallelLinear, RowParallelLinear, enter_tp, gather_last_dim,
                                     vocab_parallel_cross_entropy)
from braidtrain.model.loss import head_loss
from braidtrain.model.moe import Dispatch, MoE
from braidtrain.model.protocol import ModelConfig


class Blocks(nn.ModuleDict):
    """The blocks a model (or a pipeline stage of it) holds, keyed by their index in the whole
    model, so that parameter names -- h.<i>.* -- are the whole model's on every stage. Indexed by
    that number; iterated in order."""

    def __getitem__(self, i):
        return super().__getitem__(str(i))

    def __iter__(self):
        return iter(self._modules.values())


class TiedHead(torch.autograd.Function):
    """The output head's use of the tied embedding, with its gradient kept apart: forward the
    identity; backward hands the head's gradient of the embedding to `sink` (the engine, which adds
    it to the lookup's once per step) and gives autograd none. Exact mode does this in every
    layout, so that the two uses' sums are the same whether one rank holds both or two stages hold
    one each."""

    @staticmethod
    def forward(ctx, w, sink):
        ctx.sink = sink
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None


class Stage(nn.Module):
    """The whole model, or one pipeline stage (chunk number `stage`) of it: the blocks `blocks`
    (default all), the embedding if `first`, the final norm and the head if `last` (with a tied
    head, a stage that is last but not first holds its own copy of the embedding for it).

    A family's Model subclasses this and sets, in its __init__ after Stage's: `blocks_attr` (the
    ModuleDict of blocks, e.g. "h"), and, by `first` and `last`, the modules its `embed`,
    `final_norm` and head use. It names them: `embed_names()`, `head_names()` (the final norm's,
    and the untied head's), `embedding_name` (the token embedding's weight)."""

    blocks_attr: ClassVar[str] = "h"
    embedding_name: ClassVar[str] = "wte.weight"

    def __init__(self, cfg: ModelConfig, mesh=None, sp: bool = False, first: bool = True, last: bool = True,
                 stage: int = 0, dispatch=None):
        super().__init__()
        self.cfg = cfg
        self.tp = 1 if mesh is None else mesh.size("tp")
        self.tp_rank = 0 if mesh is None else mesh.coord("tp")
        cfg.check_tp(self.tp)
        self.sp = sp and self.tp > 1
        self.group = mesh.groups["tp"] if self.tp > 1 else None  # None: plain dense layers
        self.first, self.last, self.stage = first, last, stage  # stage: its place in the pipeline's chunks
        # a mixture of experts': every expert here (model/moe.py), or sharded over ep (parallel/expert.py)
        self.dispatch = dispatch if dispatch is not None else Dispatch()
        self.ep_rank = mesh.coord("ep") if self.dispatch.n > 1 else 0
        self.recompute = False  # activation checkpointing: keep only each block's input (use_recompute)
        self.head_sink = None  # exact mode: where the head's gradient of a tied embedding goes (use_head_sink)
        self.cp = None  # context parallelism: this rank holds its chunks of each sequence (use_context)

    # -- what the family provides ------------------------------------------------------------------
    def embed(self, inp, pos):
        """Token ids (B, T) -> the residual stream (B, T or T/tp under sp, C); pos: their positions."""
        raise NotImplementedError

    def final_norm(self, x):
        raise NotImplementedError

    def head_weight(self):
        """The head's weight (V_pad/tp, C): the embedding's if tied."""
        raise NotImplementedError

    def block_inputs(self, pos) -> tuple:
        """What every block takes beside the residual stream, from the positions of the whole
        sequence this rank attends over (e.g. rotary tables); GPT-2: nothing."""
        return ()

    def embed_names(self) -> list[str]:
        raise NotImplementedError

    def head_names(self) -> list[str]:
        raise NotImplementedError

    def my_experts(self) -> range:
        """The experts of each MoE layer this rank holds."""
        return self.dispatch.experts_of(self.cfg.moe_experts, self.ep_rank)

    # -- what the engine and the placement table read --------------------------------------------
    def blocks(self) -> Blocks:
        return getattr(self, self.blocks_attr)

    def moe_layers(self) -> list:
        return list(self.moe_by_block().values())

    def moe_by_block(self) -> dict:
        """{block index: its mixture of experts} of the blocks this stage holds."""
        return {int(i): m for i, block in self.blocks().items() for m in block.modules() if isinstance(m, MoE)}

    def param_units(self):
        """Parameter groups for the data-parallel engine, in forward order, module None for a group
        of no block: the embedding group first (with a tied head, the final norm too: it is used at
        both ends), each block, then (untied) the final norm and the head; a last stage that is not
        the first ends with them (and its copy of a tied embedding)."""
        prefix = self.blocks_attr
        blocks = [(blk, [f"{prefix}.{i}.{n}" for n, _ in blk.named_parameters()]) for i, blk in self.blocks().items()]
        head = self.head_names() + ([self.embedding_name] if self.cfg.tied and not self.first else [])
        if self.first and self.last and self.cfg.tied:
            return [(None, self.embed_names() + self.head_names())] + blocks
        return ([(None, self.embed_names())] if self.first else []) + blocks + ([(None, head)] if self.last else [])

    def tied_users(self) -> dict[str, tuple[str, ...]]:
        """Parameters used in more than one place, and which of those uses this model holds: a tied
        embedding's lookup (first stage) and the output head (last)."""
        uses = ("lookup",) * self.first + ("head",) * self.last if self.cfg.tied else ()
        return {self.embedding_name: uses} if uses else {}

    def copies(self) -> set[str]:
        """Parameters this model holds as a copy of another stage's: a last stage's tied embedding,
        for the head (kept bitwise equal to the first stage's: the same gradient, the same update)."""
        return {self.embedding_name} if self.cfg.tied and self.last and not self.first else set()

    # -- settings (build.py and the engine call them once, before training) ---------------------
    def use_recompute(self) -> None:
        """--recompute: each block keeps only its input for the backward, which runs it again."""
        self.recompute = True

    def use_experts(self, exact: bool, loss_scale: float) -> None:
        """A mixture of experts' settings: `exact`, each source's rows through an expert in their own
        call (model/moe.py's Dispatch); `loss_scale`, the aux term's weight (1 / the global token
        count)."""
        self.dispatch.exact = exact
        for moe in self.moe_layers():
            moe.loss_scale = loss_scale

    def use_expert_biases(self, biases: torch.Tensor) -> None:
        """--moe-balance bias: each MoE layer's expert biases become row i of `biases` (n_layer, E),
        a view, so that the trainer moves the whole table at once. After the stage's last .to()."""
        for i, moe in self.moe_by_block().items():
            moe.bias = biases[i]

    def use_expert_sink(self, sink) -> None:
        """Exact mode at ep > 1: where each source's expert gradients go (the engine's expert.Sourced)."""
        self.dispatch.sink = sink

    def use_head_sink(self, sink) -> None:
        """Exact mode: the head's gradient of a tied embedding goes to `sink` (TiedHead; the engine's
        parallel/tied.py adds it to the lookup's once a step)."""
        self.head_sink = sink

    def use_context(self, cp) -> None:
        """Context parallelism (parallel/context.py): inputs are this rank's tokens of each
        sequence, at cp.positions; attention runs over the whole sequence through `cp`."""
        self.cp = cp
        for block in self.blocks():
            block.attention().cp = cp

    def use_attention(self, kernel: str) -> None:
        """The blocks' attention kernel (layers.attend): "exact", attention.py's Triton kernels, for
        exact mode on the GPU (torch's fused attention backwards add partial tiles with atomics: not
        bitwise repeatable; these add in a fixed order; on the CPU torch's is deterministic already);
        "flash4", flash-attn-4's (flash4.py), where installed; "sdpa", torch's (the default). (The
        exact kernels' operators are defined here, before a compiled block's trace could meet their
        definition: attention.register.)"""
        if kernel == "exact":
            attention.register()
        for block in self.blocks():
            block.attention().kernel = kernel

    def use_fp8(self, recipe) -> None:
        """--fp8: the blocks' column- and row-parallel linears (attention's projections, the MLP)
        compute their three products in float8 (model/fp8.py's recipe). The embedding, the head,
        the norms and the router stay as they are, and so do a mixture's experts (plain nn.Linear
        run by the dispatch's grouped GEMM, which has no float8 path yet)."""
        for block in self.blocks():
            for m in block.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    m.fp8 = recipe

    def use_fused_kernels(self) -> None:
        """The fused Triton operators, one kernel each way: the blocks' SwiGLU MLPs (each module with a
        `fused_swiglu` switch: llama.py's MLP, a mixture's shared experts, moe.py's SwiGLUExperts on
        their grouped GEMM path) run silu(gate) * up as model/swiglu.py's operator, and the norms of
        each module with a `fused_norm` switch (llama.py's Block and final norm) model/rmsnorm.py's.
        build.py sets it on CUDA only, and neither under --exact (its bits are the plain expressions')
        nor under --fp8 (not measured with float8's casts)."""
        for m in self.modules():
            if hasattr(type(m), "fused_swiglu"):
                m.fused_swiglu = True
            if hasattr(type(m), "fused_norm"):
                m.fused_norm = True

    def compile_blocks(self) -> None:
        """--compile: each block becomes one torch.compile'd function, for training (grad
        enabled); the head and loss are loss.py's fused kernel already. Block by block rather
        than the whole model, so each block's backward is still its own autograd node: its
        gradients are complete -- and their bucket's reduction can start -- while earlier blocks
        are still in the backward pass. Module hooks (ZeRO-3's gathers) stay outside the compiled
        code. tp = 1 only (layout.py says so): the tp layers' collectives are not traceable yet."""
        for block in self.blocks():
            block.compiled = torch.compile(block.body)

    # -- the forward -------------------------------------------------------------------------------
    def positions(self, T: int, device) -> torch.Tensor:
        """The positions in its sequence of each of this rank's T tokens (cp: its chunks)."""
        if self.cp is None or not self.cp.active:
            return torch.arange(T, device=device)
        return self.cp.positions(T, device)

    def forward(self, inp, targets=None):
        """`inp`: token ids on the first stage, else the previous stage's output. Returns that
        output for the next stage; on the last, the logits over the real vocabulary, or, given
        targets, the *sum* of the cross-entropy over all tokens (the caller divides once by the
        global token count). Under tp every rank returns the same full sum (and the same full
        logits)."""
        T = inp.shape[1] * (self.tp if self.sp and not self.first else 1)  # this rank's tokens of a sequence
        if self.sp:
            self.cfg_check_sp(T)
        pos = self.positions(T, inp.device)
        x = self.embed(inp, pos) if self.first else inp
        extra = self.block_inputs(pos)
        for block in self.blocks():
            if self.recompute and torch.is_grad_enabled():
                # recomputed in the backward pass; the model draws no random numbers, so there is no RNG
                # state to carry over (and reading it would break a CUDA graph capture)
                x = checkpoint(block, x, *extra, use_reentrant=False, preserve_rng_state=False)
            else:
                x = block(x, *extra)
        if not self.last:
            return x
        x = self.final_norm(x)
        w = self.head_weight()
        if self.cfg.tied and self.head_sink is not None:
            w = TiedHead.apply(w, self.head_sink)
        V = self.cfg.vocab_size
        if self.group is None:
            return F.linear(x, w)[..., :V] if targets is None else head_loss(x, w, targets, V)
        # the head, column-parallel over the vocabulary: (B, T, V/tp) of this rank's rows
        logits = F.linear(enter_tp(x, self.group, self.sp), w)
        if targets is None:
            return gather_last_dim(logits, self.group)[..., :V]
        start = self.tp_rank * logits.shape[-1]
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), start, V, self.group).sum()

    def cfg_check_sp(self, T: int) -> None:
        if T % self.tp:
            raise UserError(f"sequence length {T} is not divisible by tp={self.tp}: sequence parallelism "
                            f"splits the sequence over the tp ranks; use a multiple of {self.tp} (or drop --sp)")


def attention_kernel(parts, cp: int) -> str:
    """Which kernel attends in a run of these parts (Stage.use_attention): a part's first block's ("-"
    when no part has a block; "cp" under context parallelism, whose ring runs its own: parallel/context.py)."""
    if cp > 1:
        return "cp"
    blocks = next((list(p.blocks()) for p in parts if len(p.blocks())), [])
    return blocks[0].attention().kernel if blocks else "-"


class Block(nn.Module):
    """A block: the family's `body(x, *block_inputs)`, run compiled in training under --compile
    (`compiled`: torch.compile(self.body), Stage.compile_blocks); `attention()`: its attention
    module, whose `cp` and `kernel` the stage sets."""

    compiled = None

    def attention(self):
        return self.attn

    def forward(self, x, *extra):
        if self.compiled is not None and torch.is_grad_enabled():  # training; eval, sampling: eager
            out = self.compiled(x, *extra)
        else:
            out = self.body(x, *extra)
        if self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            for moe in self.mixtures:  # a training forward, not a recomputation in the backward
                moe.stats.add_(moe.last)
        return out

    @functools.cached_property
    def mixtures(self) -> tuple:
        """Its mixtures of experts, whose forward's figures (`last`) count in the step's (`stats`)
        here, outside the compiled body (which cannot tell a recomputation)."""
        return tuple(m for m in self.modules() if isinstance(m, MoE))

    def body(self, x, *extra):
        raise NotImplementedError
