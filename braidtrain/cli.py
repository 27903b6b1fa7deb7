"""`braidtrain <subcommand>` (also `python -m braidtrain`).

Long options follow Python habits; llm.c's short flags work too, so llm.c's documented training
commands run unchanged apart from the program name. Bad input ends in one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from braidtrain.errors import UserError


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would add a usage block)
        print(f"braidtrain: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _train_parser(sub):
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
    g.add_argument("--lr", "-l", type=float)
    g.add_argument("--final-lr-frac", "-q", type=float)
    g.add_argument("--warmup-steps", "-u", type=int)
    g.add_argument("--weight-decay", "-c", type=float)
    g.add_argument("--grad-clip", type=float)
    g.add_argument("--seed", type=int)
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--val-every", "-v", type=int)
    g.add_argument("--val-steps", "-m", type=int)
    g.add_argument("--sample-tokens", "-g", type=int)
    g.add_argument("--eval-data", metavar="FILE", help="llm.c multiple-choice eval file (HellaSwag; data prepare-eval writes one)")
    g.add_argument("--eval-every", type=int, help="steps between evaluations on it (default: --val-every; 0: only at the end)")
    g.add_argument("--out", "-o", help="run directory (default runs/<timestamp>)")
    g.add_argument("--ckpt-every", "-n", type=int)
    g.add_argument("--keep-ckpts", type=int)
    g.add_argument("--on-save-error", choices=["stop", "continue"],
                   help="a checkpoint save that fails (a full disk): stop the run (default, exit 2) or log it and go on")
    g.add_argument("--max-skipped", type=int,
                   help="stop (exit 3) after this many steps in a row whose loss or gradient is not finite (default 3)")
    g.add_argument("--resume", help="auto (newest valid checkpoint in the run directory) or a checkpoint folder; "
                   "a group restarted by torchrun resumes by itself")
    g.add_argument("--start-over", action="store_true", default=None,
                   help="--out holds another run: move its files aside (to OUT.replaced-TIME) and start a new run there")
    g.add_argument("--init-from", metavar="DIR", help="start from a HuggingFace GPT-2 or Llama folder (braidtrain export "
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
    g.add_argument("--moe-capacity", type=float, help="capacity factor (tokens over it skip the expert); 0: dropless (default)")
    g.add_argument("--moe-aux", type=float, help="the load-balancing loss's coefficient (default 0.01)")
    g.add_argument("--moe-router", choices=["softmax-topk", "topk-softmax"],
                   help="softmax over all experts, top k renormalised (default; Qwen3-MoE, HF's Mixtral) or softmax "
                        "over the top k logits (Mixtral's paper)")
    g.add_argument("--moe-balance", choices=["aux", "bias"],
                   help="the balance loss (default) or DeepSeek-V3's auxiliary-loss-free per-expert bias")
    g.add_argument("--moe-bias-rate", type=float, help="the bias's move a step under --moe-balance bias (default 0.001)")
    g.add_argument("--moe-shared", type=int, help="shared experts of --moe-hidden's width that every token passes "
                                                  "(llama family; default 0)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--layout", choices=["auto"], help="auto: the planner's best layout for these processes and GPUs "
                                                     "(pp, dp, cp, tp, sp, ep, ZeRO, b, recompute), printed at the start")
    g.add_argument("--zero", "-z", type=int, help="ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 + gradients, 3 + parameters")
    g.add_argument("--tp", type=int, help="tensor-parallel degree (consecutive ranks split each layer)")
    g.add_argument("--pp", type=int, help="pipeline stages (consecutive blocks each; dp = processes / (pp * cp * tp))")
    g.add_argument("--pp-schedule", choices=["gpipe", "1f1b", "interleaved", "zb"], help="pipeline schedule (default 1f1b)")
    g.add_argument("--pp-virtual", type=int, help="model chunks a rank holds (interleaved; default 2)")
    g.add_argument("--pp-split", help="blocks per stage (per chunk), e.g. 3,4,4,3 (default: balanced by FLOPs)")
    g.add_argument("--cp", type=int, help="context-parallel degree: each sequence split over cp ranks")
    g.add_argument("--cp-impl", choices=["ring", "allgather"], help="keys and values passed round a ring (default) or all-gathered")
    g.add_argument("--cp-order", choices=["zigzag", "contiguous"], help="the chunks each cp rank holds (default zigzag: balanced)")
    g.add_argument("--ep", type=int, help="expert-parallel degree: the experts sharded over ep ranks of the dp*cp replicas")
    g.add_argument("--sp", action="store_true", default=None, help="sequence parallelism inside the tp group")
    g.add_argument("--exact", action="store_true", default=None,
                   help="bitwise-identical results across dp, ZeRO stages and restarts (at a fixed tp)")
    g.add_argument("--bucket-mb", type=float)
    g.add_argument("--recompute", action="store_true", default=None, help="recompute each block's activations in the backward pass")
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile each block (training; tp = 1)")
    g.add_argument("--cuda-graph", action="store_true", default=None,
                   help="capture a step's GPU work (its NCCL collectives too) once, after two warm-up steps, and replay it (ZeRO 0/1, tp = 1)")
    g.add_argument("-r", dest="llmc_recompute", type=int, help="llm.c: >= 1 means --recompute")
    g = p.add_argument_group("processes (llm.c flags)")
    g.add_argument("--init-method", "-pi", choices=["env", "tcp", "fs", "mpi"])
    g.add_argument("--num-processes", "-pn", type=int)
    g.add_argument("--process-rank", "-pr", type=int)
    g.add_argument("--gpus-per-node", "-pg", type=int)
    g.add_argument("--server", "-ps", help="rendezvous address[:port] (tcp)")
    g.add_argument("--fs-path", "-pf", help="shared folder for the rendezvous (fs)")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: the local GPU, else cpu)")
    g.add_argument("--dtype", choices=["auto", "fp32", "bf16"])
    g.add_argument("--fp8", choices=["tensorwise", "rowwise"],
                   help="the blocks' linear layers (attention, MLP) compute in float8 with dynamic scales, one per "
                        "tensor or per row (a GPU of compute capability >= 8.9; the CPU through torch's CPU kernel)")
    g.add_argument("--timeout", type=float, help="seconds before a rendezvous or collective is declared hung")
    g.add_argument("--heartbeat-timeout", type=float,
                   help="seconds without a peer's heartbeat before the survivors write their flight logs and exit "
                        "(default 30; 0: off)")
    g.add_argument("--live-recovery", action="store_true", default=None,
                   help="when a data-parallel rank dies or freezes, the others go on without a restart, taking over "
                        "its sequences (ZeRO-0; start the ranks with -pi tcp/fs: scripts/live.sh)")
    g.add_argument("--join", action="store_true", default=None,
                   help="--live-recovery: join the running job (-pi tcp -ps, its -pn) in place of lost rank -pr, "
                        "taking the state from a peer at a step boundary")
    g = p.add_argument_group("llm.c flags accepted for compatibility and ignored")
    for flag in ("-s", "-h", "-f", "-w", "-k", "-a", "-ge"):
        g.add_argument(flag, dest=f"ignored_{flag[1:]}", metavar="X")
    return p


def train_config(args):
    """The Config of parsed `train` arguments (llm.c's aliases resolved, everything validated)."""
    from braidtrain.config import FIELD_TYPES, build_config

    ignored = [f"-{k[8:]}" for k, v in vars(args).items() if k.startswith("ignored_") and v is not None]
    if args.ignored_h == "1" and args.eval_data:  # llm.c's -h 1 (HellaSwag): --eval-data's evaluation
        ignored.remove("-h")
    if ignored:
        hint = " (-h 1 evaluates with --eval-data FILE)" if "-h" in ignored else ""
        print(f"braidtrain: note: llm.c flag(s) {' '.join(ignored)} have no effect here{hint}", file=sys.stderr)
    overrides = {k: v for k, v in vars(args).items() if k in FIELD_TYPES}
    if args.layout == "auto":
        from braidtrain.config import AUTO_CHOSEN

        given = [k for k in AUTO_CHOSEN if overrides.get(k) is not None] + (["recompute"] if args.llmc_recompute else [])
        if given:
            flags = " ".join("--" + k.replace("_", "-") for k in given)
            raise UserError(f"--layout auto chooses {flags} itself: drop {flags}, or --layout auto")
    if args.llmc_recompute and args.recompute is None:
        overrides["recompute"] = True
    if args.llmc_resume == 1 and not args.resume:
        overrides["resume"] = "auto"
    return build_config(args.config, overrides)


def cmd_train(args) -> int:
    cfg = train_config(args)
    from braidtrain.train import train  # after validation: bad flags fail fast, before torch loads

    train(cfg)
    return 0


def cmd_data(args) -> int:
    from braidtrain.io.data import prepare

    if args.action == "prepare-eval":
        from braidtrain import evaluate

        print(json.dumps(evaluate.prepare(args.jsonl, args.out, args.tokenizer)))
        return 0

    summary = prepare(args.corpus, args.tokenizer, args.out, val_fraction=args.val_fraction, name=args.name,
                      split=args.split, shard_tokens=args.shard_tokens, text_field=args.text_field,
                      workers=args.workers)
    print(json.dumps({k: summary[k] for k in ("train_tokens", "val_tokens", "documents", "split", "tokenizer",
                                              "vocab_size")}))
    return 0


def cmd_plot(args) -> int:
    from braidtrain.io.metrics import plot_experts, plot_runs, plot_schedule

    if bool(args.runs) + bool(args.schedule) + bool(args.experts) != 1:
        raise UserError("plot needs runs to overlay their losses, --schedule RUN for a pipeline's timeline, or "
                        "--experts RUN for a mixture of experts' load (one of them)")
    if args.schedule:
        plot_schedule(args.schedule, args.out)
    elif args.experts:
        plot_experts(args.experts, args.out)
    else:
        plot_runs(args.runs, args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_doctor(args) -> int:
    from braidtrain.dist.fault import diagnose

    print("\n".join(diagnose(Path(args.run))))
    return 0


def cmd_export(args) -> int:
    from braidtrain.io.export import export

    ckpt = export(args.run, args.out, args.format)
    print(f"wrote {args.out} (HuggingFace GPT-2) from {ckpt}")
    return 0


def cmd_eval(args) -> int:
    from braidtrain import evaluate

    return evaluate.run(args)


def cmd_bench(args) -> int:
    from braidtrain.bench import train as bench

    return bench.run(args)


def cmd_plan(args) -> int:
    from braidtrain.plan import command as plan_cli

    return plan_cli.run(args)


def cmd_sample(args) -> int:
    import torch

    from braidtrain.io.checkpoint import latest, load_model
    from braidtrain.io.data import get_tokenizer
    from braidtrain.generate import generate

    run = Path(args.run)
    model, meta = load_model(run if (run / "meta.json").exists() else latest(run))
    tok = get_tokenizer(meta["tokenizer"])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(device)
    prompt = tok.encode(args.prompt) if args.prompt else [tok.eot]
    model.eval()
    out = generate(model, prompt, args.tokens, block_size=model.cfg.block_size, device=device,
                   temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(args.prompt + tok.decode(out))
    return 0


def run() -> None:
    """The process's entry point (`python -m braidtrain`, the `braidtrain` script): main(), then
    exit. A process that ran collectives leaves without Python's interpreter teardown, once its
    work is done, its files closed and its output flushed: during finalization gloo's worker
    threads may still release tensors, which then aborts the process ("terminate called without an
    active exception", seen about once in a few hundred CPU test runs; torch PR 179291 describes
    it)."""
    rc = main()
    if _ran_collectives:
        sys.stdout.flush()
        sys.stderr.flush()
        mpi = sys.modules.get("mpi4py.MPI")  # -pi mpi: os._exit skips mpi4py's MPI_Finalize at exit, and
        if rc == 0 and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()  # mpirun would call the run failed (a rank that never finalized) and exit 1
        os._exit(rc)
    raise SystemExit(rc)


_ran_collectives = False


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv=None) -> int:
    global _ran_collectives
    parser = Parser(prog="braidtrain", description="Train GPT-style models on 1 to N GPUs.")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    parsers = {"train": _train_parser(sub)}
    d = sub.add_parser("data", help="prepare token shards")
    dsub = d.add_subparsers(dest="action", required=True, parser_class=Parser)
    p = dsub.add_parser("prepare", help="tokenize a corpus into llm.c .bin shards")
    p.add_argument("--corpus", default="shakespeare",
                   help="shakespeare, or a file, folder or glob of text (a folder: *.txt, *.md), *.parquet, *.jsonl, "
                        "*.jsonl.gz")
    p.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes", "llama3"])
    p.add_argument("--out", required=True)
    p.add_argument("--name", help="shard name prefix (default: the corpus name)")
    p.add_argument("--split", choices=["doc", "shard"],
                   help="doc: each document's last --val-fraction to val (the default for text); shard: llm.c's "
                        "fineweb.py, the first shard val (the default for parquet and JSON lines)")
    p.add_argument("--val-fraction", type=float, help="--split doc: each document's share for val (default 0.05)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M, llm.c's)")
    p.add_argument("--text-field", default="text", help="parquet column or JSON field holding the text (default text)")
    p.add_argument("--workers", type=int, default=_cores(), help="tokenizing processes (default: every core, here %(default)s)")
    parsers["data"] = p
    p = dsub.add_parser("prepare-eval", help="write an llm.c multiple-choice eval file from JSON lines")
    p.add_argument("--jsonl", required=True, help='lines of {"context": str, "endings": [str, ...], "label": int}')
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="gpt2", help="gpt2, bytes, llama3, or a data folder (its tokenizer.json)")
    p = parsers["plot"] = sub.add_parser("plot", help="overlay the loss curves of runs; --schedule: a pipeline's timeline; --experts: MoE load")
    p.add_argument("runs", nargs="*")
    p.add_argument("--schedule", metavar="RUN", help="draw each rank's forwards and backwards in the last step of RUN")
    p.add_argument("--experts", metavar="RUN", help="draw each expert's share of the tokens over the steps of RUN (MoE)")
    p.add_argument("--out", default="loss.png")
    p = parsers["sample"] = sub.add_parser("sample", help="generate text from a run's newest checkpoint")
    p.add_argument("run")
    p.add_argument("--prompt", default="")
    p.add_argument("--tokens", "-g", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device")
    p = parsers["eval"] = sub.add_parser("eval", help="multiple-choice accuracy of a run's newest checkpoint (torchrun: over ranks)")
    p.add_argument("run", help="a run directory, or one checkpoint folder")
    p.add_argument("--eval-data", required=True, metavar="FILE", help="llm.c multiple-choice eval file")
    p.add_argument("--out", help="results JSON (default RUN/eval.json)")
    p.add_argument("--device")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p = parsers["doctor"] = sub.add_parser("doctor", help="read a run's flight logs: which rank stopped where")
    p.add_argument("run")
    p = parsers["export"] = sub.add_parser("export", help="write a run's newest checkpoint as a HuggingFace GPT-2 folder")
    p.add_argument("run", help="a run directory, or one checkpoint folder")
    p.add_argument("--format", default="hf", choices=["hf"])
    p.add_argument("--out", required=True)
    from braidtrain.bench import train as bench
    from braidtrain.plan import command as plan_cli  # light: torch loads only inside run()

    parsers["plan"] = plan_cli.add_parser(sub)
    parsers["bench"] = bench.add_parser(sub)
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand's help, not the top level's
        parsers[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    _ran_collectives = args.cmd in ("train", "bench", "eval")
    handler = {"train": cmd_train, "data": cmd_data, "plot": cmd_plot, "sample": cmd_sample, "doctor": cmd_doctor,
               "export": cmd_export, "plan": cmd_plan, "bench": cmd_bench, "eval": cmd_eval}[args.cmd]
    try:
        return handler(args)
    except UserError as e:
        print(f"braidtrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("braidtrain: interrupted", file=sys.stderr)
        return 130
