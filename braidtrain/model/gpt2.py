"""The GPT-2 family, readable top to bottom.

Pre-LayerNorm blocks, GELU (tanh), causal scaled-dot-product attention, learned positions, token
embedding tied to the output head, vocabulary padded to a multiple of 128 (the padding rows exist
so matrix shapes are friendly, but their logits are cut off before the loss and sampling, so they
are never predicted). Parameter names follow HuggingFace's GPT-2 (h.0.attn.c_attn.weight ...),
which keeps the HF adapter short; weights are stored as nn.Linear does ((out, in)), the transpose
of HF's Conv1D. What every family shares -- the stage, its forward, units, counts, init -- is
protocol.py's.

Initialisation does not depend on the layout: every parameter is drawn from its own generator,
seeded by (seed, parameter name), as one full tensor, and a tensor-parallel rank takes its slice of
that same tensor (the placement table says how), so tp=1 and tp=2 start from identical weights.

Tensor parallelism (GPT(cfg, mesh) with the mesh's tp axis > 1; layers.py has the pieces), in
Megatron-LM's layout (Shoeybi et al. 2019). Parameter names do not change, only the local shapes:

    tp rank r holds                                    tp_split (the layer declares it)
    wte         vocab rows [r V/tp, (r+1) V/tp)        (0, contiguous)  also the tied head's shard
    c_attn      its n_head/tp heads of q, k and v      (0, packed 1:1:1) column-parallel
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

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from braidtrain.errors import UserError
from braidtrain.model.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, attend
from braidtrain.model.moe import MoE
from braidtrain.model.protocol import VOCAB_ALIGN, ModelConfig
from braidtrain.model.stage import Block as BlockBase, Blocks, Stage

PRESETS = {  # name: fields
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),
}
LLMC_DEPTHS = {6: (384, 6), 12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25),
               60: (1920, 30), 72: (2880, 30), 84: (3456, 36)}  # llm.c's -e dN: depth -> (channels, heads)
PRESETS.update({f"d{d}": dict(n_layer=d, n_head=h, n_embd=c, block_size=1024) for d, (c, h) in LLMC_DEPTHS.items()})

VOCAB = 50257  # the family's tokenizer (GPT-2's BPE): the planner's default vocabulary
RECIPES: dict = {}  # none: GPT-2's presets train with config.py's defaults, llm.c's settings (config.py)


@dataclasses.dataclass(frozen=True)
class GPTConfig(ModelConfig):
    family = "gpt2"


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: int = 1, group=None, sp: bool = False):
        super().__init__()
        self.n_head = cfg.n_head // tp  # this rank's heads
        self.c_attn = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, group, sp=sp, packed=(1, 1, 1))
        self.c_proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, group, sp=sp)
        self.cp, self.kernel = None, "sdpa"  # context parallelism, the attention kernel (Stage sets them)

    def forward(self, x):
        qkv = self.c_attn(x)  # (B, T, 3C/tp): this rank's heads of q, k, v; the whole T even under sp
        B, T, C = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = attend(q, k, v, self.cp, self.kernel)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, group=None, sp: bool = False):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, group, sp=sp)
        self.c_proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, group, sp=sp)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(BlockBase):
    def __init__(self, cfg: GPTConfig, tp: int = 1, group=None, sp: bool = False, moe=None):
        """`moe`: (this rank's experts, their dispatch) for a mixture of experts in place of the MLP."""
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg, tp, group, sp)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg, group, sp) if moe is None else MoE(cfg, *moe)

    def body(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(Stage):
    """GPT-2, or a pipeline chunk of it (protocol.Stage): wte and wpe on the first chunk, ln_f and
    the head -- wte again, a copy on a last chunk that is not the first -- on the last."""

    blocks_attr = "h"
    embedding_name = "wte.weight"

    def __init__(self, cfg: GPTConfig, mesh=None, sp: bool = False, blocks: range | None = None,
                 first: bool = True, last: bool = True, stage: int = 0, dispatch=None):
        super().__init__(cfg, mesh, sp, first, last, stage, dispatch)
        if first or last:
            self.wte = VocabParallelEmbedding(cfg.vocab_rows(self.tp), cfg.n_embd, self.group, self.sp,
                                              align=VOCAB_ALIGN)
        if first:
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        mine = self.my_experts()
        mixture = lambda i: (mine, self.dispatch) if cfg.is_moe(i) else None
        self.h = Blocks({str(i): Block(cfg, self.tp, self.group, self.sp, mixture(i))
                         for i in (range(cfg.n_layer) if blocks is None else blocks)})
        if last:
            self.ln_f = nn.LayerNorm(cfg.n_embd)

    def embed(self, inp, pos):
        if self.sp:
            pos = pos.chunk(self.tp)[self.tp_rank]  # the residual stream holds this rank's T/tp rows
        return self.wte(inp) + self.wpe(pos)

    def final_norm(self, x):
        return self.ln_f(x)

    def head_weight(self):
        return self.wte.weight

    def embed_names(self) -> list[str]:
        return ["wte.weight", "wpe.weight"]

    def head_names(self) -> list[str]:
        return ["ln_f.weight", "ln_f.bias"]


GPTConfig.model = GPT
Model, Config = GPT, GPTConfig


def init_std(cfg: GPTConfig, name: str) -> float | None:
    """GPT-2's initialisation: N(0, 0.02) for weights, residual projections scaled by
    1/sqrt(2 n_layer) (two residual additions a block); None: zeros (biases) or ones (LayerNorms)."""
    if name.endswith(".bias") or ".ln_" in name or name.startswith("ln_f"):
        return None
    if name.endswith("c_proj.weight"):
        return 0.02 / math.sqrt(2 * cfg.n_layer)
    return 0.02


def is_norm(name: str) -> bool:
    return (".ln_" in name or name.startswith("ln_f")) and name.endswith("weight")


# -- HuggingFace's GPT2LMHeadModel ------------------------------------------------------------------
#
#     ours                       HF (GPT2LMHeadModel)
#     wte.weight  (V_pad, C)     transformer.wte.weight  (V, C)    rows past the real vocabulary cut off
#     h.N.attn.c_attn.weight     transformer.h.N.attn.c_attn.weight, transposed: HF's Conv1D stores
#       (out, in), as nn.Linear    (in, out); the same for attn.c_proj, mlp.c_fc and mlp.c_proj
#     everything else            transformer.<same name>, unchanged (biases, LayerNorms, wpe)
#     (the head is wte)          lm_head.weight is not written: tie_word_embeddings = true
#
# Names without the `transformer.` prefix (the original OpenAI checkpoints on the Hub) are read too.

MODEL_TYPES = {"GPT2LMHeadModel": "gpt2"}
ARCHITECTURES = tuple(MODEL_TYPES)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def to_hf(params: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """HF's tensors from ours (the vocabulary's padding already cut: registry.unpadded)."""
    return {f"transformer.{n}": (t.t() if n.endswith(CONV1D) else t).contiguous() for n, t in params.items()}


def from_hf(tensors: dict[str, torch.Tensor], cfg: GPTConfig, where: str) -> dict[str, torch.Tensor]:
    """Our tensors (unpadded vocabulary) from HF's, by name; the registry checks names and shapes."""
    got = {k.removeprefix("transformer."): v for k, v in tensors.items()
           if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # old HF files carry the causal mask
    head = got.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, got.get("wte.weight", head)):
        raise UserError(f"{where}: lm_head.weight differs from wte.weight; braidtrain's GPT-2 head is tied to the "
                        "embedding")
    return {n: (t.t() if n.endswith(CONV1D) else t) for n, t in got.items()}


def hf_config(cfg: GPTConfig, eot: int) -> dict:
    if cfg.moe_experts:
        raise UserError("a GPT-2 mixture of experts has no HuggingFace architecture: braidtrain exports dense GPT-2 "
                        "models, and the Llama family's mixtures as Mixtral or Qwen3-MoE")
    return {
        "architectures": list(ARCHITECTURES), "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
    }


def config_from_hf(c: dict, where: str) -> dict:
    """Our Config's fields from HF's config.json, checked for what this GPT-2 can represent."""
    checks = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
              "tie_word_embeddings": (True,)}
    for key, ok in checks.items():
        if c.get(key, ok[0]) not in ok:
            raise UserError(f"{where}: {key} = {c[key]!r}, but braidtrain's GPT-2 needs {ok[0]!r}")
    if c.get("n_inner") not in (None, 4 * c.get("n_embd", 0)):
        raise UserError(f"{where}: n_inner = {c['n_inner']}, but braidtrain's GPT-2 MLP is 4 * n_embd")
    return {"n_layer": c["n_layer"], "n_head": c["n_head"], "n_embd": c["n_embd"], "block_size": c["n_positions"],
            "vocab_size": c["vocab_size"]}
