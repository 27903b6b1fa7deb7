"""What a model family declares: its config (the fields every family has, and their counts), and
the rest of the protocol below; what every family shares is stage.py's.

A family (gpt2.py, llama.py) is one module that declares, and the registry (registry.py) lists:

    Config      a frozen ModelConfig subclass: the shape (its own fields beside the common ones)
    PRESETS     preset name -> that Config's fields (all but vocab_size, which is the data's)
    RECIPES     preset name -> (recipe name, config.py's optimizer settings): the published
                training recipe the preset brings (config.py, "Recipes"); {}: config.py's defaults
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

The Stage and the Block every family builds on: stage.py; each parameter's initial tensor (below)
from its own (seed, name) generator.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import ClassVar

import torch

from braidtrain.errors import UserError, divisors
from braidtrain.model.counts import counts
from braidtrain.model.moe import BALANCES, ROUTERS

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
        for what, n in (("n_head", self.n_head), ("n_kv_heads", self.kv_heads), ("the MLP width "
                                                                                 f"{self.mlp_name}", self.mlp_width)):
            if n % tp:
                why = (" (each tp rank holds whole key/value heads: they are not replicated)" if what == "n_kv_heads"
                       else "")
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
