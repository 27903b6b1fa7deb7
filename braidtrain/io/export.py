"""HuggingFace interchange: `braidtrain export RUN --format hf --out DIR` and `train --init-from DIR`.

A HuggingFace folder is config.json plus model.safetensors (or shards listed in its index). Each
model family's adapter (model/gpt2.py, model/llama.py: `to_hf`, `from_hf`, `hf_config`,
`config_from_hf`) maps its names and transforms its tensors; what every family shares is here:
the vocabulary's padding rows (the placement table's one padded dim: cut on the way out, zeros
added on the way in -- never looked up nor predicted), every name and shape checked against the
placement table, and safetensors only (no pickle).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from braidtrain.io import paths
from braidtrain.io.checkpoint import latest, load_params, saved_config
from braidtrain.io.data import LLAMA3_BOS, LLAMA3_IDS
from braidtrain.errors import UserError
from braidtrain.model import registry
from braidtrain.parallel import placement

EOT = {"gpt2": 50256, "bytes": 0, LLAMA3_IDS: LLAMA3_BOS, "llama3": LLAMA3_BOS}  # the tokenizers' separators (data.py)


def unpadded_shape(e: placement.Placed, cfg) -> tuple:
    """The full shape of parameter e with the real vocabulary, not its padding."""
    shape = list(e.shape)
    if e.split.align > 1:  # the padded dim: the vocabulary
        shape[e.split.dim] = cfg.vocab_size
    return tuple(shape)


def to_hf(params: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF's tensors of our full parameters (the vocabulary's padding cut off)."""
    ours = {}
    for e in placement.for_config(cfg):
        t = params[e.name]
        ours[e.name] = t.narrow(e.split.dim, 0, cfg.vocab_size) if e.split.align > 1 else t
    return {k: v.contiguous().clone() for k, v in registry.family_of(cfg).to_hf(ours, cfg).items()}


def from_hf(tensors: dict[str, torch.Tensor], cfg, where: str) -> dict[str, torch.Tensor]:
    """Our full parameters (padded vocabulary) from HF's tensors, every name and shape checked."""
    got = registry.family_of(cfg).from_hf(tensors, cfg, where)
    table = placement.for_config(cfg)
    unknown = sorted(set(got) - {e.name for e in table})
    if unknown:
        raise UserError(f"{where}: unexpected tensors {unknown[:3]}: not a {cfg.family} model of this shape")
    out = {}
    for e in table:
        if e.name not in got:
            raise UserError(f"{where}: model.safetensors has no {e.name}")
        t, shape = got[e.name].float(), unpadded_shape(e, cfg)
        if tuple(t.shape) != shape:
            raise UserError(f"{where}: {e.name} has shape {tuple(t.shape)}, expected {shape} from config.json")
        if e.split.align > 1:  # the vocabulary's padding rows: zeros, never looked up nor predicted
            d = e.split.dim
            t = torch.cat([t, t.new_zeros(*t.shape[:d], e.shape[d] - t.shape[d], *t.shape[d + 1:])], d)
        out[e.name] = t.contiguous()
    return out


def hf_config(cfg, tokenizer: str) -> dict:
    eot = EOT.get(tokenizer, cfg.vocab_size - 1)
    return {**registry.family_of(cfg).hf_config(cfg, eot), "braidtrain_tokenizer": tokenizer}


def export(run: str, out: str, fmt: str = "hf") -> tuple[Path, str]:
    """Write the newest valid checkpoint of `run` (or the checkpoint folder `run`) as `fmt`; the
    checkpoint written and the HuggingFace architecture it became (the family's, e.g.
    LlamaForCausalLM)."""
    if fmt != "hf":
        raise UserError(f"unknown export format {fmt!r}: use --format hf")
    ckpt = checkpoint_of(run)
    paths.out_dir(out, "--out")
    params, meta = load_params(ckpt)
    cfg = saved_config(meta)
    return ckpt, write_hf(params, cfg, meta["tokenizer"], Path(out))


def checkpoint_of(run) -> Path:
    """The checkpoint a command reads from RUN: RUN itself (a checkpoint folder), or the newest
    valid one of the run directory RUN."""
    run = Path(run)
    if not run.is_dir():
        raise UserError(f"{run}: no such run or checkpoint folder" + (" (a file)" if run.exists() else ""))
    return run if (run / "meta.json").exists() else latest(run)


def write_hf(params: dict[str, torch.Tensor], cfg, tokenizer: str, dest: Path) -> str:
    """Write config.json and model.safetensors into dest; the architecture config.json names."""
    config = hf_config(cfg, tokenizer)  # (first: it refuses what HF has no architecture for)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(params, cfg), str(dest / "model.safetensors"), metadata={"format": "pt"})  # HF insists on "pt"
    (dest / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return config["architectures"][0]


def read_config(folder: str):
    """(family, our Config's fields) of a HF folder's config.json, checked for what the family can
    represent (a one-line error for an architecture braidtrain does not train)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"--init-from {folder}: no config.json (expected a HuggingFace model folder, e.g. from "
                        f"braidtrain export)")
    try:
        c = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    fam = registry.of_hf(c, str(path))
    try:
        fields = fam.config_from_hf(c, str(path))
    except KeyError as e:
        raise UserError(f"{path}: no {e} (a {' or '.join(fam.ARCHITECTURES)} config.json has it)") from None
    for key, v in fields.items():
        if key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size") and (not isinstance(v, int) or v <= 0):
            raise UserError(f"{path}: {key} must be a positive integer, got {v!r}")
    return fam, fields


def weight_files(folder: str) -> list[Path]:
    """A HF folder's safetensors files: model.safetensors, or the shards its index lists."""
    f = Path(folder)
    index = f / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"--init-from {folder}: {index.name} is damaged ({e})") from None
        return [f / name for name in names]
    if (f / "model.safetensors").is_file():
        return [f / "model.safetensors"]
    raise UserError(f"--init-from {folder}: no model.safetensors (braidtrain reads no pickled pytorch_model.bin: "
                    f"convert it to safetensors first)")


def check_folder(folder: str) -> None:
    """--init-from's folder before the run starts: its config.json, and each safetensors file whole
    (its header read, its size what the header says), so that a damaged one stops the run before
    it claims its directory, not after the model is built."""
    paths.in_dir(folder, "--init-from")
    read_config(folder)
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (OSError, SafetensorError) as e:
            raise UserError(f"--init-from {folder}: {path.name} is damaged or truncated ({e})") from None


def load_hf(folder: str, cfg) -> dict[str, torch.Tensor]:
    """Our state dict from a HF folder (model.safetensors, or shards listed in its index)."""
    tensors = {}
    for path in weight_files(folder):
        try:
            tensors.update(load_file(str(path)))
        except (OSError, SafetensorError) as e:
            raise UserError(f"--init-from {folder}: {path.name} is damaged or truncated ({e})") from None
    return from_hf(tensors, cfg, f"--init-from {folder}")
