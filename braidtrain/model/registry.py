"""The model families, and what the rest of braidtrain asks of them by name.

    registry.FAMILIES                   {"gpt2": model/gpt2.py, "llama3": model/llama.py}
    model_config(preset, vocab, ...)    a preset's Config with these fields overriding it
    recipe(preset)                      the training recipe it brings (its family's RECIPES)
    config_of(family, fields)           a Config from a checkpoint's record
    family_of(cfg) / of_hf(config)      a Config's family; a HuggingFace config.json's
    build(cfg, ...) / pipeline_chunks   a Stage (the whole model or a chunk), or a rank's chunks

Adding a family: its module (protocol.py says what it declares) and one line here.
"""

from __future__ import annotations

import dataclasses

from braidtrain.errors import UserError
from braidtrain.model import gpt2, llama
from braidtrain.model.protocol import ModelConfig

FAMILIES = {m.Config.family: m for m in (gpt2, llama)}


def family_of(cfg: ModelConfig):
    return FAMILIES[cfg.family]


def presets() -> list[str]:
    return [name for fam in FAMILIES.values() for name in fam.PRESETS if not name[1:].isdigit()]


def family_of_preset(preset: str):
    fam = next((f for f in FAMILIES.values() if preset in f.PRESETS), None)
    if fam is None:
        raise UserError(f"unknown model '{preset}': use one of {', '.join(presets())}, or llm.c's d12, d24, ... "
                        "(GPT-2)")
    return fam


def recipe(preset: str) -> tuple[str, dict] | None:
    """The training recipe preset `preset` brings -- its name and config.py's settings -- or None
    where its family publishes none (GPT-2's: config.py's defaults)."""
    return family_of_preset(preset).RECIPES.get(preset)


def model_config(preset: str, vocab_size: int | None = None, **overrides) -> ModelConfig:
    """The Config of preset `preset` (or llm.c's dN, GPT-2's) with `overrides` (None: not given) and
    the data's vocabulary (None: the family's tokenizer's, VOCAB), checked."""
    fam = family_of_preset(preset)
    vocab_size = vocab_size or fam.VOCAB
    given = {k: v for k, v in overrides.items() if v is not None}
    known = {f.name for f in dataclasses.fields(fam.Config)}
    for k in given:
        if k not in known:
            raise UserError(f"--{k.replace('_', '-')} is not a setting of the {fam.Config.family} family ({preset}): "
                            "drop it")
    cfg = fam.Config(**{**fam.PRESETS[preset], **given, "vocab_size": vocab_size})
    cfg.check()
    return cfg


FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "n_kv_heads", "moe_experts", "moe_top_k", "moe_every",
         "moe_hidden", "moe_capacity", "moe_aux", "moe_router", "moe_balance", "moe_bias_rate",
         "moe_shared")  # the model's fields `train` takes on its command line (config.py's of those names)


def command_line(cfg: ModelConfig) -> list:
    """`train`'s flags that build this config: a preset of its family and the fields it sets (what
    `plan --check` runs); UserError if no preset and flags make it."""
    fam = family_of(cfg)
    flags = {k: getattr(cfg, k) for k in FLAGS if hasattr(cfg, k)}
    for preset in fam.PRESETS:
        if fam.Config(**{**fam.PRESETS[preset], **flags, "vocab_size": cfg.vocab_size}) == cfg:
            return ["--model", preset] + [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", v)]
    raise UserError(f"no preset of the {cfg.family} family with train's flags builds this model: it cannot be run")


def config_of(family: str, fields: dict) -> ModelConfig:
    """A Config from a checkpoint's record (fields added since it was saved take their defaults)."""
    if family not in FAMILIES:
        raise UserError(f"unknown model family {family!r} (this braidtrain knows {', '.join(FAMILIES)})")
    fam = FAMILIES[family]
    known = {f.name for f in dataclasses.fields(fam.Config)}
    return fam.Config(**{k: v for k, v in fields.items() if k in known})


def of_hf(c: dict, where: str):
    """The family of a HuggingFace config.json (its architectures, else model_type)."""
    archs = c.get("architectures") or []
    for fam in FAMILIES.values():
        if set(archs) & set(fam.ARCHITECTURES) or (not archs and c.get("model_type") in fam.MODEL_TYPES.values()):
            return fam
    known = ", ".join(a for f in FAMILIES.values() for a in f.ARCHITECTURES)
    raise UserError(f"{where}: architecture {archs or c.get('model_type')!r} is not one braidtrain trains (it reads "
                    f"{known})")


def build(cfg: ModelConfig, mesh=None, sp: bool = False, blocks: range | None = None, first: bool = True,
          last: bool = True, stage: int = 0, dispatch=None):
    """The whole model (or one pipeline chunk: `blocks`, `first`, `last`, `stage`) on `mesh`."""
    return cfg.model(cfg, mesh, sp, blocks, first, last, stage, dispatch)


def pipeline_chunks(cfg: ModelConfig, split, pp: int, r: int, mesh=None, sp: bool = False, dispatch=None) -> list:
    """Pipeline rank r's chunks r, r + pp, ... of the model cut into `split` (the blocks of each
    chunk: parallel/pipeline.py); the first chunk holds the embedding, the last the head."""
    last = len(split) - 1
    return [build(cfg, mesh, sp, split[c], first=c == 0, last=c == last, stage=c, dispatch=dispatch)
            for c in range(r, last + 1, pp)]
