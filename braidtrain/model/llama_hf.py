"""The Llama family's HuggingFace adapter (model/protocol.py): LlamaForCausalLM, Qwen3ForCausalLM,
MixtralForCausalLM and Qwen3MoeForCausalLM, both ways. `cfg` is a llama.LlamaConfig.

    ours                                   HF (under `model.`; lm_head.weight at the top)
    embed_tokens.weight (V_pad, C)         embed_tokens.weight (V, C)        padding rows cut off
    layers.N.self_attn.qkv_proj.weight     layers.N.self_attn.{q,k,v}_proj.weight, split by rows
    layers.N.mlp.gate_up_proj.weight       layers.N.mlp.{gate,up}_proj.weight, split by rows
    layers.N.mlp.router.weight             Mixtral: layers.N.block_sparse_moe.gate.weight; Qwen3-MoE:
                                           layers.N.mlp.gate.weight
    layers.N.mlp.experts.gate_up_proj      Mixtral: ...block_sparse_moe.experts.E.{w1,w3}.weight (gate, up)
      .weight (E, 2H, C), .down_proj       for each expert E; w2 the down projection; Qwen3-MoE:
      .weight (E, C, H)                    ...mlp.experts.E.{gate,up,down}_proj (transformers 5's fused
                                           experts.gate_up_proj / down_proj, our layout, are read too)
    everything else                        the same name (q_norm, k_norm: Qwen3's)

The architecture is the model's: experts make it Mixtral, or Qwen3-MoE with a qk-norm (or some
dense layers); a qk-norm alone Qwen3; else Llama.
"""

from __future__ import annotations

import torch

from braidtrain.errors import UserError

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral",
               "Qwen3MoeForCausalLM": "qwen3_moe"}
ARCHITECTURES = tuple(MODEL_TYPES)


def architecture(cfg) -> str:
    if cfg.moe_shared:
        raise UserError("shared experts (--moe-shared) have no HuggingFace architecture braidtrain writes: export a "
                        "model without them")
    if not cfg.moe_experts:
        return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    if cfg.qk_norm or cfg.moe_every > 1 or not cfg.moe_renorm:
        return "Qwen3MoeForCausalLM"
    return "MixtralForCausalLM"


def _hf_block(arch: str, name: str, cfg, e: int = 0):
    """[(HF name, rows)] of our block parameter `name` (after `layers.N.`; of a stack of experts,
    expert e's slice): its parts, split by rows."""
    D, mix = cfg.head_dim, arch == "MixtralForCausalLM"
    if name == "self_attn.qkv_proj.weight":
        rows = (cfg.n_head * D, cfg.kv_heads * D, cfg.kv_heads * D)
        return [(f"self_attn.{x}_proj.weight", w) for x, w in zip("qkv", rows)]
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


def to_hf(params: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
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


def fuse(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """to_hf's tensors as transformers 5 holds a mixture in memory (_unfuse's inverse): per MoE
    layer mlp.gate.weight, and the experts fused, mlp.experts.gate_up_proj (E, 2H, C) and down_proj
    (E, C, H) -- our stacks -- for a model built in memory (bench's hf yardstick), not read from a
    folder (transformers converts those itself)."""
    mix, out = architecture(cfg) == "MixtralForCausalLM", dict(tensors)
    at, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mix else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    for layer in (f"model.layers.{i}" for i in range(cfg.n_layer) if cfg.is_moe(i)):
        gate, up, down = ([out.pop(f"{layer}.{at}.experts.{e}.{w}.weight") for e in range(cfg.moe_experts)]
                          for w in names)
        out[f"{layer}.mlp.gate.weight"] = out.pop(f"{layer}.{at}.gate.weight")
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack(down)
    return out


def from_hf(tensors: dict[str, torch.Tensor], cfg, where: str) -> dict[str, torch.Tensor]:
    """Our tensors (unpadded vocabulary) from HF's, by the names to_hf writes; the registry checks
    names and shapes."""
    arch = architecture(cfg)
    got = _unfuse({k.removeprefix("model."): v for k, v in tensors.items()}, arch)
    if cfg.tied:
        head = got.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, got.get("embed_tokens.weight", head)):
            raise UserError(f"{where}: lm_head.weight differs from embed_tokens.weight, but config.json ties them")
    with torch.device("meta"):
        names = [n for n, _ in cfg.model(cfg).named_parameters()]
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


def hf_config(cfg, eot: int) -> dict:
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
              "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
              "tie_embeddings": bool(c.get("tie_word_embeddings", False))}
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
