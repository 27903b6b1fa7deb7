"""`braidtrain bench train`: braidtrain's layouts against torch DDP and FSDP2, and against
transformers' own model of the family (LlamaForCausalLM, GPT2LMHeadModel), side by side.

bench train runs each variant as its own torchrun job on the same --nproc processes -- each
braidtrain layout through the real `braidtrain train` command, each torch variant through
braidtrain/bench/torchref.py -- with the same model, batch, data and optimizer settings, and reads
what they wrote. Separate jobs: one variant's compile caches, memory pool or deterministic-algorithm
switch cannot colour another's figures. The first --warmup steps (compilation, allocator warm-up)
are not timed; tokens/s is the timed tokens over the timed seconds ("median": a step's tokens over
the median timed step, the figure issue #58's targets are stated in); MFU is the model's FLOPs
(GPTConfig.flops_per_token: 6 per weight per token plus attention's 12·L·T·C) at that rate over
the devices' dense peak (metrics.PEAK_FLOPS); memory is torch's peak allocation on rank 0; "host GB" is
a torch variant's peak resident host memory (rank 0's max RSS: what fsdp2-offload keeps on the host;
"-" for braidtrain's, whose `train` does not record it -- benchmarks/speed/fit_gpu.py measures it);
exposed communication is the time the step waited for the gradient reduction after its backward
pass, and busbw (GB/s) the step's collectives' bus bytes over their summed duration -- the
reduction's effective bandwidth while it overlaps the backward pass, to hold against bench comm's
figure at the bucket size (braidtrain only; the step's few tiny collectives are included); "host" is
the share of the step the host took to issue its work (metrics' host_s): near 100%, the GPU waited
for the host -- or a full launch queue held the host back, which a profile tells apart (on CPUs
always near 100%: the work is done as it is issued); "slowest" is the slowest timed step over the
median one, which shows a stall the mean hides; "attn" is the attention kernel a braidtrain run chose
(its summary.json: `--attention`). On GPUs, nvidia-smi samples every GPU five times a
second beside each job, and "SM MHz" and "W" are the mean SM clock and power draw over the samples
of GPUs that were busy (utilization >= BUSY): an H200 held at its 700 W cap runs below its top
clock, and a variant that keeps it busier can be slowed by that (docs/performance.md). The final
loss of every variant is shown: they train the same model on the same sequences, so the losses must
agree to bf16 rounding -- a variant that does less work shows it there. Figures on one host move
5-10% between runs of the same command: --repeat N runs all the variants N times in turn (every
other round in reverse order), and each row is then a variant's median run, its ratio the median of
its rounds' ratios, each against the baseline run of the same round (for an even N the lower of the
middle two; no ratio where a round's baseline failed)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from braidtrain.bench.flags import FLOAT8, GRAPH_LAYOUTS, HF, LAYOUTS, LOSS_TOL, OFFLOAD, PIPE, TITAN, TORCH
from braidtrain.errors import UserError
from braidtrain.io import paths
from braidtrain.model import registry
from braidtrain.options import Parser, train_config, train_parser

SMI = ["nvidia-smi", "--query-gpu=utilization.gpu,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "200"]
BUSY = 90  # bench train: nvidia-smi samples of GPUs at least this busy (%) count for "SM MHz" and "W"


def _variant_rows(args, n: int, d: int, cuda: bool, work: Path):
    """(name, command, reader) of every variant: a reader turns the finished job into a row."""
    model = ["--model", args.model] + [x for k in ("n_layer", "n_head", "n_embd", "n_kv_heads") if getattr(args, k)
                                       for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    common = [*model, "-i", args.train_data, "-b", str(args.batch_size), "-t", str(args.seq_len), "-d", str(d)]
    device = ["--device", args.device] if args.device else []
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m"]
    out = []
    for i, layout in enumerate(args.layout or LAYOUTS + (GRAPH_LAYOUTS if cuda else ())):
        run_dir = work / f"braidtrain{i}"
        cmd = [*launch, "braidtrain", "train", *common, "-x", str(args.steps), "--val-every", "0", "--val-steps", "1",
               "--sample-tokens", "0", "--no-progress", "--no-save", "--out", str(run_dir), *device,
               *shlex.split(layout)]
        out.append((f"braidtrain {layout}", cmd, lambda run_dir=run_dir: _braidtrain_row(run_dir, args.warmup)))
    for mode in [m.strip() for m in args.torch.split(",") if m.strip()]:
        path = work / f"torch-{mode}.json"
        cmd = [*launch, "braidtrain.bench.torchref", "--mode", mode, *common, "--steps", str(args.steps), "--json",
               str(path), *device]
        out.append((f"torch {mode}", cmd, lambda path=path: _torch_row(path, args.warmup)))
    return out


def _braidtrain_row(run_dir: Path, warmup: int) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = run_dir / "summary.json"  # (the attention kernel the run chose)
    timed = recs[warmup:]
    secs = sum(r["step_s"] for r in timed)
    tps = sum(r["tokens_per_s"] * r["step_s"] for r in timed) / secs
    mfu = timed[0]["mfu"] / timed[0]["tokens_per_s"] * tps if timed[0]["mfu"] else None
    comm = [(r["comm_busbw_GBps"], r["comm_s"]) for r in timed if r["comm_busbw_GBps"]]
    busbw = sum(b * s for b, s in comm) / sum(s for _, s in comm) if comm else None  # total bus bytes / total time
    per_step = statistics.median(r["tokens_per_s"] * r["step_s"] for r in timed)  # (the same every step)
    return {"tokens_per_s": tps, "median_tokens_per_s": per_step / statistics.median(r["step_s"] for r in timed),
            "mfu": mfu, "mem_gb": max(r["mem_gb"] for r in recs), "host_gb": None,
            "exposed_comm_frac": sum(r["exposed_comm_s"] for r in timed) / secs, "comm_busbw_GBps": busbw,
            "host_frac": sum(r["host_s"] for r in timed) / secs,
            "slowest": slowest([r["step_s"] for r in timed]), "loss": recs[-1]["loss"],
            "attention": json.loads(summary.read_text()).get("attention") if summary.is_file() else None}


def _torch_row(path: Path, warmup: int) -> dict:
    r = json.loads(path.read_text())
    secs = sum(r["step_s"][warmup:])
    tps = r["tokens_per_step"] * len(r["step_s"][warmup:]) / secs
    mfu = tps * r["flops_per_token"] / r["peak_flops"] if r["peak_flops"] else None
    median = r["tokens_per_step"] / statistics.median(r["step_s"][warmup:])
    return {"tokens_per_s": tps, "median_tokens_per_s": median, "mfu": mfu, "mem_gb": r["mem_gb"],
            "exposed_comm_frac": None, "comm_busbw_GBps": None,
            "host_frac": None, "host_gb": r.get("host_gb"),
            "slowest": slowest(r["step_s"][warmup:]), "loss": r["loss"][-1]}


def gpu_load(lines: list[str]) -> dict:
    """The mean SM clock (MHz) and power draw (W) over nvidia-smi's CSV samples (utilization %,
    clock, power) of GPUs that were at least BUSY % busy; {} when none was (or no line parsed)."""
    busy = []
    for line in lines:
        try:
            util, mhz, watts = (float(x) for x in line.split(","))
        except ValueError:  # a field nvidia-smi could not read ("[N/A]"), a partial last line
            continue
        if util >= BUSY:
            busy.append((mhz, watts))
    if not busy:
        return {}
    return {"sm_mhz": statistics.mean(m for m, _ in busy), "power_w": statistics.mean(w for _, w in busy)}


def slowest(step_s: list[float]) -> float:
    """The slowest timed step over the median one: 1.0x-1.05x for a steady run; more flags a
    stall (a peer late to a collective, the host pausing) that the mean alone would hide."""
    return max(step_s) / statistics.median(step_s)


def _check_train_args(args) -> None:
    """Every bad input a one-line UserError before any job starts (each layout parsed as `train` would)."""
    # the model and its shape flags, as every variant's job will build it
    shape = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "n_kv_heads")}
    for k, v in shape.items():
        if v is not None and v < 1:
            raise UserError(f"--{k.replace('_', '-')} must be positive, got {v}")
    mcfg = registry.model_config(args.model, **shape)
    if args.seq_len > mcfg.block_size:
        raise UserError(f"-t {args.seq_len} is longer than {args.model}'s context ({mcfg.block_size}): "
                        f"use -t {mcfg.block_size} or less")
    torch_modes = [m.strip() for m in args.torch.split(",") if m.strip()]
    every = TORCH + HF + PIPE + FLOAT8 + TITAN + OFFLOAD
    bad = [m for m in torch_modes if m not in every]
    if bad:
        raise UserError(f"unknown torch variant {bad[0]!r}: use some of {', '.join(every)}")
    if "deepspeed-offload" in torch_modes and importlib.util.find_spec("deepspeed") is None:
        raise UserError("--torch deepspeed-offload trains under DeepSpeed's ZeRO-Offload: install the deepspeed "
                        "package (pip install deepspeed), or drop deepspeed-offload from --torch")
    if any(m in HF + OFFLOAD for m in torch_modes):
        _check_hf(mcfg, args.model, [m for m in torch_modes if m in HF + OFFLOAD])
    if any(m in TITAN for m in torch_modes):  # torchtitan importable, the model one it builds
        from braidtrain.bench import titan

        titan.model_args(titan.load(), mcfg, args.seq_len, torch.device("cpu"))
    if args.baseline is None:
        args.baseline = "ddp-compile" if "ddp-compile" in torch_modes or not torch_modes else torch_modes[0]
    if torch_modes and args.baseline not in torch_modes:
        raise UserError(f"--baseline {args.baseline} is not among the torch variants run ({', '.join(torch_modes)})")
    for name in ("batch_size", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("nproc", "total_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.loss_tol is not None and args.loss_tol < 0:
        raise UserError(f"--loss-tol must be >= 0, got {args.loss_tol:g}")
    if args.json_path:
        paths.out_file(args.json_path, "--json")
    if args.keep:
        paths.out_dir(args.keep, "--keep")
    if args.repeat < 1:
        raise UserError(f"--repeat must be positive, got {args.repeat}")
    if args.steps <= args.warmup or args.warmup < 0:
        raise UserError(f"--steps {args.steps} must exceed --warmup {args.warmup} (>= 0): nothing would be timed")
    parser = train_parser(Parser(prog="braidtrain").add_subparsers(parser_class=Parser))
    for layout in args.layout or LAYOUTS + GRAPH_LAYOUTS:
        try:
            train_config(parser.parse_args(shlex.split(layout)))
        except ValueError as e:  # shlex: an unclosed quote
            raise UserError(f"--layout {layout!r}: {e}") from None
    if not Path(args.train_data).exists():
        raise UserError(f"no data at {args.train_data}: prepare it with `python -m braidtrain data prepare "
                        f"--corpus shakespeare --tokenizer gpt2 --out {args.train_data}`")


def _check_hf(mcfg, model: str, modes: list[str]) -> None:
    """--torch hf (hf-compile, fsdp2-offload*): a model of a HuggingFace architecture (a Llama family's
    mixture: Mixtral's or Qwen3-MoE's), transformers installed, with the class of that architecture."""
    these, drop = modes[0], " and ".join(modes)
    try:
        arch = registry.family_of(mcfg).hf_config(mcfg, 0)["architectures"][0]
    except UserError as e:
        raise UserError(f"--torch {these}: {model}: {e}; drop {drop} from --torch") from None
    try:
        import transformers
    except ImportError:
        raise UserError(f"--torch {these} trains transformers' {arch}: install the transformers package "
                        f"(pip install transformers), or drop {drop} from --torch") from None
    if not hasattr(transformers, arch):
        raise UserError(f"--torch {these}: transformers {transformers.__version__} has no {arch} (for --model "
                        f"{model}): upgrade it, or drop {drop} from --torch")


def run_train(args) -> int:
    _check_train_args(args)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda and (args.nproc or 0) > torch.cuda.device_count():
        raise UserError(f"--nproc {args.nproc} is more than the {torch.cuda.device_count()} local GPU(s)")
    n = args.nproc or (torch.cuda.device_count() if cuda else 1)
    d = args.total_batch or 8 * args.batch_size * args.seq_len * n
    if d % (args.batch_size * args.seq_len * n):
        raise UserError(f"-d {d} is not a multiple of b*t*nproc = {args.batch_size * args.seq_len * n}")
    with tempfile.TemporaryDirectory(prefix="braidtrain-bench-") as tmp:
        rounds = []  # each: one run of every variant, rows in variant order
        for r in range(args.repeat):
            folder = round_folder(Path(args.keep or tmp), r, args.repeat)
            folder.mkdir(parents=True, exist_ok=True)
            variants = _variant_rows(args, n, d, cuda, folder)
            if r == 0:
                print(f"bench train: {args.model}, -b {args.batch_size} -t {args.seq_len} -d {d}, {n} process(es), "
                      f"{args.steps} steps ({args.warmup} untimed), {len(variants)} variants"
                      + (f", {args.repeat} rounds" if args.repeat > 1 else ""), file=sys.stderr, flush=True)
            # every other round in reverse order, so that what running first or last does to a
            # variant (a cooler GPU, a warmer one) falls on each variant alike
            order = list(range(len(variants)))[:: -1 if r % 2 else 1]
            rows = _run_variants(args, [variants[i] for i in order], d, n, cuda,
                                 f"round {r + 1}/{args.repeat}, " if args.repeat > 1 else "")
            rounds.append([row for _, row in sorted(zip(order, rows))])
            if not args.keep and args.repeat > 1:  # each variant's run folder (its metrics; --no-save: no checkpoint)
                shutil.rmtree(folder, ignore_errors=True)
    rows = [_median_row([r[i] for r in rounds]) for i in range(len(rounds[0]))]
    _print_train(rows, args.baseline if any(r["ratio"] is not None for r in rows) else None)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1) + "\n")
    _check_losses(rows, args.loss_tol if args.loss_tol is not None else LOSS_TOL["cuda" if cuda else "cpu"])
    return 1 if any("error" in r for r in rows) else 0


def _check_losses(rows: list[dict], tol: float) -> None:
    """Every variant trained the same model on the same sequences: their final losses agree, or
    one of them does other work (a one-line UserError, after the table)."""
    done = [r for r in rows if "error" not in r]
    if not done:
        return
    ref = done[0]
    for r in done[1:]:
        if abs(r["loss"] - ref["loss"]) > tol * abs(ref["loss"]):
            raise UserError(f"final losses disagree: {r['variant']} {r['loss']:.5f} against {ref['variant']} "
                            f"{ref['loss']:.5f} (more than {tol:g} apart, relative): the variants did not do the same "
                            f"work (--loss-tol to allow more)")


def round_folder(work: Path, r: int, repeat: int) -> Path:
    """Where round r (from 0) keeps its variants' run directories: `work` itself for a single round."""
    return work if repeat == 1 else work / f"round{r + 1}"


def run_job(cmd: list, env: dict) -> subprocess.CompletedProcess:
    """One variant's command, its output captured (the tests fork it instead: tests/helpers.forked)."""
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def _run_variants(args, variants, d: int, n: int, cuda: bool, label: str) -> list[dict]:
    """One run of every variant, in order, each row with its ratio to this round's baseline run."""
    rows = []
    smi = cuda and shutil.which(SMI[0]) is not None
    for k, (name, cmd, read) in enumerate(variants, 1):
        t0 = time.time()
        sampler = subprocess.Popen(SMI, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) if smi else None
        p = run_job(cmd, dict(os.environ, PYTHONUNBUFFERED="1"))
        row = {"variant": name, "ranks": n, "tokens_per_step": d}
        if sampler is not None:
            sampler.terminate()
            row.update(gpu_load(sampler.communicate()[0].splitlines()))
        try:
            if p.returncode:
                raise RuntimeError(_last_error(p.stderr + p.stdout))
            row.update(read())
            note = f"{row['tokens_per_s']:,.0f} tokens/s"
        except Exception as e:  # one failed variant does not cost the others' figures
            row["error"] = str(e) or type(e).__name__
            note = "FAILED: " + row["error"]
        rows.append(row)
        print(f"[{label}{k}/{len(variants)}] {name}: {note} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    base = next((r for r in rows if r["variant"] == f"torch {args.baseline}" and "error" not in r), None)
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / base["tokens_per_s"] if base and "error" not in r else None
    return rows


def _median_row(runs: list[dict]) -> dict:
    """A variant over its rounds: the run of median tokens/s and the median of the rounds' ratios
    (each the lower of the middle two), each ratio against the baseline run beside it, so a host
    that drifts between rounds moves both; and every run's tokens/s and ratio. A failed run fails
    the row; a round whose baseline failed leaves every row without a ratio."""
    failed = [r for r in runs if "error" in r]
    row = dict(failed[0] if failed else sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2])
    ratios = [r["ratio"] for r in runs]
    row["ratio"] = None if failed or None in ratios else statistics.median_low(ratios)
    row["runs_tokens_per_s"], row["runs_ratio"] = [r.get("tokens_per_s") for r in runs], ratios
    return row


def _last_error(text: str) -> str:
    """The failed job's own error: the last 'SomethingError: ...' line that is not torchrun's
    report about its child, else torchrun's word on a child killed by a signal."""
    lines = [line.strip() for line in text.splitlines() if line.strip().strip("=")]
    errs = [line for line in lines
            if ("Error" in line.split(":")[0] or "error:" in line) and "ChildFailedError" not in line]
    errs = errs or [line for line in lines if "Signal" in line or "exitcode" in line]
    return (errs or lines or ["exited with an error"])[-1][:300]


def _print_train(rows, baseline) -> None:
    cell = lambda v, f, unit="": "-" if v is None else format(v, f) + unit
    print(f"{'variant':<40}{'attn':>7}{'tokens/s':>12}{'median':>10}{'MFU':>8}{'peak GB':>9}{'host GB':>9}"
          f"{'exposed':>9}{'busbw':>8}{'host':>7}{'slowest':>9}{'SM MHz':>8}"
          f"{'W':>6}{'loss':>9}{'x ' + baseline if baseline else '':>16}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<40}  FAILED: {r['error']}")
            continue
        pct = lambda v: None if v is None else 100 * v
        print(f"{r['variant']:<40}{r.get('attention') or '-':>7}{r['tokens_per_s']:>12,.0f}"
              f"{cell(r.get('median_tokens_per_s'), ',.0f'):>10}"
              f"{cell(pct(r['mfu']), '.1f', '%'):>8}"
              f"{cell(r['mem_gb'], '.2f'):>9}{cell(r.get('host_gb'), '.2f'):>9}"
              f"{cell(pct(r['exposed_comm_frac']), '.2f', '%'):>9}"
              f"{cell(r['comm_busbw_GBps'], '.1f'):>8}{cell(pct(r.get('host_frac')), '.0f', '%'):>7}"
              f"{r['slowest']:>8.2f}x{cell(r.get('sm_mhz'), '.0f'):>8}"
              f"{cell(r.get('power_w'), '.0f'):>6}{r['loss']:>9.4f}{cell(r['ratio'], '.3f'):>16}")
    if len(rows[0]["runs_tokens_per_s"]) > 1:
        print("every run (tokens/s, and x the baseline run of its round):")
        for r in rows:
            runs = "  ".join("-" if t is None else f"{t:,.0f}" for t in r["runs_tokens_per_s"])
            ratios = "  ".join("-" if x is None else f"{x:.3f}" for x in r["runs_ratio"])
            timed = any(x is not None for x in r["runs_ratio"])
            print(f"  {r['variant']:<40}{runs}" + (f"   x {ratios}" if timed else ""))
