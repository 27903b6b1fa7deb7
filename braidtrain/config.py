"""What to train and how: one flat dataclass, filled from a TOML file and the command line.

Resolution order: the dataclass defaults, then `--config NAME|PATH` (a TOML file; NAME looks in
braidtrain/configs/), then command-line options. `validate` checks each value on its own (a
positive size, a known name); whether the degrees and features fit together, the world size and
the model is layout.py's question, asked once before any process group forms. Each failure is a
`UserError` whose one line says what to change.

Recipes. The optimizer's settings (RECIPE_FIELDS: lr, warmup, decay, clipping, AdamW's betas and
weight decay) that neither the command line nor the config file gives come from the model preset's
published recipe (its family's RECIPES, e.g. model/llama.py's Llama 3 recipe), whichever of
--model or a config file's `model` named it; a preset whose family publishes none (GPT-2's) keeps
the defaults below. A recipe's warmup is for a long run: a run of max_steps steps warms up for at
most WARMUP_SHARE of them (-x 40: 20 steps, not 200), except under -x -1 (one epoch, its length
unknown here). A recipe's lr is for its batch (`batch_tokens` a step): where the lr is the
recipe's and a step holds fewer tokens, `batch_scaled` lowers it by sqrt(d / batch_tokens) once the
layout knows d (Adam's square-root rule; 3B at 2,048 tokens a step spiked to a loss of 20 at the
published 3e-4: docs/performance.md). `recipe` records where each setting came from; `train`
prints it at the start.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from braidtrain.errors import UserError
from braidtrain.model import registry
from braidtrain.io.trackers import check_installed

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class Config:
    # model: a preset of a model family (model/gpt2.py: tiny, gpt2, gpt2-medium, ..., llm.c's "dN";
    # model/llama.py: llama3-tiny, llama3.2-1b, ...); the sizes below override the preset when set.
    model: str = "tiny"
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None
    n_kv_heads: int | None = None  # key/value heads (Llama's grouped-query attention)
    # a mixture of experts (model/moe.py): experts in place of the MLP of every moe_every-th block
    # (None: the preset's; the GPT-2 family's: dense, top 2 of the experts, every block, the MLP's
    # width, dropless, an aux-loss coefficient of 0.01)
    moe_experts: int | None = None  # 0: dense
    moe_top_k: int | None = None
    moe_every: int | None = None
    moe_hidden: int | None = None  # 0: the dense MLP's width
    moe_capacity: float | None = None  # capacity factor; 0: dropless
    moe_aux: float | None = None  # the load-balancing loss's coefficient
    moe_router: str | None = None  # softmax-topk (default) | topk-softmax
    moe_balance: str | None = None  # aux (default: the loss above) | bias (DeepSeek-V3's, no loss term)
    moe_bias_rate: float | None = None  # bias balancing's step (default 0.001)
    moe_shared: int | None = None  # shared experts every token passes (Llama family; default 0)
    # data
    train_data: str = "data/shakespeare"
    val_data: str | None = None  # default: the val split beside the training data
    tokenizer: str | None = None  # default: the data folder's tokenizer.json, else gpt2
    # batch: -d tokens per optimizer step (global), -b sequences per micro-batch per rank, -t tokens per sequence
    batch_size: int = 4
    seq_len: int = 256
    total_batch: int | None = None  # default: b * t * dp (one micro-step)
    max_steps: int = 100
    # optimization
    lr: float = 6e-4
    final_lr_frac: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    recipe: str | None = None  # where the settings above came from (build_config writes it)
    recipe_batch: int | None = None  # the tokens a step the recipe's lr is for (None: the lr is not the recipe's)
    seed: int = 1337
    # evaluation and output
    val_every: int = 50
    val_steps: int = 8
    sample_tokens: int = 200
    eval_data: str | None = None  # an llm.c multiple-choice eval file (HellaSwag-style; evaluate.py)
    eval_every: int | None = None  # steps between its evaluations (default: val_every; 0: only at the end)
    out: str | None = None  # default: runs/<timestamp>
    ckpt_every: int = 0  # 0: only the final checkpoint
    keep_ckpts: int = 2
    max_skipped: int = 3  # consecutive non-finite steps (each skipped, no update) before the run stops
    on_save_error: str = "stop"  # a checkpoint save that fails (full disk): stop (exit 2) | continue
    save: bool = True  # False (--no-save): no checkpoint at all, the final one neither (benchmarks)
    preempt_budget: float = 25.0  # after SIGTERM/SIGINT: seconds to finish the step and save it (train.py)
    resume: str | None = None  # "auto" or a checkpoint folder; a torchrun restart defaults to "auto"
    start_over: bool = False  # a new run into --out that holds another run: move that run's files aside (rundir.py)
    init_from: str | None = None  # a HuggingFace folder of a family's architecture to start from (export writes one)
    progress: bool = True
    tensorboard: bool = False  # TensorBoard event files in RUN/tb (trackers.py)
    wandb: str | None = None  # a Weights & Biases project: the run logged there, its files in RUN/wandb
    # parallelism (layout.py validates them together)
    layout: str | None = None  # "auto": the planner picks AUTO_CHOSEN for the processes and GPUs (plan.auto_layout)
    zero: int = 0
    pp: int = 1  # pipeline stages
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb (parallel/pipeline.py)
    pp_virtual: int | None = None  # chunks a rank holds: interleaved only (default 2 there)
    pp_split: str | None = None  # blocks per chunk, e.g. "3,4,4,3" (default: the cost model's)
    cp: int = 1  # context-parallel degree: each sequence split over cp ranks (parallel/context.py)
    cp_impl: str = "ring"  # ring | allgather: how keys and values reach the other cp ranks
    cp_order: str = "zigzag"  # zigzag (rank r: chunks r and 2cp-1-r, balanced) | contiguous
    tp: int = 1  # tensor-parallel degree (ranks that split each layer); dp = world / (pp * cp * tp)
    ep: int = 1  # expert-parallel degree: experts sharded over ep ranks carved from dp*cp (parallel/expert.py)
    sp: bool = False  # sequence parallelism within the tp group
    exact: bool = False
    recompute: bool = False
    compile: bool = False  # torch.compile each block (training only; tp = 1)
    attention: str = "auto"  # auto | sdpa | flash4: the attention kernel (build.settle; model/flash4.py)
    cuda_graph: bool = False  # replay each step's GPU work, collectives too, from one CUDA graph (ZeRO 0/1)
    offload: str | None = None  # "optimizer": fp32 master and AdamW moments in host memory (parallel/offload.py)
    offload_ratio: float | None = None  # --offload optimizer: the share of that state on the host (default 1)
    bucket_mb: float = 50.0  # a bucket: whole blocks until it holds this (docs/design-notes.md, "Buckets")
    # runtime
    init_method: str = "env"
    num_processes: int | None = None
    process_rank: int | None = None
    gpus_per_node: int | None = None
    server: str | None = None
    fs_path: str | None = None
    device: str | None = None
    dtype: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    fp8: str | None = None  # tensorwise | rowwise: the blocks' linear layers in float8 (model/fp8.py)
    timeout: float = 300.0
    heartbeat_timeout: float = 30.0  # seconds of silence before a peer counts as lost; 0: no heartbeat
    live_recovery: bool = False  # a lost rank (under pp/tp/cp: its replica): the survivors go on in-process (live/)
    join: bool = False  # live recovery: this process replaces a lost rank (-pr) of a running job

    def to_toml(self) -> str:
        lines = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            lines.append(f"{f.name} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


FIELD_TYPES = {f.name: f.type for f in fields(Config)}


def _coerce(key: str, value, source: str):
    """Check a TOML value against the field's declared type (ints are accepted for floats)."""
    t = FIELD_TYPES[key].replace(" | None", "")
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }[t]
    if not ok:
        raise UserError(f"{source}: '{key}' must be {t}, got {value!r}")
    return float(value) if t == "float" else value


def config_path(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise UserError(f"config file '{name}' {'is a folder' if p.is_dir() else 'not found'}")
        return p
    p = CONFIG_DIR / f"{name}.toml"
    if not p.is_file():
        known = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.toml")))
        raise UserError(f"unknown config '{name}': use one of {known}, or a path to a .toml file")
    return p


def load_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None
    out = {}
    for key, value in raw.items():
        if key not in FIELD_TYPES:
            raise UserError(f"{path}: unknown config key '{key}' (see braidtrain/config.py for the keys)")
        out[key] = _coerce(key, value, str(path))
    return out


# the settings a model preset's recipe gives (model/*.py's RECIPES) unless given; and a short run's warmup at most
RECIPE_FIELDS = ("lr", "warmup_steps", "final_lr_frac", "grad_clip", "beta1", "beta2", "weight_decay")
WARMUP_SHARE = 0.5  # of the run's steps

# What --layout auto chooses (replacing a config file's values for them)
AUTO_CHOSEN = ("pp", "pp_schedule", "pp_virtual", "pp_split", "cp", "cp_impl", "tp", "sp", "ep", "zero", "batch_size",
               "recompute", "offload", "offload_ratio")


def build_config(config: str | None, overrides: dict) -> Config:
    """Defaults (or the preset's recipe), then the TOML file, then command-line overrides (None
    means 'not given')."""
    from_file = load_toml(config_path(config)) if config else {}
    given = {k: v for k, v in overrides.items() if v is not None}
    values = {**from_file, **given}
    preset = values.get("model", Config.model)
    name, recipe = registry.recipe(preset) or ("gpt2 defaults", {})
    recipe = dict(recipe)
    batch = recipe.pop("batch_tokens", None)
    values.update({k: v for k, v in recipe.items() if k not in values})
    if batch and "lr" not in from_file | given:
        values["recipe_batch"] = batch
    steps = values.get("max_steps", Config.max_steps)
    scaled = ""
    if "warmup_steps" not in from_file | given and steps > 0 and values.get("warmup_steps", 0) > WARMUP_SHARE * steps:
        scaled = f" of {steps} steps, scaled from {values['warmup_steps']}"
        values["warmup_steps"] = max(1, int(WARMUP_SHARE * steps))
    cfg = Config(**values)
    validate(cfg)
    where = [f"--{k.replace('_', '-')} (command line)" for k in RECIPE_FIELDS if k in given]
    where += [f"{k} ({config_path(config).name})" for k in RECIPE_FIELDS if k in from_file and k not in given]
    source = f"for --init-from {cfg.init_from}" if cfg.init_from and "model" not in values else f"from preset {preset}"
    cfg.recipe = (f"{name} (lr {_short(cfg.lr)}, warmup {cfg.warmup_steps}{scaled}, cosine to {cfg.final_lr_frac:.0%}, "
                  f"clip {cfg.grad_clip:.1f}, AdamW {cfg.beta1:g}/{cfg.beta2:g} wd {cfg.weight_decay:g}) {source}"
                  + (f"; overridden: {', '.join(where)}" if where else ""))
    return cfg


def batch_scaled(cfg: Config, tokens: int) -> Config:
    """`cfg` at a step of `tokens` tokens: the recipe's lr times sqrt(tokens / recipe_batch) where
    the step is smaller than the recipe's, and the recipe's line saying so."""
    if not cfg.recipe_batch or tokens >= cfg.recipe_batch:
        return cfg
    lr = cfg.lr * math.sqrt(tokens / cfg.recipe_batch)
    said = f"lr {_short(cfg.lr)}"
    recipe = cfg.recipe.replace(said, f"lr {_short(lr)} ({_short(cfg.lr)} at the recipe's {cfg.recipe_batch} tokens a "
                                      f"step, x sqrt({tokens}/{cfg.recipe_batch}))", 1)
    return replace(cfg, lr=lr, recipe=recipe)


def _short(x: float) -> str:
    """3e-4, 2.2e-4: a learning rate as papers write it."""
    mantissa, exp = f"{x:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"


# The smallest value of each integer field (unset, None, is allowed where the default is None);
# max_steps also takes -1 (one epoch), zero its four stages
AT_LEAST = {"n_layer": 1, "n_head": 1, "n_embd": 1, "block_size": 1, "n_kv_heads": 1, "moe_experts": 0,
            "moe_top_k": 1, "moe_every": 1, "moe_hidden": 0, "moe_shared": 0, "zero": 0, "batch_size": 1, "seq_len": 1,
            "total_batch": 1, "warmup_steps": 0, "seed": 0, "val_every": 0, "val_steps": 1, "sample_tokens": 0,
            "eval_every": 0, "ckpt_every": 0, "keep_ckpts": 1, "max_skipped": 1, "pp": 1, "pp_virtual": 1, "cp": 1,
            "tp": 1, "ep": 1, "num_processes": 1, "process_rank": 0, "gpus_per_node": 1}
# ... and each float field: finite, and > 0 (POSITIVE) or >= 0
POSITIVE = ("lr", "eps", "bucket_mb", "timeout")
FLOATS = POSITIVE + ("final_lr_frac", "weight_decay", "grad_clip", "beta1", "beta2", "moe_capacity", "moe_aux",
                     "moe_bias_rate", "heartbeat_timeout")
INT_MAX = 2**31 - 1  # (the seed: 2**63 - 1) larger counts and sizes are typos, and overflow tensors' sizes


def validate(cfg: Config) -> None:
    """Checks that need neither the data nor the world size: each value on its own."""
    for key, low in AT_LEAST.items():
        v, top = getattr(cfg, key), 2**63 - 1 if key == "seed" else INT_MAX
        if v is not None and not low <= v <= top:
            raise UserError(f"{_flag(key, v)}: {key} must be {_at_least(low)}, got {v}" if v < low else
                            f"{key} {v} is out of range: at most {top}")
    if cfg.max_steps > INT_MAX:
        raise UserError(f"max_steps {cfg.max_steps} is out of range: at most {INT_MAX}")
    if cfg.max_steps <= 0 and cfg.max_steps != -1:
        raise UserError(f"max_steps must be positive (or -1 for one epoch), got {cfg.max_steps}")
    for key in FLOATS:
        v = getattr(cfg, key)
        if v is not None and not (math.isfinite(v) and (v > 0 if key in POSITIVE else v >= 0)):
            raise UserError(f"{_flag(key, v)}: {key} must be {'a positive' if key in POSITIVE else 'a'} finite number"
                            f"{'' if key in POSITIVE else ' >= 0'}{HINTS.get(key, '')}, got {v}")
    if cfg.final_lr_frac > 1:
        raise UserError(f"final_lr_frac must be in [0, 1], got {cfg.final_lr_frac}")
    if not (cfg.beta1 < 1 and cfg.beta2 < 1):
        raise UserError(f"beta1 and beta2 must be in [0, 1), got {cfg.beta1} and {cfg.beta2}")
    if cfg.eval_every is not None and not cfg.eval_data:
        raise UserError("--eval-every needs --eval-data FILE (an llm.c multiple-choice eval file)")
    if cfg.start_over and cfg.resume:
        raise UserError("--start-over begins a new run and --resume continues one: give one of them")
    if cfg.on_save_error not in ("stop", "continue"):
        raise UserError(f"on_save_error must be stop or continue, got {cfg.on_save_error!r}")
    if not (cfg.preempt_budget > 0 and math.isfinite(cfg.preempt_budget)):
        raise UserError(f"preempt_budget must be a positive number of seconds, got {cfg.preempt_budget}")
    if cfg.layout not in (None, "auto"):
        raise UserError(f"layout must be auto (or unset), got {cfg.layout!r}")
    if cfg.zero not in (0, 1, 2, 3):
        raise UserError(f"ZeRO stage {cfg.zero} does not exist: use -z 0, 1, 2 or 3")
    if cfg.init_method not in ("env", "tcp", "fs", "mpi"):
        raise UserError(f"unknown init method '{cfg.init_method}': use env, tcp, fs or mpi")
    if cfg.dtype not in ("auto", "fp32", "bf16"):
        raise UserError(f"unknown dtype '{cfg.dtype}': use auto, fp32 or bf16")
    if cfg.attention not in ("auto", "sdpa", "flash4"):
        raise UserError(f"unknown attention kernel {cfg.attention!r}: use auto, sdpa or flash4")
    if cfg.attention == "flash4" and cfg.exact:
        raise UserError("--exact keeps its own deterministic attention: drop --attention flash4")
    if cfg.attention == "flash4" and cfg.dtype == "fp32":
        raise UserError("--attention flash4 computes in bf16 or fp16, not --dtype fp32: drop one of them")
    if cfg.fp8 not in (None, "tensorwise", "rowwise"):
        raise UserError(f"unknown fp8 recipe {cfg.fp8!r}: use tensorwise or rowwise (or leave it unset: no float8)")
    if cfg.wandb is not None and not cfg.wandb.strip():
        raise UserError("--wandb needs a project name, e.g. --wandb my-project")
    check_installed(cfg.tensorboard, cfg.wandb)


HINTS = {"moe_capacity": " (0 for dropless)"}


def _flag(key: str, v) -> str:
    """The flag that sets `key`, with the value given: '--moe-top-k 0'."""
    return f"--{key.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{key.replace('_', '-')} {v}"


def _at_least(low: int) -> str:
    return {0: ">= 0", 1: "positive"}.get(low, f">= {low}")
