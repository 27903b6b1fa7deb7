"""The Llama-3 family, readable top to bottom (Meta's Llama 3 and 3.1 / 3.2 shapes).

Pre-norm blocks with RMSNorm, rotary positions (RoPE, base theta 500,000, with Llama-3.1's
frequency scaling), grouped-query attention (n_kv_heads key/value heads, each serving
n_head/n_kv_heads query heads), a SwiGLU MLP of Llama's hidden width (8/3 n_embd times a
multiplier, rounded up to a multiple), no biases, and an output head of its own (tied to the
embedding as an option, as Llama-3.2 1B and 3B do). What every family shares -- the stage, its
forward, units, counts, init, the tp layers -- is protocol.py's and layers.py's.

Parameter names are HuggingFace's LlamaForCausalLM's without its `model.` prefix, except that the
projections a layer runs as one matmul are stored packed: q, k and v as `self_attn.qkv_proj`, the
MLP's gate and up as `mlp.gate_up_proj` (the HF adapter below splits and joins them):

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
from braidtrain.model.layers import (ColumnParallelLinear, RMSNorm, RowParallelLinear, ShardSpec,
                                     VocabParallelEmbedding, attend)
from braidtrain.model.moe import MoE, SwiGLUExperts
from braidtrain.model.protocol import VOCAB_ALIGN, Block as BlockBase, Blocks, ModelConfig, Stage

_3_1 = dict(rope_factor=8.0, block_size=131072)  # Llama-3.1: scaled RoPE, 128k context
_3_2 = dict(rope_factor=32.0, block_size=131072, tie_embeddings=True)
PRESETS = {  # Meta's published shapes (params.json: dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of)
    "llama3-tiny": dict(n_layer=4, n_head=4, n_kv_heads=2, n_embd=128, multiple_of=32, block_size=256, rope_factor=8.0,
                        rope_original=64),  # (scaled RoPE from 64 positions to 256, as 3.1 from 8k to 128k)
    "llama3.2-1b": dict(n_layer=16, n_head=32, n_kv_heads=8, n_embd=2048, ffn_multiplier=1.5, multiple_of=256, **_3_2),
    "llama3.2-3b": dict(n_layer=28, n_head=24, n_kv_heads=8, n_embd=3072, ffn_multiplier=1.0, multiple_of=256, **_3_2),
    "llama3.1-8b": dict(n_layer=32, n_head=32, n_kv_heads=8, n_embd=4096, ffn_multiplier=1.3, multiple_of=1024, **_3_1),
    "llama3.1-70b": dict(n_layer=80, n_head=64, n_kv_heads=8, n_embd=8192, ffn_multiplier=1.3, multiple_of=4096, **_3_1),
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

VOCAB = 128256  # the family's tokenizer (Llama-3's tiktoken BPE, 128,000 + 256 special tokens): the planner's default vocabulary


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
            self.q_norm, self.k_norm = RMSNorm(D, cfg.norm_eps, tp_partial=True), RMSNorm(D, cfg.norm_eps, tp_partial=True)
        self.o_proj = RowParallelLinear(H * D, cfg.n_embd, group, bias=False, sp=sp)
        self.cp, self.deterministic = None, False  # context parallelism, exact mode on GPU (Stage sets them)

    def forward(self, x, cos, sin):
        qkv = self.qkv_proj(x)  # (B, T, (H + 2K) D / tp): the whole T even under sp
        B, T, D = qkv.shape[0], qkv.shape[1], self.head_dim
        q, k, v = (z.view(B, T, -1, D) for z in qkv.split([self.n_head * D, self.n_kv * D, self.n_kv * D], dim=2))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (rotate(q, cos, sin), rotate(k, cos, sin), v))
        y = attend(q, k, v, self.cp, self.deterministic)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * D))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate x) * up x), gate and up one packed matmul."""

    def __init__(self, cfg: LlamaConfig, group=None, sp: bool = False, width: int | None = None):
        super().__init__()
        F_ = width or cfg.mlp_width
        self.gate_up_proj = ColumnParallelLinear(cfg.n_embd, 2 * F_, group, bias=False, sp=sp, packed=(1, 1))
        self.down_proj = RowParallelLinear(F_, cfg.n_embd, group, bias=False, sp=sp)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(BlockBase):
    def __init__(self, cfg: LlamaConfig, tp: int = 1, group=None, sp: bool = False, moe=None):
        """`moe`: (this rank's experts, their dispatch) for a mixture of SwiGLU experts in place of the
        MLP (Mixtral, Qwen3-MoE; with cfg.moe_shared, DeepSeek's shared experts beside them)."""
        super().__init__()
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
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def __init__(self, cfg: LlamaConfig, mesh=None, sp: bool = False, blocks: range | None = None,
                 first: bool = True, last: bool = True, stage: int = 0, dispatch=None):
        super().__init__(cfg, mesh, sp, first, last, stage, dispatch)
        if first or (last and cfg.tied):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_rows(self.tp), cfg.n_embd, self.group, self.sp,
                                                       align=VOCAB_ALIGN)
        mine = self.my_experts()
        self.layers = Blocks({str(i): Block(cfg, self.tp, self.group, self.sp, (mine, self.dispatch) if cfg.is_moe(i) else None)
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
    """N(0, 0.02) for every weight (HF's initializer_range), the residual projections (o_proj,
    down_proj) scaled by 1/sqrt(2 n_layer) as GPT-2's; None: ones (the RMSNorms)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.02 / math.sqrt(2 * cfg.n_layer)
    return 0.02


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


# -- HuggingFace: LlamaForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM -----------
#
#     ours                                   HF (under `model.`; lm_head.weight at the top)
#     embed_tokens.weight (V_pad, C)         embed_tokens.weight (V, C)        padding rows cut off
#     layers.N.self_attn.qkv_proj.weight     layers.N.self_attn.{q,k,v}_proj.weight, split by rows
#     layers.N.mlp.gate_up_proj.weight       layers.N.mlp.{gate,up}_proj.weight, split by rows
#     layers.N.mlp.router.weight             Mixtral: layers.N.block_sparse_moe.gate.weight; Qwen3-MoE:
#                                            layers.N.mlp.gate.weight
#     layers.N.mlp.experts.gate_up_proj      Mixtral: ...block_sparse_moe.experts.E.{w1,w3}.weight (gate, up)
#       .weight (E, 2H, C), .down_proj       for each expert E; w2 the down projection; Qwen3-MoE:
#       .weight (E, C, H)                    ...mlp.experts.E.{gate,up,down}_proj (transformers 5's fused
#                                            experts.gate_up_proj / down_proj, our layout, are read too)
#     everything else                        the same name (q_norm, k_norm: Qwen3's)
#
# The architecture is the model's: experts make it Mixtral, or Qwen3-MoE with a qk-norm (or some
# dense layers); a qk-norm alone Qwen3; else Llama.

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral",
               "Qwen3MoeForCausalLM": "qwen3_moe"}
ARCHITECTURES = tuple(MODEL_TYPES)


def architecture(cfg: LlamaConfig) -> str:
    if cfg.moe_shared:
        raise UserError("shared experts (--moe-shared) have no HuggingFace architecture braidtrain writes: export a "
                        "model without them")
    if not cfg.moe_experts:
        return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    if cfg.qk_norm or cfg.moe_every > 1 or not cfg.moe_renorm:
        return "Qwen3MoeForCausalLM"
    return "MixtralForCausalLM"


def _hf_block(arch: str, name: str, cfg: LlamaConfig, e: int = 0):
    """[(HF name, rows)] of our block parameter `name` (after `layers.N.`; of a stack of experts,
    expert e's slice): its parts, split by rows."""
    D, mix = cfg.head_dim, arch == "MixtralForCausalLM"
    if name == "self_attn.qkv_proj.weight":
        return [(f"self_attn.{x}_proj.weight", w) for x, w in zip("qkv", (cfg.n_head * D, cfg.kv_heads * D, cfg.kv_heads * D))]
    if name == "mlp.gate_up_proj.weight":
        return [("mlp.gate_proj.weight", cfg.mlp_width), ("mlp.up_proj.weight", cfg.mlp_width)]
    if name == "mlp.router.weight":
        return [("block_sparse_moe.gate.weight" if mix else "mlp.gate.weight", None)]
    if name.startswith("mlp.experts."):
        at = f"block_sparse_moe.experts.{e}." if mix else f"mlp.experts.{e}."
        if name == "mlp.experts.gate_up_proj.weight":
            return [(at + ("w1.weight" if mix else "gate_proj.weight"), cfg.moe_width),
                    (at + ("w3.weight" if mix else "up_proj.weight"), cfg.moe_width)]
        return [(at + ("w2.weight" if mix else "down_proj.weight"), None)]
    return [(name, None)]


def _slices(rest: str, t) -> list:
    """(e, tensor) of our block parameter: each expert's slice of a stack, else (0, it)."""
    return list(enumerate(t)) if rest.startswith("mlp.experts.") else [(0, t)]


def to_hf(params: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF's tensors from ours (the vocabulary's padding already cut)."""
    arch, out = architecture(cfg), {}
    for name, t in params.items():
        if not name.startswith("layers."):
            out[name if name == "lm_head.weight" else f"model.{name}"] = t
            continue
        _, i, rest = name.split(".", 2)
        for e, w in _slices(rest, t):
            parts = _hf_block(arch, rest, cfg, e)
            pieces = w.split([r for _, r in parts]) if len(parts) > 1 else [w]
            for (hf, _), piece in zip(parts, pieces):
                out[f"model.layers.{i}.{hf}"] = piece
    return out


def _unfuse(got: dict, arch: str) -> dict:
    """transformers 5's experts as they are in memory (mlp.gate, mlp.experts.gate_up_proj (E, 2H, C),
    mlp.experts.down_proj (E, C, H)) as the per-expert names its save_pretrained writes."""
    mix = arch == "MixtralForCausalLM"
    for key in [k for k in got if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        fused, layer = got.pop(key), key.split(".mlp.")[0]
        at = f"{layer}.block_sparse_moe.experts" if mix else f"{layer}.mlp.experts"
        if mix and f"{layer}.mlp.gate.weight" in got:
            got[f"{layer}.block_sparse_moe.gate.weight"] = got.pop(f"{layer}.mlp.gate.weight")
        for e, w in enumerate(fused):
            if key.endswith("gate_up_proj"):
                gate, up = w.chunk(2)
                got[f"{at}.{e}.{'w1' if mix else 'gate_proj'}.weight"] = gate
                got[f"{at}.{e}.{'w3' if mix else 'up_proj'}.weight"] = up
            else:
                got[f"{at}.{e}.{'w2' if mix else 'down_proj'}.weight"] = w
    return got


def fuse(tensors: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """to_hf's tensors as transformers 5 holds a mixture in memory (_unfuse's inverse): per MoE
    layer mlp.gate.weight, and the experts fused, mlp.experts.gate_up_proj (E, 2H, C) and down_proj
    (E, C, H) -- our stacks -- for a model built in memory (bench's hf yardstick), not read from a
    folder (transformers converts those itself)."""
    mix, out = architecture(cfg) == "MixtralForCausalLM", dict(tensors)
    at, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mix else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    for layer in (f"model.layers.{i}" for i in range(cfg.n_layer) if cfg.is_moe(i)):
        gate, up, down = ([out.pop(f"{layer}.{at}.experts.{e}.{w}.weight") for e in range(cfg.moe_experts)] for w in names)
        out[f"{layer}.mlp.gate.weight"] = out.pop(f"{layer}.{at}.gate.weight")
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack(down)
    return out


def from_hf(tensors: dict[str, torch.Tensor], cfg: LlamaConfig, where: str) -> dict[str, torch.Tensor]:
    """Our tensors (unpadded vocabulary) from HF's, by the names to_hf writes; the registry checks
    names and shapes."""
    arch = architecture(cfg)
    got = _unfuse({k.removeprefix("model."): v for k, v in tensors.items()}, arch)
    if cfg.tied:
        head = got.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, got.get("embed_tokens.weight", head)):
            raise UserError(f"{where}: lm_head.weight differs from embed_tokens.weight, but config.json ties them")
    with torch.device("meta"):
        names = [n for n, _ in Llama(cfg).named_parameters()]
    out = {n: got.pop(n) for n in names if not n.startswith("layers.") and n in got}
    for name in (n for n in names if n.startswith("layers.")):
        _, i, rest = name.split(".", 2)
        slices = []
        for e in range(cfg.moe_experts if rest.startswith("mlp.experts.") else 1):
            parts = [f"layers.{i}.{hf}" for hf, _ in _hf_block(arch, rest, cfg, e)]
            missing = [p for p in parts if p not in got]
            if missing:
                raise UserError(f"{where}: model.safetensors has no model.{missing[0]} (a {arch})")
            slices.append(torch.cat([got.pop(p) for p in parts]) if len(parts) > 1 else got.pop(parts[0]))
        if len({t.shape for t in slices}) > 1:
            raise UserError(f"{where}: the experts' tensors of model.layers.{i}.{rest} differ in shape (a {arch})")
        out[name] = torch.stack(slices) if rest.startswith("mlp.experts.") else slices[0]
    return {**out, **got}  # (what is left over: the registry names it)


def hf_config(cfg: LlamaConfig, eot: int) -> dict:
    arch = architecture(cfg)
    scaling = None if not cfg.rope_factor else {
        "rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq,
        "high_freq_factor": cfg.rope_high_freq, "original_max_position_embeddings": cfg.rope_original}
    c = {
        "architectures": [arch], "model_type": MODEL_TYPES[arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_width,
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": cfg.tied,
        "attention_dropout": 0.0, "initializer_range": 0.02, "pretraining_tp": 1,
        "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
    }
    if arch == "MixtralForCausalLM":
        c.update(intermediate_size=cfg.moe_width, num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                 router_aux_loss_coef=cfg.moe_aux, router_jitter_noise=0.0, sliding_window=None)
    elif arch == "Qwen3MoeForCausalLM":
        c.update(moe_intermediate_size=cfg.moe_width, num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_top_k,
                 norm_topk_prob=cfg.moe_renorm, decoder_sparse_step=1, router_aux_loss_coef=cfg.moe_aux,
                 mlp_only_layers=[i for i in range(cfg.n_layer) if not cfg.is_moe(i)], use_sliding_window=False)
    return c


def config_from_hf(c: dict, where: str) -> dict:
    """Our Config's fields from HF's config.json (rope as `rope_scaling` + `rope_theta`, or
    transformers 5's `rope_parameters`), checked for what this Llama can represent."""
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("sliding_window", None),
                    ("use_sliding_window", False), ("router_jitter_noise", 0.0)):
        if c.get(key, ok) != ok:
            raise UserError(f"{where}: {key} = {c[key]!r}, but braidtrain's Llama needs {ok!r}")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise UserError(f"{where}: head_dim = {c['head_dim']}, but braidtrain's Llama has hidden_size / heads")
    rope = dict(c.get("rope_parameters") or {})
    rope.update(c.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise UserError(f"{where}: rope type {kind!r}: braidtrain's Llama knows 'default' and 'llama3'")
    fields = {"n_layer": c["num_hidden_layers"], "n_head": heads, "n_embd": c["hidden_size"],
              "block_size": c.get("max_position_embeddings", 8192), "vocab_size": c["vocab_size"],
              "n_kv_heads": c.get("num_key_value_heads") or heads, "ffn_hidden": c["intermediate_size"],
              "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
              "norm_eps": float(c.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(c.get("tie_word_embeddings", False))}
    if kind == "llama3":
        fields.update(rope_factor=float(rope["factor"]), rope_low_freq=float(rope["low_freq_factor"]),
                      rope_high_freq=float(rope["high_freq_factor"]),
                      rope_original=int(rope["original_max_position_embeddings"]))
    kind = c.get("model_type")
    fields["qk_norm"] = kind in ("qwen3", "qwen3_moe")
    if kind == "mixtral":
        fields.update(moe_experts=c["num_local_experts"], moe_top_k=c["num_experts_per_tok"],
                      moe_hidden=c["intermediate_size"], moe_aux=float(c.get("router_aux_loss_coef", 0.001)))
    elif kind == "qwen3_moe":
        dense = set(c.get("mlp_only_layers") or [])
        every = next((n for n in range(1, c["num_hidden_layers"] + 1)
                      if dense == {i for i in range(c["num_hidden_layers"]) if i % n}), None)
        if c.get("decoder_sparse_step", 1) != 1 or every is None:
            raise UserError(f"{where}: MoE layers (decoder_sparse_step {c.get('decoder_sparse_step')}, mlp_only_layers "
                            f"{sorted(dense)}) are not every n-th layer from 0, the one pattern braidtrain builds")
        experts = c.get("num_experts", c.get("num_local_experts"))  # (transformers 5 writes the latter)
        fields.update(moe_experts=experts, moe_top_k=c["num_experts_per_tok"], moe_every=every,
                      moe_hidden=c["moe_intermediate_size"], moe_renorm=bool(c.get("norm_topk_prob", False)),
                      moe_aux=float(c.get("router_aux_loss_coef", 0.001)))
    return fields
