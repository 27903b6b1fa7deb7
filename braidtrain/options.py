"""The `train` command's options -- llm.c's short flags too, so llm.c's documented training
commands run unchanged apart from the program name -- and the Config they give (`bench train`
parses its layouts with them too); and the Parser every command uses, whose errors are one line."""

from __future__ import annotations

import argparse
import math
import sys

from braidtrain.config import AUTO_CHOSEN, FIELD_TYPES, build_config
from braidtrain.errors import UserError

class Parser(argparse.ArgumentParser):
    """Every flag of type=float takes finite numbers only (a NaN passes every `x <= 0` check after
    it), every type=int flag 64-bit integers; each command checks its own ranges."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", float, _finite)  # (argument groups share the parser's registry)
        self.register("type", int, _int64)

    def error(self, message):  # one line, exit 2 (argparse would add a usage block)
        print(f"braidtrain: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def _int64(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not -2**63 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"{text} is out of range")
    return v


def device(text: str) -> str:
    """A --device value: cpu, cuda or cuda:N (collective/runtime.py picks the GPU)."""
    if text in ("cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, cuda or cuda:N")


def train_parser(sub):
    # add_help=False: llm.c's -h (HellaSwag) must parse; --help still works
    p = sub.add_parser("train", help="train a model", allow_abbrev=False, add_help=False)
    a = p.add_argument
    a("--help", action="help", help="show this help and exit")
    a("--config", help="a config name from braidtrain/configs (tiny, gpt2, ...) or a .toml path")
    g = p.add_argument_group("model")
    g.add_argument("--model", "-e", help="a model family's preset, e.g. tiny, gpt2, gpt2-xl, llm.c's d12, llama3-tiny, "
                                        "llama3.1-8b (each family's PRESETS: braidtrain/model/*.py)")
    for k in ("n-layer", "n-head", "n-embd", "block-size"):
        g.add_argument(f"--{k}", type=int)
    g.add_argument("--n-kv-heads", type=int, help="key/value heads (Llama's grouped-query attention)")
    g = p.add_argument_group("data")
    g.add_argument("--train-data", "-i", help="token file, folder or glob (llm.c .bin)")
    g.add_argument("--val-data", "-j", help="validation token file, folder or glob")
    g.add_argument("--tokenizer", choices=["gpt2", "bytes", "llama3"],
                   help="default: the data's tokenizer.json, else gpt2 (llm.c's llama-3 shards: their ids)")
    g = p.add_argument_group("batch and schedule")
    g.add_argument("--batch-size", "-b", type=int, help="sequences per micro-batch per rank")
    g.add_argument("--seq-len", "-t", type=int, help="tokens per sequence")
    g.add_argument("--total-batch", "-d", type=int, help="tokens per optimizer step, over all ranks")
    g.add_argument("--max-steps", "-x", type=int, help="optimizer steps (-1: one epoch of the training data)")
    g.add_argument("--lr", "-l", type=float, help="peak learning rate (default: the model preset's recipe, which "
                                                  "train prints at the start)")
    g.add_argument("--final-lr-frac", "-q", type=float, help="cosine decay to this share of the peak (default: the "
                                                             "recipe's)")
    g.add_argument("--warmup-steps", "-u", type=int, help="linear warm-up steps (default: the recipe's, cut to half "
                                                          "of a shorter -x)")
    g.add_argument("--weight-decay", "-c", type=float, help="AdamW's decoupled weight decay (default: the recipe's)")
    g.add_argument("--grad-clip", type=float, help="clip the gradient's global norm to this (default: the recipe's)")
    g.add_argument("--seed", type=int)
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--val-every", "-v", type=int)
    g.add_argument("--val-steps", "-m", type=int)
    g.add_argument("--sample-tokens", "-g", type=int)
    g.add_argument("--eval-data", metavar="FILE", help="llm.c multiple-choice eval file (HellaSwag; data prepare-eval "
                                                       "writes one)")
    g.add_argument("--eval-every", type=int, help="steps between evaluations on it (default: --val-every; 0: only at "
                                                  "the end)")
    g.add_argument("--out", "-o", help="run directory (default runs/<timestamp>)")
    g.add_argument("--ckpt-every", "-n", type=int)
    g.add_argument("--keep-ckpts", type=int)
    g.add_argument("--on-save-error", choices=["stop", "continue"],
                   help="a checkpoint save that fails (a full disk): stop the run (default, exit 2) or log it and go "
                        "on")
    g.add_argument("--no-save", dest="save", action="store_false", default=None,
                   help="save no checkpoint, the final one neither (benchmarks; a stop by signal then saves nothing)")
    g.add_argument("--preempt-budget", type=float, metavar="SECONDS",
                   help="after SIGTERM or SIGINT: seconds to finish the step in progress and save it, then exit "
                        "128 + signal; past them, or at a second signal, exit at once (default 25: inside the 30 s "
                        "Slurm and torchrun allow before SIGKILL)")
    g.add_argument("--max-skipped", type=int,
                   help="stop (exit 3) after this many steps in a row whose loss or gradient is not finite (default 3)")
    g.add_argument("--resume", help="auto (newest valid checkpoint in the run directory) or a checkpoint folder; "
                   "a group restarted by torchrun resumes by itself")
    g.add_argument("--start-over", action="store_true", default=None,
                   help="--out holds another run: move its files aside (to OUT.replaced-TIME) and start a new run "
                        "there")
    g.add_argument("--init-from", metavar="DIR", help="start from a HuggingFace folder of a family braidtrain "
                                                      "trains: GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, "
                                                      "MixtralForCausalLM or Qwen3MoeForCausalLM (braidtrain export "
                                                      "writes one)")
    g.add_argument("-y", dest="llmc_resume", type=int, choices=[0, 1], help="llm.c: 1 = --resume auto")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    g.add_argument("--tensorboard", action="store_true", default=None,
                   help="also write every step's metrics as TensorBoard events in RUN/tb (needs tensorboard)")
    g.add_argument("--wandb", metavar="PROJECT",
                   help="also log every step's metrics to this Weights & Biases project (needs wandb; "
                        "WANDB_MODE=offline: no network, files in RUN/wandb)")
    g = p.add_argument_group("mixture of experts (model/moe.py)")
    g.add_argument("--moe-experts", type=int, help="experts in place of each MoE block's MLP (0: dense)")
    g.add_argument("--moe-top-k", type=int, help="experts a token goes through (default 2)")
    g.add_argument("--moe-every", type=int, help="every n-th block is an MoE block: 0, n, 2n, ... (default 1: all)")
    g.add_argument("--moe-hidden", type=int, help="an expert's hidden width (default: the MLP's, 4 n_embd)")
    g.add_argument("--moe-capacity", type=float, help="capacity factor (tokens over it skip the expert); 0: dropless "
                                                      "(default)")
    g.add_argument("--moe-aux", type=float, help="the load-balancing loss's coefficient (default 0.01)")
    g.add_argument("--moe-router", choices=["softmax-topk", "topk-softmax"],
                   help="softmax over all experts, top k renormalised (default; Qwen3-MoE, HF's Mixtral) or softmax "
                        "over the top k logits (Mixtral's paper)")
    g.add_argument("--moe-balance", choices=["aux", "bias"],
                   help="the balance loss (default) or DeepSeek-V3's auxiliary-loss-free per-expert bias")
    g.add_argument("--moe-bias-rate", type=float, help="the bias's move a step under --moe-balance bias (default "
                                                       "0.001)")
    g.add_argument("--moe-shared", type=int, help="shared experts of --moe-hidden's width that every token passes "
                                                  "(llama family; default 0)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--layout", choices=["auto"], help="auto: the planner's best layout for these processes and GPUs "
                                                      "(pp, dp, cp, tp, sp, ep, ZeRO, b, recompute), printed at the "
                                                      "start")
    g.add_argument("--zero", "-z", type=int, help="ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 + "
                                                  "gradients, 3 + parameters")
    g.add_argument("--tp", type=int, help="tensor-parallel degree (consecutive ranks split each layer)")
    g.add_argument("--pp", type=int, help="pipeline stages (consecutive blocks each; dp = processes / (pp * cp * tp))")
    g.add_argument("--pp-schedule", choices=["gpipe", "1f1b", "interleaved", "zb"], help="pipeline schedule (default "
                                                                                         "1f1b)")
    g.add_argument("--pp-virtual", type=int, help="model chunks a rank holds (interleaved; default 2)")
    g.add_argument("--pp-split", help="blocks per stage (per chunk), e.g. 3,4,4,3 (default: balanced by FLOPs)")
    g.add_argument("--cp", type=int, help="context-parallel degree: each sequence split over cp ranks")
    g.add_argument("--cp-impl", choices=["ring", "allgather"], help="keys and values passed round a ring (default) or "
                                                                    "all-gathered")
    g.add_argument("--cp-order", choices=["zigzag", "contiguous"], help="the chunks each cp rank holds (default "
                                                                        "zigzag: balanced)")
    g.add_argument("--ep", type=int, help="expert-parallel degree: the experts sharded over ep ranks of the dp*cp "
                                          "replicas")
    g.add_argument("--sp", action="store_true", default=None, help="sequence parallelism inside the tp group")
    g.add_argument("--exact", action="store_true", default=None,
                   help="bitwise-identical results across dp, ZeRO stages and restarts (at a fixed tp)")
    g.add_argument("--bucket-mb", type=float)
    g.add_argument("--recompute", action="store_true", default=None, help="recompute each block's activations in the "
                                                                          "backward pass")
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile each block (training; tp = 1)")
    g.add_argument("--attention", choices=["auto", "sdpa", "flash4"],
                   help="the attention kernel: flash4 is flash-attn-4's (pip install flash-attn-4; Hopper and "
                        "Blackwell GPUs), sdpa torch's; auto (the default) flash4 where it runs, else sdpa; "
                        "--exact keeps its own")
    g.add_argument("--cuda-graph", action="store_true", default=None,
                   help="capture a step's GPU work (its NCCL collectives too) once, after two warm-up steps, and "
                        "replay it (ZeRO 0/1, tp = 1)")
    g.add_argument("--offload", choices=["optimizer", "params"],
                   help="optimizer: the fp32 master weights and AdamW moments (this rank's ZeRO shard) in host "
                        "memory, updated there, overlapped with the copies (params: not built yet)")
    g.add_argument("--offload-ratio", type=float, metavar="R",
                   help="with --offload optimizer: the share (0 < R <= 1, default 1) of this rank's optimizer "
                        "state on the host; the leading buckets of the forward keep the rest on the GPU")
    g.add_argument("-r", dest="llmc_recompute", type=int, help="llm.c: >= 1 means --recompute")
    g = p.add_argument_group("processes (llm.c flags)")
    g.add_argument("--init-method", "-pi", choices=["env", "tcp", "fs", "mpi"])
    g.add_argument("--num-processes", "-pn", type=int)
    g.add_argument("--process-rank", "-pr", type=int)
    g.add_argument("--gpus-per-node", "-pg", type=int)
    g.add_argument("--server", "-ps", help="rendezvous address[:port] (tcp)")
    g.add_argument("--fs-path", "-pf", help="shared folder for the rendezvous (fs)")
    g.add_argument("--device", type=device, help="cpu, cuda or cuda:N (default: the local GPU, else cpu)")
    g.add_argument("--dtype", choices=["auto", "fp32", "bf16"])
    g.add_argument("--fp8", choices=["tensorwise", "rowwise"],
                   help="the blocks' linear layers (attention, MLP) compute in float8 with dynamic scales, one per "
                        "tensor or per row (a GPU of compute capability >= 8.9; the CPU through torch's CPU kernel)")
    g.add_argument("--timeout", type=float, help="seconds before a rendezvous or collective is declared hung")
    g.add_argument("--heartbeat-timeout", type=float,
                   help="seconds without a peer's heartbeat before the survivors write their flight logs and exit "
                        "(default 30; 0: off)")
    g.add_argument("--live-recovery", action="store_true", default=None,
                   help="when a rank dies or freezes, the others go on without a restart, taking over its sequences "
                        "(under pp, tp or cp its replica leaves with it; start the ranks with -pi tcp/fs: "
                        "scripts/live.sh)")
    g.add_argument("--join", action="store_true", default=None,
                   help="--live-recovery: join the running job (-pi tcp -ps, its -pn) in place of lost rank -pr, "
                        "taking the state from a peer at a step boundary")
    g = p.add_argument_group("llm.c flags accepted for compatibility and ignored")
    for flag in ("-s", "-h", "-f", "-w", "-k", "-a", "-ge"):
        g.add_argument(flag, dest=f"ignored_{flag[1:]}", metavar="X")
    return p


def train_config(args):
    """The Config of parsed `train` arguments (llm.c's aliases resolved, everything validated)."""
    ignored = [f"-{k[8:]}" for k, v in vars(args).items() if k.startswith("ignored_") and v is not None]
    if args.ignored_h == "1" and args.eval_data:  # llm.c's -h 1 (HellaSwag): --eval-data's evaluation
        ignored.remove("-h")
    if ignored:
        hint = " (-h 1 evaluates with --eval-data FILE)" if "-h" in ignored else ""
        print(f"braidtrain: note: llm.c flag(s) {' '.join(ignored)} have no effect here{hint}", file=sys.stderr)
    overrides = {k: v for k, v in vars(args).items() if k in FIELD_TYPES}
    if args.layout == "auto":
        given = [k for k in AUTO_CHOSEN if overrides.get(k) is not None]
        given += ["recompute"] if args.llmc_recompute else []
        if given:
            flags = " ".join("--" + k.replace("_", "-") for k in given)
            raise UserError(f"--layout auto chooses {flags} itself: drop {flags}, or --layout auto")
    if args.llmc_recompute not in (None, 0, 1, 2):
        raise UserError(f"-r {args.llmc_recompute}: llm.c's recompute level is 0, 1 or 2 (1 or 2: --recompute)")
    if args.llmc_recompute and args.recompute is None:
        overrides["recompute"] = True
    if args.llmc_resume == 1 and not args.resume:
        overrides["resume"] = "auto"
    return build_config(args.config, overrides)
