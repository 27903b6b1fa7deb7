"""The GPT-2 family, readable top to bottom.

Pre-LayerNorm blocks, GELU (tanh), causal scaled-dot-product attention, token embedding tied to
the output head, vocabulary padded to a multiple of 128 (the padding rows exist so matrix shapes
are friendly, but their logits are cut off before the loss and sampling, so they are never
predicted). Parameter names follow HuggingFace's GPT-2 (h.0.attn.c_attn.weight ...), which keeps
export simple; weights are stored as nn.Linear does ((out, in)), the transpose of HF's Conv1D.

Initialisation does not depend on the layout: every parameter is drawn from its own generator,
seeded by (seed, parameter name), as one full tensor, and a tensor-parallel rank takes its slice of
that same tensor (the placement table says how), so tp=1 and tp=2 start from identical weights.

Tensor parallelism (GPT(cfg, mesh) with the mesh's tp axis > 1; layers.py has the pieces), in
Megatron-LM's layout (Shoeybi et al. 2019). Parameter names do not change, only the local shapes:

    tp rank r holds                                    tp_split (the layer declares it)
    wte         vocab rows [r V/tp, (r+1) V/tp)        (0, contiguous)  also the tied head's shard
    c_attn      its n_head/tp heads of q, k and v      (0, qkv)         column-parallel
    attn.c_proj input features of those heads          (1, contiguous)  row-parallel
    mlp.c_fc    output features [r 4C/tp, (r+1) 4C/tp) (0, contiguous)  column-parallel
    mlp.c_proj  the same input features                (1, contiguous)  row-parallel
    wpe, LayerNorms, row-parallel biases: all of it    replicated

The vocabulary is padded to a multiple of 128*tp, so that every rank holds the same number of rows
(wte's split has align 128: the placement table pads and cuts those zero rows).
With sequence parallelism (sp, Korthikanti et al. 2022) the residual stream between the tp regions
-- embeddings, LayerNorms, residual additions -- holds only this rank's T/tp rows of the sequence:

    x (B, T/tp, C) -> ln -> all-gather T -> c_attn | attention | c_proj -> reduce-scatter T -> + x
                               (B, T, C)     (this rank's heads)          (B, T/tp, C)
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from braidtrain.errors import UserError
from braidtrain.layout import check_tp
from braidtrain.model.attention import causal_attention
from braidtrain.model.loss import head_loss
from braidtrain.model.moe import MoE
from braidtrain.parallel.expert import Dispatch
from braidtrain.model.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, enter_tp,
                                     gather_last_dim, vocab_parallel_cross_entropy)

PRESETS = {  # name: (n_layer, n_head, n_embd, block_size)
    "tiny": (4, 4, 128, 256),
    "gpt2": (12, 12, 768, 1024),
    "gpt2-medium": (24, 16, 1024, 1024),
    "gpt2-large": (36, 20, 1280, 1024),
    "gpt2-xl": (48, 25, 1600, 1024),
}
VOCAB_ALIGN = 128  # the vocabulary is padded to a multiple of this (times tp)
LLMC_DEPTHS = {6: (384, 6), 12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25),
               60: (1920, 30), 72: (2880, 30), 84: (3456, 36)}  # llm.c's -e dN: depth -> (channels, heads)


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int  # the tokenizer's; the embedding is padded beyond it
    # a mixture of experts (model/moe.py) in place of the MLP of every moe_every-th block (0, n, 2n, ...)
    moe_experts: int = 0  # 0: dense
    moe_top_k: int = 2
    moe_every: int = 1
    moe_hidden: int = 0  # an expert's width (0: the dense MLP's, 4 n_embd)
    moe_capacity: float = 0.0  # capacity factor; 0: dropless
    moe_aux: float = 0.01  # the load-balancing loss's coefficient

    @property
    def moe_width(self) -> int:
        return self.moe_hidden or 4 * self.n_embd

    def is_moe(self, block: int) -> bool:
        return self.moe_experts > 0 and block % self.moe_every == 0

    def block_params(self, block: int, active: bool = False) -> int:
        """Parameters of block `block` (active: those one token uses -- its top-k experts)."""
        c = self.n_embd
        if not self.is_moe(block):
            return 12 * c * c + 13 * c
        expert = 2 * c * self.moe_width + self.moe_width + c
        return 4 * c * c + 8 * c + self.moe_experts * c + (self.moe_top_k if active else self.moe_experts) * expert

    @property
    def padded_vocab(self) -> int:
        return self.vocab_rows(1)

    def vocab_rows(self, tp: int = 1) -> int:
        """Rows of the embedding: the vocabulary padded to a multiple of 128*tp."""
        return -(-self.vocab_size // (VOCAB_ALIGN * tp)) * VOCAB_ALIGN * tp

    def num_params(self) -> int:
        """Parameters counted once (the tied head is the embedding)."""
        c, v = self.n_embd, self.padded_vocab
        return v * c + self.block_size * c + sum(self.block_params(i) for i in range(self.n_layer)) + 2 * c

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight (forward + backward) plus attention's
        6 * 2 * n_layer * seq_len * n_embd for QK^T and AV (PaLM appendix B), embeddings excluded;
        of a mixture of experts, the parameters a token uses (its top-k experts)."""
        n = sum(self.block_params(i, active=True) for i in range(self.n_layer)) + 2 * self.n_embd
        return 6 * n + 6 * self.padded_vocab * self.n_embd + 12 * self.n_layer * seq_len * self.n_embd


def model_config(name: str, vocab_size: int, n_layer=None, n_head=None, n_embd=None, block_size=None,
                 **moe) -> GPTConfig:
    """A preset (or llm.c's dN) with these sizes overriding it; `moe`: GPTConfig's moe_* fields."""
    if name in PRESETS:
        base = PRESETS[name]
    elif name[1:].isdigit() and int(name[1:]) in LLMC_DEPTHS:  # llm.c's -e dN
        channels, heads = LLMC_DEPTHS[int(name[1:])]
        base = (int(name[1:]), heads, channels, 1024)
    else:
        depths = ", ".join(f"d{d}" for d in LLMC_DEPTHS)
        raise UserError(f"unknown model '{name}': use one of {', '.join(PRESETS)}, or llm.c's {depths}")
    nl, nh, ne, bs = (a if a is not None else b for a, b in zip((n_layer, n_head, n_embd, block_size), base))
    if ne % nh:
        raise UserError(f"n_embd={ne} is not divisible by n_head={nh}")
    cfg = GPTConfig(nl, nh, ne, bs, vocab_size, **{k: v for k, v in moe.items() if v is not None})
    check_moe(cfg)
    return cfg


def check_moe(cfg: GPTConfig) -> None:
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
    if cfg.moe_hidden < 0 or cfg.moe_aux < 0:
        raise UserError("--moe-hidden and --moe-aux are >= 0")


class Attention(nn.Module):
    deterministic = False  # exact mode on GPU: attention.causal_attention (GPT.use_deterministic_attention)
    cp = None  # context parallelism (parallel/context.py's Context): attention over the whole sequence

    def __init__(self, cfg: GPTConfig, tp: int = 1, group=None, sp: bool = False):
        super().__init__()
        self.n_head = cfg.n_head // tp  # this rank's heads
        self.c_attn = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, group, sp=sp, packed=3)
        self.c_proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, group, sp=sp)

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3C/tp): this rank's heads of q, k, v; the whole T even under sp
        B, T, C = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.cp is not None and self.cp.active:
            y = self.cp.attend(q, k, v)
        elif self.deterministic:
            y = causal_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, group=None, sp: bool = False):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, group, sp=sp)
        self.c_proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, group, sp=sp)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: int = 1, group=None, sp: bool = False, moe=None):
        """`moe`: (this rank's experts, their dispatch) for a mixture of experts in place of the MLP."""
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg, tp, group, sp)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg, group, sp) if moe is None else MoE(cfg, *moe)

    compiled = None  # torch.compile(self.body) under --compile (GPT.compile_blocks)

    def forward(self, x):
        if self.compiled is not None and torch.is_grad_enabled():  # training; eval, sampling: eager
            return self.compiled(x)
        return self.body(x)

    def body(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


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
    identity; backward hands the head's gradient of wte to `sink` (the engine, which adds it to
    the lookup's once per step) and gives autograd none. Exact mode does this in every layout, so
    that the two uses' sums are the same whether one rank holds both or two stages hold one each."""

    @staticmethod
    def forward(ctx, w, sink):
        ctx.sink = sink
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None


class GPT(nn.Module):
    """The whole model, or one pipeline stage (chunk number `stage`) of it: the blocks `blocks`
    (default all), the embeddings if `first`, the final LayerNorm and the head if `last` (a stage
    that is last but not first holds its own copy of the tied wte for the head)."""

    def __init__(self, cfg: GPTConfig, mesh=None, sp: bool = False, blocks: range | None = None,
                 first: bool = True, last: bool = True, stage: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tp = 1 if mesh is None else mesh.size("tp")
        self.tp_rank = 0 if mesh is None else mesh.coord("tp")
        check_tp(cfg, self.tp)
        self.sp = sp and self.tp > 1
        self.group = mesh.groups["tp"] if self.tp > 1 else None  # None: plain dense layers
        self.first, self.last, self.stage = first, last, stage  # stage: its place in the pipeline's chunks
        if first or last:
            self.wte = VocabParallelEmbedding(cfg.vocab_rows(self.tp), cfg.n_embd, self.group, self.sp, align=VOCAB_ALIGN)
        if first:
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        ep = mesh is not None and "ep" in mesh.groups and mesh.size("ep") > 1
        self.dispatch = Dispatch(mesh.groups["ep"] if ep else None)  # (exact mode: build sets .exact)
        mine = self.dispatch.experts_of(cfg.moe_experts, mesh.coord("ep") if ep else 0)
        self.h = Blocks({str(i): Block(cfg, self.tp, self.group, self.sp, (mine, self.dispatch) if cfg.is_moe(i) else None)
                         for i in (range(cfg.n_layer) if blocks is None else blocks)})
        if last:
            self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.recompute = False  # activation checkpointing: keep only each block's input
        self.head_sink = None  # exact mode: where the head's gradient of wte goes (TiedHead)
        self.cp = None  # context parallelism: this rank holds its chunks of each sequence (use_context)

    def use_context(self, cp) -> None:
        """Context parallelism (parallel/context.py): inputs are this rank's tokens of each
        sequence, at cp.positions; attention runs over the whole sequence through `cp`."""
        self.cp = cp
        for block in self.h:
            block.attn.cp = cp

    def moe_layers(self) -> list:
        return [block.mlp for block in self.h if isinstance(block.mlp, MoE)]

    def use_deterministic_attention(self) -> None:
        """Exact mode on GPU: torch's fused attention backwards add partial tiles with atomics (not
        bitwise repeatable); attention.py's Triton kernels add in a fixed order. On the CPU,
        torch's attention is already deterministic."""
        for block in self.h:
            block.attn.deterministic = True

    def compile_blocks(self) -> None:
        """--compile: each block becomes one torch.compile'd function, for training (grad
        enabled); the head and loss are loss.py's fused kernel already. Block by block rather
        than the whole model, so each block's backward is still its own autograd node: its
        gradients are complete -- and their bucket's reduction can start -- while earlier blocks
        are still in the backward pass.
        Module hooks (ZeRO-3's gathers) stay outside the compiled code. tp = 1 only (layout.py
        says so): the tp layers' collectives are not traceable yet."""
        for block in self.h:
            block.compiled = torch.compile(block.body)

    def param_units(self):
        """Parameter groups for the data-parallel engine, in forward order: the embedding group
        (module None: the tied wte is used at both ends, with wpe and ln_f; on a pipeline's first
        stage wte and wpe), then each block; a last stage that is not the first ends with ln_f and
        its copy of wte."""
        units = [(None, ["wte.weight", "wpe.weight"] + (["ln_f.weight", "ln_f.bias"] if self.last else []))] if self.first else []
        units += [(blk, [f"h.{i}.{n}" for n, _ in blk.named_parameters()]) for i, blk in self.h.items()]
        return units + ([(None, ["ln_f.weight", "ln_f.bias", "wte.weight"])] if self.last and not self.first else [])

    def tied_users(self) -> dict[str, tuple[str, ...]]:
        """Parameters used in more than one place, and which of those uses this model holds: the
        embedding's lookup (first stage) and the output head (last)."""
        uses = ("lookup",) * self.first + ("head",) * self.last
        return {"wte.weight": uses} if uses else {}

    def copies(self) -> set[str]:
        """Parameters this model holds as a copy of another stage's: a last stage's wte, for the
        head (kept bitwise equal to the first stage's: the same gradient, the same update)."""
        return {"wte.weight"} if self.last and not self.first else set()

    def forward(self, inp, targets=None):
        """`inp`: token ids on the first stage, else the previous stage's output. Returns that
        output for the next stage; on the last, the logits over the real vocabulary, or, given
        targets, the *sum* of the cross-entropy over all tokens (the caller divides once by the
        global token count). Under tp every rank returns the same full sum (and the same full
        logits)."""
        if self.first:
            T = inp.shape[1]
            whole = self.cp is None or not self.cp.active
            pos = torch.arange(T, device=inp.device) if whole else self.cp.positions(T, inp.device)
            if self.sp:
                check_tp(self.cfg, self.tp, self.sp, T)
                pos = pos.chunk(self.tp)[self.tp_rank]  # the residual stream holds this rank's T/tp rows
            x = self.wte(inp) + self.wpe(pos)
        else:
            x = inp
        for block in self.h:
            if self.recompute and torch.is_grad_enabled():
                # recomputed in the backward pass; the model draws no random numbers, so there is no RNG
                # state to carry over (and reading it would break a CUDA graph capture)
                x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
            else:
                x = block(x)
        if not self.last:
            return x
        w = self.wte.weight if self.head_sink is None else TiedHead.apply(self.wte.weight, self.head_sink)
        if self.group is None:
            if targets is None:
                return F.linear(self.ln_f(x), w)[..., : self.cfg.vocab_size]
            return head_loss(self.ln_f(x), w, targets, self.cfg.vocab_size)
        # the tied head, column-parallel over the vocabulary: (B, T, V/tp) of this rank's rows
        logits = F.linear(enter_tp(self.ln_f(x), self.group, self.sp), w)
        if targets is None:
            return gather_last_dim(logits, self.group)[..., : self.cfg.vocab_size]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.wte.vocab_start,
                                              self.cfg.vocab_size, self.group)
        return losses.sum()


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_std(cfg: GPTConfig, name: str) -> float | None:
    """GPT-2's initialisation: N(0, 0.02) for weights, residual projections scaled by
    1/sqrt(2 n_layer) (two residual additions a block); None means zeros (biases) or ones (LN)."""
    if name.endswith(".bias") or ".ln_" in name or name.startswith("ln_f"):
        return None
    if name.endswith("c_proj.weight"):
        return 0.02 / math.sqrt(2 * cfg.n_layer)
    return 0.02


def full_init(cfg: GPTConfig, name: str, shape, seed: int) -> torch.Tensor:
    """The full fp32 initial tensor of parameter `name` (its tp = 1 shape), the same on any rank
    and any layout."""
    std = init_std(cfg, name)
    if std is None:
        fill = 1.0 if (".ln_" in name or name.startswith("ln_f")) and name.endswith("weight") else 0.0
        return torch.full(shape, fill)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=g)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Each parameter is this tp rank's slice of its full, layout-independent initial tensor
    (under tp, wte's further padding rows are zeros: never looked up nor predicted)."""
    from braidtrain.parallel import placement

    table = placement.build(model)
    for name, p in model.named_parameters():
        e = table[name]
        p.copy_(e.shard(full_init(model.cfg, name, e.shape, seed), model.tp_rank, model.tp))


def pipeline_chunks(cfg: GPTConfig, split, pp: int, r: int, mesh=None, sp: bool = False) -> list[GPT]:
    """Pipeline rank r's chunks r, r + pp, ... of the model cut into `split` (the blocks of each
    chunk: parallel/pipeline.py); the first chunk holds the embeddings, the last the head."""
    last = len(split) - 1
    return [GPT(cfg, mesh, sp, split[c], first=c == 0, last=c == last, stage=c) for c in range(r, last + 1, pp)]
