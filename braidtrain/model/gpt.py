"""The GPT-2 family, readable top to bottom.

Pre-LayerNorm blocks, GELU (tanh), causal scaled-dot-product attention, token embedding tied to
the output head, vocabulary padded to a multiple of 128 (the padding rows exist so matrix shapes
are friendly, but their logits are cut off before the loss and sampling, so they are never
predicted). Parameter names follow HuggingFace's GPT-2 (h.0.attn.c_attn.weight ...), which keeps
export simple; weights are stored as nn.Linear does ((out, in)), the transpose of HF's Conv1D.

Initialisation does not depend on the layout: every parameter is drawn from its own generator,
seeded by (seed, parameter name), as one full tensor. A later tensor-parallel layout slices the
same full tensor, so tp=1 and tp=2 start from identical weights.
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

PRESETS = {  # name: (n_layer, n_head, n_embd, block_size)
    "tiny": (4, 4, 128, 256),
    "gpt2": (12, 12, 768, 1024),
    "gpt2-medium": (24, 16, 1024, 1024),
    "gpt2-large": (36, 20, 1280, 1024),
    "gpt2-xl": (48, 25, 1600, 1024),
}
LLMC_DEPTHS = {6: (384, 6), 12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25),
               60: (1920, 30), 72: (2880, 30), 84: (3456, 36)}  # llm.c's -e dN: depth -> (channels, heads)


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int  # the tokenizer's; the embedding is padded beyond it

    @property
    def padded_vocab(self) -> int:
        return (self.vocab_size + 127) // 128 * 128

    def num_params(self) -> int:
        """Parameters counted once (the tied head is the embedding)."""
        c, v, l = self.n_embd, self.padded_vocab, self.n_layer
        per_block = 12 * c * c + 13 * c
        return v * c + self.block_size * c + l * per_block + 2 * c

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight (forward + backward) plus attention's
        6 * 2 * n_layer * seq_len * n_embd for QK^T and AV (PaLM appendix B), embeddings excluded."""
        n = self.num_params() - self.padded_vocab * self.n_embd - self.block_size * self.n_embd
        return 6 * n + 6 * self.padded_vocab * self.n_embd + 12 * self.n_layer * seq_len * self.n_embd


def model_config(name: str, vocab_size: int, n_layer=None, n_head=None, n_embd=None, block_size=None) -> GPTConfig:
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
    return GPTConfig(nl, nh, ne, bs, vocab_size)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.recompute = False  # activation checkpointing: keep only each block's input

    def param_units(self):
        """Parameter groups for the data-parallel engine, in forward order: the embedding group
        (module None: the tied wte is used at both ends, with wpe and ln_f), then each block."""
        units = [(None, ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"])]
        return units + [(blk, [f"h.{i}.{n}" for n, _ in blk.named_parameters()]) for i, blk in enumerate(self.h)]

    def forward(self, idx, targets=None):
        """Returns the logits over the real vocabulary, or, given targets, the *sum* of the
        cross-entropy over all tokens (the caller divides once by the global token count)."""
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)  # recomputed in the backward pass
            else:
                x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., : self.cfg.vocab_size]
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


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
    """The full fp32 initial tensor of parameter `name`, the same on any rank and any layout."""
    std = init_std(cfg, name)
    if std is None:
        fill = 1.0 if (".ln_" in name or name.startswith("ln_f")) and name.endswith("weight") else 0.0
        return torch.full(shape, fill)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=g)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    for name, p in model.named_parameters():
        p.copy_(full_init(model.cfg, name, p.shape, seed))
