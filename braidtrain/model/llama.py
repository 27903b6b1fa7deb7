"""The Llama-3 family, readable top to bottom (Meta's Llama 3 and 3.1 / 3.2 shapes).

Pre-norm blocks with RMSNorm, rotary positions (RoPE, base theta 500,000, with Llama-3.1's
frequency scaling), grouped-query attention (n_kv_heads key/value heads, each serving
n_head/n_kv_heads query heads), a SwiGLU MLP of Llama's hidden width (8/3 n_embd times a
multiplier, rounded up to a multiple), no biases, and an output head of its own (tied to the
embedding as an option, as Llama-3.2 1B and 3B do). What every family shares -- the stage, its
forward, units, counts, init, the tp layers -- is protocol.py's and layers.py's.

Parameter names are HuggingFace's LlamaForCausalLM's without its `model.` prefix, except that the
projections a layer runs as one matmul are stored packed: q, k and v as `self_attn.qkv_proj`, the
MLP's gate and up as `mlp.gate_up_proj` (the HF adapter, llama_hf.py, splits and joins them):

    name                                 shape (out, in)        tp split (each rank its share of every part)
    embed_tokens.weight                  (V_pad, C)             vocab rows (x 128*tp pad)
    layers.N.input_layernorm.weight      (C,)                   replicated
    layers.N.self_attn.qkv_proj.weight   ((H + 2 K) D, C)       packed H : K : K heads, column-parallel
    layers.N.self_attn.o_proj.weight     (C, H D)               columns (row-parallel)
    layers.N.post_attention_layernorm    (C,)                   replicated
    layers.N.mlp.gate_up_proj.weight     (2 F, C)               packed 1 : 1, column-parallel
    layers.N.mlp.down_proj.weight        (C, F)                 columns (row-parallel)
    norm.weight                          (C,)                   replicated
    lm_head.weight (untied)              (V_pad, C)             vocab rows (x 128*tp pad)

H query heads, K key/value heads of D = C/H channels, F the MLP width. A tp rank holds H/tp query
heads and K/tp key/value heads: tp must divide K (a tp larger than K is refused -- replicating
key/value heads would make their gradients partial sums over tp, which this layout does not do).

RoPE (Su et al. 2021) in HF's convention: a head's channels are two halves (x1, x2), each
position p turns pair (x1_i, x2_i) by angle p * f_i: (x1 cos - x2 sin, x2 cos + x1 sin), with
f_i = theta^(-2i/D); Llama-3.1 divides the low frequencies (wavelength beyond
original_context / low_freq_factor) by `factor`, keeps the high ones (beyond / high_freq_factor) and
blends between. The angles are computed in fp32 from each token's position in its sequence --
under context parallelism its global position (parallel/context.py), so a cp rank's chunks turn as
they would whole -- and q and k are turned before attention, so only the K key/value heads travel
the cp ring, already turned.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from braidtrain.errors import UserError, divisors
from braidtrain.model import llama_hf
from braidtrain.model.layers import (ColumnParallelLinear, RMSNorm, RowParallelLinear, ShardSpec,
                                     VocabParallelEmbedding, attend)
from braidtrain.model.moe import MoE, SwiGLUExperts
from braidtrain.model.protocol import VOCAB_ALIGN, ModelConfig
from braidtrain.model.rmsnorm import add_rmsnorm, matmul_dtype, rmsnorm
from braidtrain.model.stage import Block as BlockBase, Blocks, Stage
from braidtrain.model.swiglu import swiglu

_3_1 = dict(rope_factor=8.0, block_size=131072)  # Llama-3.1: scaled RoPE, 128k context
_3_2 = dict(rope_factor=32.0, block_size=131072, tie_embeddings=True)
# Meta's published shapes (params.json: dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of)
PRESETS = {
    "llama3-tiny": dict(n_layer=4, n_head=4, n_kv_heads=2, n_embd=128, multiple_of=32, block_size=256, rope_factor=8.0,
                        rope_original=64),  # (scaled RoPE from 64 positions to 256, as 3.1 from 8k to 128k)
    "llama3.2-1b": dict(n_layer=16, n_head=32, n_kv_heads=8, n_embd=2048, ffn_multiplier=1.5, multiple_of=256, **_3_2),
    "llama3.2-3b": dict(n_layer=28, n_head=24, n_kv_heads=8, n_embd=3072, ffn_multiplier=1.0, multiple_of=256, **_3_2),
    "llama3.1-8b": dict(n_layer=32, n_head=32, n_kv_heads=8, n_embd=4096, ffn_multiplier=1.3, multiple_of=1024, **_3_1),
    "llama3.1-70b": dict(n_layer=80, n_head=64, n_kv_heads=8, n_embd=8192, ffn_multiplier=1.3, multiple_of=4096,
                         **_3_1),
    "llama3.1-405b": dict(n_layer=126, n_head=128, n_kv_heads=8, n_embd=16384, ffn_multiplier=1.2, multiple_of=4096,
                          **_3_1),
    # mixtures of SwiGLU experts: Mixtral's shape (8 experts, top 2, GQA, RoPE theta 1e6) CPU-sized and at
    # gpt2-moe's active size (768 wide, 12 layers; two experts of 2048 a token: gpt2-moe's two MLPs' parameters),
    # and a fine-grained one at that active size (64 experts of 512, top 8: DeepSeek's and Qwen3-MoE's kind)
    "mixtral-tiny": dict(n_layer=4, n_head=4, n_kv_heads=2, n_embd=128, multiple_of=32, block_size=256, rope_theta=1e6,
                         moe_experts=4, moe_top_k=2, moe_hidden=176),
    "mixtral-small": dict(n_layer=12, n_head=12, n_kv_heads=4, n_embd=768, block_size=1024, rope_theta=1e6,
                          moe_experts=8, moe_top_k=2, moe_hidden=2048),
    "finemoe-small": dict(n_layer=12, n_head=12, n_kv_heads=4, n_embd=768, block_size=1024, rope_theta=1e6,
                          moe_experts=64, moe_top_k=8, moe_hidden=512),
}

# the family's tokenizer (Llama-3's tiktoken BPE, 128,000 + 256 special tokens): the planner's default vocabulary
VOCAB = 128256

# The training recipe each preset brings: config.py's optimizer settings where neither the command
# line nor a config file gives them (config.py, "Recipes": its warmup shortened for a short run).
# Llama 3's, as torchtitan's llama3 configs train it: AdamW 0.9/0.95, weight decay 0.1, clipping at
# 1.0, peak lr 3e-4 from 1B to 8B, 1.5e-4 at 70B and 8e-5 at 405B (the Llama 3 paper's), a linear
# warmup of 200 steps (600 at 405B), then the Llama 2 paper's cosine decay to 10% of the peak. The
# mixtures take DeepSeek-V3's (paper and torchtitan's deepseek_v3 config: Mixtral and Qwen3-MoE
# publish none): the same but a peak of 2.2e-4. The CPU-sized presets (128 channels) take braidtrain's
# own tiny recipe, configs/tiny.toml's at its 2,048 tokens a step (lr 4e-3, warmup 50, cosine to 5%):
# a published peak is for a model of thousands of channels, and at 7.5e-5 (3e-4 at 4,096 tokens a
# step) a 128-channel model barely moved in 40 steps -- 12.23 to 12.15, noise above its first loss at
# step 9 (docs/performance.md, "Training recipes").
# The peak lr is the recipe's at its own batch, torchtitan's llama3 8B run: 65,536 tokens a step
# (8 GPUs x 1 x 8192). A step of fewer tokens has a noisier gradient, and Adam's steps do not
# shrink with it: config.py lowers the lr by sqrt(d / 65536) there (Adam's square-root scaling rule,
# Malladi et al. 2022), which a larger d never raises past the published peak.
LLAMA3 = dict(lr=3e-4, warmup_steps=200, final_lr_frac=0.1, weight_decay=0.1, grad_clip=1.0, beta1=0.9, beta2=0.95,
              batch_tokens=65536)
TINY = dict(LLAMA3, lr=4e-3, warmup_steps=50, final_lr_frac=0.05, batch_tokens=2048)
RECIPES = {  # preset: (the recipe's name, its settings)
    **{p: ("braidtrain tiny", TINY) for p in ("llama3-tiny", "mixtral-tiny")},
    **{p: ("llama3", LLAMA3) for p in ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b")},
    "llama3.1-70b": ("llama3 70B", dict(LLAMA3, lr=1.5e-4)),
    "llama3.1-405b": ("llama3 405B", dict(LLAMA3, lr=8e-5, warmup_steps=600)),
    **{p: ("deepseek-v3", dict(LLAMA3, lr=2.2e-4)) for p in ("mixtral-small", "finemoe-small")},
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    family = "llama3"
    mlp_name = "ffn_hidden"
    n_kv_heads: int = 0  # key/value heads (0: n_head, no grouping)
    ffn_hidden: int = 0  # the MLP width (0: Llama's rounding, from ffn_multiplier and multiple_of)
    ffn_multiplier: float = 1.0
    multiple_of: int = 256
    rope_theta: float = 500000.0
    rope_factor: float = 0.0  # Llama-3.1's frequency scaling (0: none), and its three settings
    rope_low_freq: float = 1.0
    rope_high_freq: float = 4.0
    rope_original: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3's)
    moe_shared: int = 0  # shared experts (of moe_hidden's width) that every token passes (DeepSeek's)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_head

    @property
    def mlp_width(self) -> int:
        """Llama's: 2/3 of 4 n_embd (SwiGLU's three matrices cost the MLP's two), times the
        multiplier, rounded up to a multiple of multiple_of (8B: 4096 -> 14336)."""
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(self.ffn_multiplier * int(2 * 4 * self.n_embd / 3))
        return -(-hidden // self.multiple_of) * self.multiple_of

    @property
    def tied(self) -> bool:
        return self.tie_embeddings

    def check(self) -> None:
        super().check()
        if self.n_kv_heads < 0 or self.n_head % self.kv_heads:
            raise UserError(f"n_head={self.n_head} is not divisible by n_kv_heads={self.n_kv_heads}: each key/value "
                            f"head serves a whole group of query heads; use n_kv_heads in {divisors(self.n_head)}")
        if self.head_dim % 2:
            raise UserError(f"head size n_embd / n_head = {self.head_dim} is odd: rotary positions turn channel pairs")
        if self.moe_shared < 0 or (self.moe_shared and not self.moe_experts):
            raise UserError(f"--moe-shared {self.moe_shared}: shared experts go beside routed ones (--moe-experts E)")


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """The D/2 rotation frequencies f_i = theta^(-2i/D) (fp32), Llama-3.1-scaled if rope_factor."""
    D = cfg.head_dim
    f = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)
    if not cfg.rope_factor:
        return f
    wavelength = 2 * math.pi / f
    long_, short = cfg.rope_original / cfg.rope_low_freq, cfg.rope_original / cfg.rope_high_freq
    blend = (cfg.rope_original / wavelength - cfg.rope_low_freq) / (cfg.rope_high_freq - cfg.rope_low_freq)
    blended = (1 - blend) * f / cfg.rope_factor + blend * f
    scaled = torch.where(wavelength > long_, f / cfg.rope_factor, f)
    return torch.where((wavelength >= short) & (wavelength <= long_), blended, scaled)


def rotate(x, cos, sin):
    """x (B, T, heads, D) turned by the angles whose cos and sin are (T, D/2); in fp32, back in x's
    dtype. (Turned before the heads move in front of T, as GPT-2's q and k are views of one
    projection: SDPA's output then keeps (B, T, H, D) storage, whose merge of the heads is free.)"""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: int = 1, group=None, sp: bool = False):
        super().__init__()
        H, K, D = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.n_head, self.n_kv, self.head_dim = H // tp, K // tp, D  # this rank's
        self.qkv_proj = ColumnParallelLinear(cfg.n_embd, (H + 2 * K) * D, group, bias=False, sp=sp, packed=(H, K, K))
        if cfg.qk_norm:  # (over D: the same weights for every head, so each tp rank's gradient is a part)
            self.q_norm = RMSNorm(D, cfg.norm_eps, tp_partial=True)
            self.k_norm = RMSNorm(D, cfg.norm_eps, tp_partial=True)
        self.o_proj = RowParallelLinear(H * D, cfg.n_embd, group, bias=False, sp=sp)
        self.cp, self.kernel = None, "sdpa"  # context parallelism, the attention kernel (Stage sets them)

    def forward(self, x, cos, sin):
        qkv = self.qkv_proj(x)  # (B, T, (H + 2K) D / tp): the whole T even under sp
        B, T, D = qkv.shape[0], qkv.shape[1], self.head_dim
        q, k, v = (z.view(B, T, -1, D) for z in qkv.split([self.n_head * D, self.n_kv * D, self.n_kv * D], dim=2))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (rotate(q, cos, sin), rotate(k, cos, sin), v))
        y = attend(q, k, v, self.cp, self.kernel)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * D))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate x) * up x), gate and up one packed matmul. With
    `fused_swiglu` (Stage.use_fused_kernels) silu(gate) * up is swiglu.py's operator, one kernel each
    way; else the plain expression (what torch.compile fuses itself, and --exact's bits)."""

    fused_swiglu = False

    def __init__(self, cfg: LlamaConfig, group=None, sp: bool = False, width: int | None = None):
        super().__init__()
        F_ = width or cfg.mlp_width
        self.gate_up_proj = ColumnParallelLinear(cfg.n_embd, 2 * F_, group, bias=False, sp=sp, packed=(1, 1))
        self.down_proj = RowParallelLinear(F_, cfg.n_embd, group, bias=False, sp=sp)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.fused_swiglu:
            return self.down_proj(swiglu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(BlockBase):
    """With `fused_norm` (Stage.use_fused_kernels) the norms are rmsnorm.py's operators: input_layernorm
    the plain one, the attention's residual add and post_attention_layernorm one add_rmsnorm; else
    layers.RMSNorm's autograd function (what torch.compile fuses itself, and --exact's bits). The same
    modules and weights either way."""

    fused_norm = False

    def __init__(self, cfg: LlamaConfig, tp: int = 1, group=None, sp: bool = False, moe=None):
        """`moe`: (this rank's experts, their dispatch) for a mixture of SwiGLU experts in place of the
        MLP (Mixtral, Qwen3-MoE; with cfg.moe_shared, DeepSeek's shared experts beside them)."""
        super().__init__()
        # whether each norm's output is read by matmuls alone (no tp collective, no mixture): _norm_dtype
        self.to_matmuls = (group is None, group is None and moe is None)
        self.input_layernorm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg, tp, group, sp)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        if moe is None:
            self.mlp = MLP(cfg, group, sp)
        else:
            shared = MLP(cfg, group, sp, cfg.moe_shared * cfg.moe_width) if cfg.moe_shared else None
            self.mlp = MoE(cfg, *moe, expert=SwiGLUExperts, shared=shared)

    def attention(self):
        return self.self_attn

    def body(self, x, cos, sin):
        if self.fused_norm:
            n1, n2 = self.input_layernorm, self.post_attention_layernorm
            a = self.self_attn(rmsnorm(x, n1.weight, n1.eps, _norm_dtype(x, n1.weight, self.to_matmuls[0])), cos, sin)
            x, y = add_rmsnorm(x, a, n2.weight, n2.eps, _norm_dtype(x, n2.weight, self.to_matmuls[1]))
            return x + self.mlp(y)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def _norm_dtype(x, w, to_matmuls: bool):
    """A fused norm's output dtype: where matmuls alone read it, the one they compute in (autocast's
    bf16: written once, as their casts would round it); else x's and w's promoted, as layers.RMSNorm
    gives -- under tp the output's gradient is summed over the ranks, and a mixture sums each token's
    experts' and router's gradients, in that dtype: fp32, as without the operator."""
    return matmul_dtype(x, w) if to_matmuls else None


class Head(nn.Module):
    """An untied output head: this tp rank's rows of the (padded) vocabulary, (V_pad/tp, C); the
    stage's forward uses the weight (loss.py's fused head, or the vocab-parallel cross-entropy)."""

    def __init__(self, rows: int, n_embd: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, n_embd))
        self.tp_split = {"weight": ShardSpec(0, "contiguous", VOCAB_ALIGN)}


class Llama(Stage):
    """Llama-3, or a pipeline chunk of it (protocol.Stage): the token embedding on the first chunk,
    the final norm and the head on the last (tied: a copy of the embedding there)."""

    blocks_attr = "layers"
    embedding_name = "embed_tokens.weight"
    fused_norm = False  # the final norm as rmsnorm.py's operator (Stage.use_fused_kernels; Block's docstring)

    def __init__(self, cfg: LlamaConfig, mesh=None, sp: bool = False, blocks: range | None = None,
                 first: bool = True, last: bool = True, stage: int = 0, dispatch=None):
        super().__init__(cfg, mesh, sp, first, last, stage, dispatch)
        if first or (last and cfg.tied):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_rows(self.tp), cfg.n_embd, self.group, self.sp,
                                                       align=VOCAB_ALIGN)
        mine = self.my_experts()
        mixture = lambda i: (mine, self.dispatch) if cfg.is_moe(i) else None
        self.layers = Blocks({str(i): Block(cfg, self.tp, self.group, self.sp, mixture(i))
                              for i in (range(cfg.n_layer) if blocks is None else blocks)})
        if last:
            self.norm = RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
            if not cfg.tied:
                self.lm_head = Head(cfg.vocab_rows(self.tp) // self.tp, cfg.n_embd)
        self.register_buffer("frequencies", rope_frequencies(cfg), persistent=False)
        self._tables: dict = {}

    def embed(self, inp, pos):
        return self.embed_tokens(inp)

    def block_inputs(self, pos) -> tuple:
        """The rotation's cos and sin (T, D/2) at these positions, fp32; kept per positions tensor
        (the same tensor every step: a CUDA graph replays them)."""
        key = (pos.shape[0], pos.device, self.cp is not None and self.cp.active)
        if key not in self._tables:
            angles = pos.float()[:, None] * self.frequencies.to(pos.device)[None, :]
            self._tables[key] = (angles.cos(), angles.sin())
        return self._tables[key]

    def final_norm(self, x):
        if self.fused_norm:
            return rmsnorm(x, self.norm.weight, self.norm.eps, _norm_dtype(x, self.norm.weight, self.group is None))
        return self.norm(x)

    def head_weight(self):
        return self.embed_tokens.weight if self.cfg.tied else self.lm_head.weight

    def embed_names(self) -> list[str]:
        return ["embed_tokens.weight"]

    def head_names(self) -> list[str]:
        return ["norm.weight"] + ([] if self.cfg.tied else ["lm_head.weight"])


LlamaConfig.model = Llama
Model, Config = Llama, LlamaConfig


def init_std(cfg: LlamaConfig, name: str) -> float | None:
    """torchtitan's llama3 initialisation, the one Llama 3's recipe (RECIPES) is published with: the
    token embedding N(0, 1), the untied head N(0, 1/sqrt(n_embd)) (logits of spread 1), layer l's
    residual projections (o_proj, down_proj) N(0, 0.02 / sqrt(2 (l + 1))), every other matrix
    N(0, 0.02); None: ones (the RMSNorms). The embedding at 1 is what keeps the early steps sane:
    the residual stream is then the token's own vector plus the blocks' small outputs, where an
    embedding of 0.02 (HuggingFace's, and braidtrain's before) left it made of the blocks' outputs
    alone, which Adam's first steps turn wholesale -- at 3B and 8B the loss rose from 12.4 to 16
    around step 10 (docs/performance.md, "Training recipes"). A tied head (the 3.2 presets) reads
    the embedding as the output too: there it stays N(0, 0.02) (at 1, every token would predict
    itself at a logit of sqrt(n_embd))."""
    if name.endswith("norm.weight"):
        return None
    if name == "embed_tokens.weight":
        return 0.02 if cfg.tied else 1.0
    if name == "lm_head.weight":
        return cfg.n_embd ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1))
    return 0.02


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


# The family's HuggingFace adapter (protocol.py): llama_hf.py
MODEL_TYPES, ARCHITECTURES = llama_hf.MODEL_TYPES, llama_hf.ARCHITECTURES
to_hf, from_hf, fuse = llama_hf.to_hf, llama_hf.from_hf, llama_hf.fuse
hf_config, config_from_hf = llama_hf.hf_config, llama_hf.config_from_hf
