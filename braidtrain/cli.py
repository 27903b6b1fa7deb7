"""`braidtrain <subcommand>` (also `python -m braidtrain`): the subcommands' parsers and handlers
(train's options: options.py; plan's: plan/flags.py; bench's: bench/flags.py). Bad input ends in
one line on stderr and exit code 2, never a traceback. Parsing loads neither torch nor the model
code: a command's modules are imported when it runs, so bad flags fail fast.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from braidtrain.bench import flags as bench_flags
from braidtrain.errors import Stopped, UserError
from braidtrain.config import INT_MAX
from braidtrain.options import Parser, device, train_config, train_parser
from braidtrain.plan import flags as plan_flags


def cmd_train(args) -> int:
    cfg = train_config(args)
    check_train_paths(cfg)
    train(cfg)
    return 0


def check_train_paths(cfg) -> None:
    """What a run writes and reads, before any of its work: the run directory; the token files'
    headers (build.py reads their tokens); the eval file (small: read whole, its tokens against the
    data's vocabulary); --init-from's folder (config.json, the safetensors headers); a --resume
    folder."""
    from braidtrain import evaluate
    from braidtrain.io import data, export, paths

    paths.out_dir(cfg.out or "runs", "--out")
    train_files = data.resolve_files(cfg.train_data, "train")
    for f in train_files + data.resolve_files(cfg.val_data or cfg.train_data, "val"):
        data.read_bin(f)
    if cfg.eval_data:
        examples = evaluate.read_evalfile(paths.in_file(cfg.eval_data, "--eval-data"))
        evaluate.check_tokens(examples, data.data_tokenizer(train_files, cfg.tokenizer)[1])
    if cfg.init_from:
        export.check_folder(cfg.init_from)
    if cfg.resume not in (None, "auto"):
        paths.in_dir(cfg.resume, "--resume")


def train(cfg) -> dict:
    """One training run: the Trainer, or with --live-recovery (or --join) live/'s LiveTrainer."""
    from braidtrain.live import LiveTrainer, check_config
    from braidtrain.train import Trainer

    if cfg.live_recovery or cfg.join:
        check_config(cfg)
    trainer = LiveTrainer(cfg) if cfg.live_recovery else Trainer(cfg)
    finished = False
    try:
        summary = trainer.run()
        finished = True
        return summary
    finally:
        trainer.drop_graph(wait=False)  # these two are no-ops after a clean finish
        trainer.guard.close(clean=False)
        trainer.rt.close(clean=finished)


def cmd_data(args) -> int:
    from braidtrain.io.corpus import prepare

    if args.action == "prepare-eval":
        from braidtrain import evaluate
        from braidtrain.io import paths

        paths.in_file(args.jsonl, "--jsonl")
        paths.out_file(args.out, "--out")
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

    from matplotlib.backend_bases import FigureCanvasBase

    from braidtrain.io import paths

    if bool(args.runs) + bool(args.schedule) + bool(args.experts) != 1:
        raise UserError("plot needs runs to overlay their losses, --schedule RUN for a pipeline's timeline, or "
                        "--experts RUN for a mixture of experts' load (one of them)")
    for run, flag in [(r, "RUN") for r in args.runs] + [(args.schedule, "--schedule"), (args.experts, "--experts")]:
        if run:
            paths.in_dir(run, flag)
    kinds = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(args.out).suffix
    if suffix and suffix[1:].lower() not in kinds:
        raise UserError(f"--out {args.out}: matplotlib cannot write {suffix} files: use one of "
                        f"{', '.join('.' + k for k in sorted(kinds))}")
    paths.out_file(args.out, "--out")
    if args.schedule:
        plot_schedule(args.schedule, args.out)
    elif args.experts:
        plot_experts(args.experts, args.out)
    else:
        plot_runs(args.runs, args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_doctor(args) -> int:
    from braidtrain.collective.doctor import diagnose

    print("\n".join(diagnose(Path(args.run))))
    return 0


def cmd_export(args) -> int:
    from braidtrain.io.export import export

    ckpt, arch = export(args.run, args.out, args.format)
    print(f"wrote {args.out} (HuggingFace {arch}) from {ckpt}")
    return 0


def cmd_eval(args) -> int:
    from braidtrain import evaluate

    return evaluate.run(args)


def cmd_bench(args) -> int:
    if args.what == "train":
        from braidtrain.bench.train import run_train

        return run_train(args)
    from braidtrain.bench.comm import run_comm

    return run_comm(args)


def cmd_plan(args) -> int:
    from braidtrain.io import paths
    from braidtrain.plan import command

    if args.check is not None and args.data:  # (--check's folders, before the planner's work)
        paths.in_dir(args.data, "--data")
    if args.check is not None and args.out:
        paths.out_dir(args.out, "--out")

    return command.run(args)


def cmd_sample(args) -> int:
    if not 0 <= args.tokens <= INT_MAX:
        raise UserError(f"--tokens must be >= 0, got {args.tokens}" if args.tokens < 0 else
                        f"--tokens {args.tokens} is out of range: at most {INT_MAX}")
    if args.temperature <= 0:
        raise UserError(f"--temperature must be positive (lower: closer to the likeliest token), got "
                        f"{args.temperature:g}")
    if args.top_k < 1:
        raise UserError(f"--top-k must be at least 1 (1: always the likeliest token), got {args.top_k}")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed must be in 0..2^63-1, got {args.seed}")
    import torch

    from braidtrain.generate import generate
    from braidtrain.io.checkpoint import load_model
    from braidtrain.io.data import get_tokenizer
    from braidtrain.io.export import checkpoint_of

    gpu = int(args.device.partition(":")[2] or 0) if args.device and args.device != "cpu" else None
    if gpu is not None and gpu >= torch.cuda.device_count():
        raise UserError(f"--device {args.device}: torch sees {torch.cuda.device_count()} GPU(s) here: use --device "
                        f"cpu" + (" or cuda:0" if torch.cuda.device_count() else ""))
    model, meta = load_model(checkpoint_of(args.run))
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


def build_parser() -> tuple[Parser, dict[str, Parser]]:
    """The command line's parser, and each subcommand's by name ("data": data prepare's, "data
    prepare-eval"), whose help an unknown flag names."""
    parser = Parser(prog="braidtrain", description="Train GPT-style models on 1 to N GPUs.")
    sub = parser.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    parsers = {"train": train_parser(sub)}
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
    p.add_argument("--workers", type=int, default=_cores(), help="tokenizing processes (default: every core, here "
                                                                 "%(default)s)")
    parsers["data"] = p
    p = parsers["data prepare-eval"] = dsub.add_parser("prepare-eval", help="write an llm.c multiple-choice eval "
                                                                            "file from JSON lines")
    p.add_argument("--jsonl", required=True, help='lines of {"context": str, "endings": [str, ...], "label": int}')
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="gpt2", help="gpt2, bytes, llama3, or a data folder (its tokenizer.json)")
    p = parsers["plot"] = sub.add_parser("plot", help="overlay the loss curves of runs; --schedule: a pipeline's "
                                                      "timeline; --experts: MoE load")
    p.add_argument("runs", nargs="*")
    p.add_argument("--schedule", metavar="RUN", help="draw each rank's forwards and backwards in the last step of RUN")
    p.add_argument("--experts", metavar="RUN", help="draw each expert's share of the tokens over the steps of RUN "
                                                    "(MoE)")
    p.add_argument("--out", default="loss.png")
    p = parsers["sample"] = sub.add_parser("sample", help="generate text from a run's newest checkpoint")
    p.add_argument("run")
    p.add_argument("--prompt", default="")
    p.add_argument("--tokens", "-g", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=device, help="cpu, cuda or cuda:N (default: the GPU, else cpu)")
    p = parsers["eval"] = sub.add_parser("eval", help="multiple-choice accuracy of a run's newest checkpoint "
                                                      "(torchrun: over ranks)")
    p.add_argument("run", help="a run directory, or one checkpoint folder")
    p.add_argument("--eval-data", required=True, metavar="FILE", help="llm.c multiple-choice eval file")
    p.add_argument("--out", help="results JSON (default RUN/eval.json)")
    p.add_argument("--device", type=device, help="cpu, cuda or cuda:N (default: the local GPU, else cpu)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p = parsers["doctor"] = sub.add_parser("doctor", help="read a run's flight logs: which rank stopped where")
    p.add_argument("run")
    what = ("write a run's newest checkpoint as a HuggingFace folder of its family (GPT2LMHeadModel, "
            "LlamaForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or Qwen3MoeForCausalLM)")
    p = parsers["export"] = sub.add_parser("export", help=what, description=what[0].upper() + what[1:] + ".")
    p.add_argument("run", help="a run directory, or one checkpoint folder")
    p.add_argument("--format", default="hf", choices=["hf"], help="hf: config.json and model.safetensors")
    p.add_argument("--out", required=True, help="the folder to write (transformers' from_pretrained reads it)")
    parsers["plan"] = plan_flags.add_parser(sub)
    parsers["bench"] = bench_flags.add_parser(sub)
    return parser, parsers


def main(argv=None) -> int:
    global _ran_collectives
    parser, parsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand's help, not the top level's
        name = "data prepare-eval" if getattr(args, "action", None) == "prepare-eval" else args.cmd
        parsers[name].error(f"unrecognized arguments: {' '.join(extra)}")
    _ran_collectives = args.cmd in ("train", "bench", "eval")
    handler = {"train": cmd_train, "data": cmd_data, "plot": cmd_plot, "sample": cmd_sample, "doctor": cmd_doctor,
               "export": cmd_export, "plan": cmd_plan, "bench": cmd_bench, "eval": cmd_eval}[args.cmd]
    try:
        return handler(args)
    except Stopped as e:  # (a signal: the run said what it saved)
        return e.exit_code
    except UserError as e:
        print(f"braidtrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("braidtrain: interrupted", file=sys.stderr)
        return 130
