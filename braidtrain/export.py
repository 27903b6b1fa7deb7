"""HuggingFace interchange: `braidtrain export RUN --format hf --out DIR` and `train --init-from DIR`.

A HuggingFace GPT-2 folder is config.json plus model.safetensors. Our parameter names already are
HF's GPT-2 names (model/gpt.py), so the mapping is short (names and full shapes from the placement
table; the vocabulary is its one padded dim):

    ours                       HF (GPT2LMHeadModel)
    wte.weight  (V_pad, C)     transformer.wte.weight  (V, C)    rows past the real vocabulary cut off
    h.N.attn.c_attn.weight     transformer.h.N.attn.c_attn.weight, transposed: HF's Conv1D stores
      (out, in), as nn.Linear    (in, out); the same for attn.c_proj, mlp.c_fc and mlp.c_proj
    everything else            transformer.<same name>, unchanged (biases, LayerNorms, wpe)
    (the head is wte)          lm_head.weight is not written: tie_word_embeddings = true

Going back (`--init-from`), the vocabulary is padded again with zero rows (never predicted: their
logits are cut off before the loss), and names without the `transformer.` prefix (how the original
OpenAI checkpoints on the Hub are stored) are accepted too. Only safetensors is read: no pickle.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from braidtrain.checkpoint import latest, load_params
from braidtrain.data import LLAMA3_BOS, LLAMA3_IDS
from braidtrain.errors import UserError
from braidtrain.model.gpt import GPTConfig
from braidtrain.parallel import placement

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
EOT = {"gpt2": 50256, "bytes": 0, "llama3": LLAMA3_BOS, LLAMA3_IDS: LLAMA3_BOS}  # the tokenizers' end-of-text ids (data.get_tokenizer)


def hf_shape(e: placement.Placed, cfg: GPTConfig) -> tuple:
    """The shape HF stores parameter e in: the real vocabulary, not its padding; Conv1D transposed."""
    shape = list(e.shape)
    if e.split.align > 1:  # the padded dim: the vocabulary
        shape[e.split.dim] = cfg.vocab_size
    return tuple(shape[::-1]) if e.name.endswith(CONV1D) else tuple(shape)


def to_hf(params: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    out = {}
    for e in placement.for_config(cfg):
        t = params[e.name]
        if e.split.align > 1:
            t = t.narrow(e.split.dim, 0, cfg.vocab_size)
        out[f"transformer.{e.name}"] = (t.t() if e.name.endswith(CONV1D) else t).contiguous().clone()
    return out


def from_hf(tensors: dict[str, torch.Tensor], cfg: GPTConfig, where: str) -> dict[str, torch.Tensor]:
    """Our state dict (padded vocabulary) from HF's tensors, every name and shape checked."""
    got = {k.removeprefix("transformer."): v for k, v in tensors.items()
           if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # old HF files carry the causal mask
    head = got.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, got.get("wte.weight", head)):
        raise UserError(f"{where}: lm_head.weight differs from wte.weight; braidtrain's head is tied to the embedding")
    table = placement.for_config(cfg)
    unknown = sorted(set(got) - {e.name for e in table})
    if unknown:
        raise UserError(f"{where}: unexpected tensors {unknown[:3]}: not a GPT-2 model of this shape")
    out = {}
    for e in table:
        if e.name not in got:
            raise UserError(f"{where}: model.safetensors has no {e.name}")
        t, shape = got[e.name].float(), hf_shape(e, cfg)
        if tuple(t.shape) != shape:
            raise UserError(f"{where}: {e.name} has shape {tuple(t.shape)}, expected {shape} from config.json")
        t = t.t() if e.name.endswith(CONV1D) else t
        if e.split.align > 1:  # the vocabulary's padding rows: zeros, never looked up nor predicted
            d = e.split.dim
            t = torch.cat([t, t.new_zeros(*t.shape[:d], e.shape[d] - t.shape[d], *t.shape[d + 1:])], d)
        out[e.name] = t.contiguous()
    return out


def hf_config(cfg: GPTConfig, tokenizer: str) -> dict:
    eot = EOT.get(tokenizer, cfg.vocab_size - 1)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "scale_attn_weights": True, "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
        "braidtrain_tokenizer": tokenizer,
    }


def export(run: str, out: str, fmt: str = "hf") -> Path:
    """Write the newest valid checkpoint of `run` (or the checkpoint folder `run`) as `fmt`."""
    if fmt != "hf":
        raise UserError(f"unknown export format {fmt!r}: use --format hf")
    run_path = Path(run)
    if not run_path.is_dir():
        raise UserError(f"{run}: no such run or checkpoint folder")
    ckpt = run_path if (run_path / "meta.json").exists() else latest(run_path)
    params, meta = load_params(ckpt)
    if meta["model"].get("moe_experts"):
        raise UserError(f"{ckpt} is a mixture of experts: HuggingFace's GPT-2 format holds dense models only")
    write_hf(params, GPTConfig(**meta["model"]), meta["tokenizer"], Path(out))
    return ckpt


def write_hf(params: dict[str, torch.Tensor], cfg: GPTConfig, tokenizer: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(params, cfg), str(dest / "model.safetensors"), metadata={"format": "pt"})  # HF insists on "pt"
    (dest / "config.json").write_text(json.dumps(hf_config(cfg, tokenizer), indent=1) + "\n")


def read_config(folder: str) -> dict:
    """config.json of a HF GPT-2 folder, checked for what braidtrain's model can represent."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"--init-from {folder}: no config.json (expected a HuggingFace GPT-2 folder, e.g. from braidtrain export)")
    try:
        c = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    checks = {"model_type": ("gpt2",), "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
              "layer_norm_epsilon": (1e-5,), "tie_word_embeddings": (True,)}
    for key, ok in checks.items():
        if c.get(key, ok[0]) not in ok:
            raise UserError(f"{path}: {key} = {c[key]!r}, but braidtrain's GPT needs {ok[0]!r}")
    if c.get("n_inner") not in (None, 4 * c.get("n_embd", 0)):
        raise UserError(f"{path}: n_inner = {c['n_inner']}, but braidtrain's MLP is 4 * n_embd")
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        if not isinstance(c.get(key), int) or c[key] <= 0:
            raise UserError(f"{path}: {key} must be a positive integer, got {c.get(key)!r}")
    return c


def load_hf(folder: str, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a HF GPT-2 folder (model.safetensors, or shards listed in its index)."""
    f = Path(folder)
    index = f / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (f / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise UserError(f"--init-from {folder}: no model.safetensors (braidtrain reads no pickled pytorch_model.bin: "
                        f"convert it to safetensors first)")
    tensors = {}
    for name in files:
        tensors.update(load_file(str(f / name)))
    return from_hf(tensors, cfg, f"--init-from {folder}")
