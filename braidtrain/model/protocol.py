"""What a model family declares, and what every family shares.

A family (gpt2.py, llama.py) is one module that declares, and the registry (registry.py) lists:

    Config      a frozen ModelConfig subclass: the shape (its own fields beside the common ones)
    PRESETS     preset name -> that Config's fields (all but vocab_size, which is the data's)
    Model       a Stage subclass: the whole model, or one pipeline chunk of it, built on a mesh
    init_std    (cfg, parameter name) -> the std of its normal init, or None: 1 for a norm's
                weight, 0 for a bias
    HF          its HuggingFace adapter: ARCHITECTURES (and MODEL_TYPES), to_hf / from_hf (names
                and transforms), hf_config / config_from_hf

The engine, placement, passes, planner, checkpoints, export, evaluation, sampling and bench know
only this: a Stage's parameters, units, uses and forward; a ModelConfig's common fields and its
counts. Nothing else names a family's parameters or types a formula of its shape.

Counts (parameters, FLOPs per token) come from the model itself, built on the meta device: 6 FLOPs
per parameter a token passes through (its top-k experts' of a mixture), the embedding's lookups
excluded but a tied head's matmul counted, plus attention's 12 * n_layer * t * (n_head * head_dim)
for QK^T and AV (PaLM, appendix B) -- so a new layer shape is counted as soon as it exists.

Positions. A Stage knows which tokens of each sequence it holds (all of them, or under context
parallelism its chunks: `cp.positions`) and hands their positions to the family's `embed` (GPT-2's
learned positions) and to every block (`block_inputs`: Llama's rotary tables).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from braidtrain.errors import UserError, divisors
from braidtrain.model.layers import (ColumnParallelLinear, RowParallelLinear, enter_tp, gather_last_dim,
                                     vocab_parallel_cross_entropy)
from braidtrain.model.loss import head_loss
from braidtrain.model.counts import counts
from braidtrain.model.moe import BALANCES, ROUTERS, Dispatch, MoE

VOCAB_ALIGN = 128  # the vocabulary is padded to a multiple of this (times tp)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The fields every family has, and what is derived from them. A family's Config adds its own
    (with defaults) and sets `family` and `model`."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int  # the tokenizer's; the embedding is padded beyond it
    # a mixture of experts (model/moe.py) in place of the MLP of every moe_every-th block (0, n, 2n, ...)
    moe_experts: int = 0  # 0: dense
    moe_top_k: int = 2
    moe_every: int = 1
    moe_hidden: int = 0  # an expert's width (0: the dense MLP's)
    moe_capacity: float = 0.0  # capacity factor; 0: dropless
    moe_aux: float = 0.01  # the load-balancing loss's coefficient
    moe_router: str = "softmax-topk"  # or "topk-softmax" (model/moe.py)
    moe_balance: str = "aux"  # or "bias": DeepSeek-V3's auxiliary-loss-free balancing
    moe_bias_rate: float = 0.001  # its per-step move of an expert's bias
    moe_renorm: bool = True  # the top k's weights renormalised to sum to 1 (softmax-topk; Qwen3-MoE's norm_topk_prob)

    family: ClassVar[str] = ""
    model: ClassVar[type] = None  # its Stage subclass (set by the family module)
    mlp_name: ClassVar[str] = "4*n_embd"  # how the errors name the MLP width

    # -- the shape, as the shared layers and the planner see it ----------------------------------
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values (grouped-query attention shares each among n_head / kv_heads)."""
        return self.n_head

    @property
    def mlp_width(self) -> int:
        """The dense MLP's hidden width."""
        return 4 * self.n_embd

    @property
    def tied(self) -> bool:
        """The output head is the token embedding."""
        return True

    @property
    def moe_width(self) -> int:
        return self.moe_hidden or self.mlp_width

    def is_moe(self, block: int) -> bool:
        return self.moe_experts > 0 and block % self.moe_every == 0

    @property
    def padded_vocab(self) -> int:
        return self.vocab_rows(1)

    def vocab_rows(self, tp: int = 1) -> int:
        """Rows of the embedding (and head): the vocabulary padded to a multiple of 128*tp."""
        return -(-self.vocab_size // (VOCAB_ALIGN * tp)) * VOCAB_ALIGN * tp

    def check(self) -> None:
        """The shape on its own (a family adds its own checks)."""
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        check_moe(self)

    def check_tp(self, tp: int) -> None:
        """A tensor-parallel degree this model can be split by: its heads (of queries, and of keys
        and values: each rank holds whole heads, never replicated) and its MLP width."""
        for what, n in (("n_head", self.n_head), ("n_kv_heads", self.kv_heads), (f"the MLP width {self.mlp_name}", self.mlp_width)):
            if n % tp:
                why = " (each tp rank holds whole key/value heads: they are not replicated)" if what == "n_kv_heads" else ""
                raise UserError(f"tp={tp} does not divide {what}={n}{why}: use tp in {divisors(n)}")

    # -- counts, from the model itself (see the module docstring) --------------------------------
    def num_params(self) -> int:
        """Parameters, each counted once (a tied head is the embedding)."""
        return counts(self)["params"]

    def block_flops(self, block: int, seq_len: int) -> float:
        """Training FLOPs per token of block `block` at sequence length seq_len."""
        c = counts(self)
        return 6 * c["blocks"][block] + 12 * seq_len * self.n_head * self.head_dim

    def head_flops(self) -> float:
        """Training FLOPs per token of the final norm and the head."""
        return 6 * counts(self)["head"]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the whole model (MFU's numerator)."""
        return sum(self.block_flops(i, seq_len) for i in range(self.n_layer)) + self.head_flops()


def check_moe(cfg: ModelConfig) -> None:
    """The mixture of experts' settings on their own (the layout checks ep against them)."""
    if cfg.moe_experts == 0:
        return
    if cfg.moe_experts < 0:
        raise UserError(f"--moe-experts {cfg.moe_experts}: give the number of experts (>= 1), or 0 for a dense model")
    if not 1 <= cfg.moe_top_k <= cfg.moe_experts:
        raise UserError(f"--moe-top-k {cfg.moe_top_k}: each token picks between 1 and --moe-experts "
                        f"{cfg.moe_experts} experts")
    if cfg.moe_capacity < 0:
        raise UserError(f"--moe-capacity {cfg.moe_capacity}: a capacity factor is > 0 (e.g. 1.25), or 0 for dropless")
    if not 1 <= cfg.moe_every <= cfg.n_layer:
        raise UserError(f"--moe-every {cfg.moe_every}: every n-th block of {cfg.n_layer} is an MoE block, "
                        f"so n is between 1 and n_layer = {cfg.n_layer}")
    if cfg.moe_hidden < 0 or cfg.moe_aux < 0 or cfg.moe_bias_rate < 0:
        raise UserError("--moe-hidden, --moe-aux and --moe-bias-rate are >= 0")
    if cfg.moe_router not in ROUTERS:
        raise UserError(f"--moe-router {cfg.moe_router!r}: use {' or '.join(ROUTERS)}")
    if cfg.moe_balance not in BALANCES:
        raise UserError(f"--moe-balance {cfg.moe_balance!r}: use {' or '.join(BALANCES)} (the Switch loss, or "
                        f"DeepSeek-V3's per-expert bias)")


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

    def use_deterministic_attention(self) -> None:
        """Exact mode on GPU: torch's fused attention backwards add partial tiles with atomics (not
        bitwise repeatable); attention.py's Triton kernels add in a fixed order. On the CPU,
        torch's attention is already deterministic."""
        for block in self.blocks():
            block.attention().deterministic = True

    def use_fp8(self, recipe) -> None:
        """--fp8: the blocks' column- and row-parallel linears (attention's projections, the MLP)
        compute their three products in float8 (model/fp8.py's recipe). The embedding, the head,
        the norms and the router stay as they are, and so do a mixture's experts (plain nn.Linear
        run by the dispatch's grouped GEMM, which has no float8 path yet)."""
        for block in self.blocks():
            for m in block.modules():
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    m.fp8 = recipe

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


class Block(nn.Module):
    """A block: the family's `body(x, *block_inputs)`, run compiled in training under --compile
    (`compiled`: torch.compile(self.body), Stage.compile_blocks); `attention()`: its attention
    module, whose `cp` and `deterministic` the stage sets."""

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


# -- initialisation: one full tensor per parameter, from its own generator ---------------------------

def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def full_init(std: float | None, name: str, shape, seed: int, norm: bool) -> torch.Tensor:
    """The full fp32 initial tensor of parameter `name` (its tp = 1 shape), the same on any rank and
    any layout: N(0, std) from the parameter's own generator; std None: ones for a norm's weight
    (`norm`), else zeros."""
    if std is None:
        return torch.full(shape, 1.0 if norm else 0.0)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=g)
