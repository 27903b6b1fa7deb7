"""Every path and value checked before the work (issue 56, item 4): for every subcommand, each bad
output path (a file where a folder goes, a folder where a file goes, a missing or unwritable
parent), each numeric flag's bad values (negative, zero, NaN, infinite, out of range) and each
file it reads (missing, empty, damaged, another model's or tokenizer's) ends in exactly one line,
`braidtrain: error: ...`, exit code 2, no traceback -- and nothing left behind (no run directory of
a refused start, no output file).

The cases run in this process, through the command line's entry function (cli.main): each fails
in its checks, before any process group forms, so no process is needed. Should a check be missing,
the command would do its work here; `guarded` turns the first step of that work into a test
failure instead. A few cases run as real processes (test_end_to_end) to show the same line and
exit code from `python -m braidtrain`. test_every_numeric_flag_has_a_case walks every parser:
a new numeric flag without a case here fails it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from braidtrain import cli
from braidtrain import evaluate as E
from braidtrain.io import data as D
from helpers import braidtrain

TINY = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "-t", "64", "-b", "2", "-x", "1",
        "--val-every", "0", "--sample-tokens", "0", "--no-progress"]
BIG = str(2**31)  # an integer out of every count's range
HUGE = str(2**64)  # one no flag takes


class Reached(Exception):
    """A case got past the checks to the command's work."""


def _readonly(tmp: Path) -> Path | None:
    """A folder this process cannot write in: a chmod 555 one, or for root (whom a mode does not
    stop) /sys; None where neither is."""
    mine = tmp / "readonly"
    mine.mkdir()
    mine.chmod(0o555)
    for d in (mine, Path("/sys")):
        try:
            fd, name = tempfile.mkstemp(dir=d)
        except OSError:
            return d
        os.close(fd)
        os.unlink(name)
    return None


@pytest.fixture(scope="module")
def p(tmp_path_factory) -> SimpleNamespace:
    """The good inputs (token data, a run with a checkpoint, its HF export, an eval file) and the
    bad ones, each from a good one."""
    tmp = tmp_path_factory.mktemp("inputs")
    p = SimpleNamespace(tmp=tmp, data=tmp / "data", run=tmp / "run", hf=tmp / "hf", ro=_readonly(tmp))
    braidtrain("data", "prepare", "--corpus", "shakespeare", "--tokenizer", "bytes", "--out", p.data, cwd=tmp)
    braidtrain("train", *TINY, "-i", p.data, "--out", p.run, cwd=tmp)
    braidtrain("export", p.run, "--out", p.hf, cwd=tmp)
    p.ckpt = p.run / "checkpoints" / "step_00000001"
    p.file = tmp / "a_file"
    p.file.write_text("x")
    p.empty = tmp / "empty"
    p.empty.write_bytes(b"")
    p.eval = tmp / "ok.eval"
    E.write_evalfile(p.eval, [E.Example(i, 0, [1, 2, 3], [[4, 5], [6]]) for i in range(4)])
    p.eval_gpt2 = tmp / "gpt2.eval"  # another tokenizer's: ids past the bytes model's 256
    E.write_evalfile(p.eval_gpt2, [E.Example(i, 0, [1000, 2, 3], [[40000, 5], [6]]) for i in range(4)])
    p.eval_cut = tmp / "cut.eval"
    p.eval_cut.write_bytes(p.eval.read_bytes()[:-7])
    p.jsonl = tmp / "ok.jsonl"
    p.jsonl.write_text(json.dumps({"context": "ab", "endings": ["c", "d"], "label": 0}) + "\n")
    # damaged copies of the run's checkpoint, of its HF folder
    p.cut_run, p.bad_meta_run, p.hf_cut, p.hf_bad_json = (tmp / n for n in ("cut_run", "bad_meta", "hf_cut", "hf_json"))
    for run in (p.cut_run, p.bad_meta_run):
        shutil.copytree(p.run / "checkpoints", run / "checkpoints")
    f = p.cut_run / "checkpoints" / p.ckpt.name / "rank_00000.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    (p.bad_meta_run / "checkpoints" / p.ckpt.name / "meta.json").write_text("{oops")
    for hf in (p.hf_cut, p.hf_bad_json):
        shutil.copytree(p.hf, hf)
    f = p.hf_cut / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    (p.hf_bad_json / "config.json").write_text("{")
    # another tokenizer's data: gpt2 ids, which the bytes model of the run and its export cannot take
    p.gpt2_data = tmp / "gpt2_data"
    p.gpt2_data.mkdir()
    ids = (np.arange(5000) * 37 % 50257).astype(np.uint16)
    for split in ("train", "val"):
        D.write_bin(p.gpt2_data / f"x_{split}_000000.bin", ids)
    (p.gpt2_data / "tokenizer.json").write_text(json.dumps({"tokenizer": "gpt2", "vocab_size": 50257}))
    p.no_run = tmp / "no_run"
    p.no_run.mkdir()
    p.toml_nan, p.toml_big = tmp / "nan.toml", tmp / "big.toml"  # (TOML has nan; the parser's check is not met)
    p.toml_nan.write_text("lr = nan\n")
    p.toml_big.write_text("keep_ckpts = 4294967296\n")
    for name, text in (("flight_cut", '{"flight": 1, "ses'), ("flight_list", "[1]\n")):
        (tmp / name / "flight").mkdir(parents=True)
        (tmp / name / "flight" / "rank_00000.jsonl").write_text(text)
    return p


def new(p, name: str) -> Path:
    """A path that does not exist yet, and must not after a refused command (in p.tmp/new, a folder
    each case removes)."""
    (p.tmp / "new").mkdir(exist_ok=True)
    return p.tmp / "new" / name


# ----------------------------------------------------------------------------- the cases
# (id, argv(p), words the line must hold, paths(p) that must not exist afterwards)

def train(flags):
    return lambda p: ["train", *TINY, "-i", p.data, "--out", new(p, "train"), *flags(p)]


def c(case_id, argv, *words, absent=lambda p: [new(p, "train"), new(p, "out")]):
    return pytest.param(argv, words, absent, id=case_id)


# train's numeric flags: each below its least value and past its range (config.validate); floats: NaN
# and infinity (the parser) and below their least value
TRAIN_INTS = {"--n-layer": 1, "--n-head": 1, "--n-embd": 1, "--block-size": 1, "--n-kv-heads": 1, "-b": 1, "-t": 1,
              "-d": 1, "-x": 1, "-u": 0, "--seed": 0, "-v": 0, "-m": 1, "-g": 0, "-n": 0, "--keep-ckpts": 1,
              "--max-skipped": 1, "--moe-experts": 0, "--moe-top-k": 1, "--moe-every": 1, "--moe-hidden": 0,
              "--moe-shared": 0, "-z": 0, "--tp": 1, "--pp": 1, "--pp-virtual": 1, "--cp": 1, "--ep": 1, "-r": 0,
              "-pn": 1, "-pr": 0, "-pg": 1}
TRAIN_FLOATS = {"--lr": "0", "-q": "-0.1", "-c": "-1", "--grad-clip": "-1", "--moe-capacity": "-1", "--moe-aux": "-1",
                "--moe-bias-rate": "-1", "--bucket-mb": "0", "--timeout": "0", "--heartbeat-timeout": "-1",
                "--preempt-budget": "0"}

LONG = {"-t": "--seq-len", "-d": "--total-batch", "-b": "--batch-size"}  # what the messages call them
CASES = [
    *[c(f"train {f} {v}", train(lambda p, f=f, v=v: [f, v]), str(v))
      for f, low in TRAIN_INTS.items() for v in (low - 1 if f != "-x" else -2, BIG if f != "--seed" else 2**63)],
    c("train -y 2", train(lambda p: ["-y", 2]), "-y", "2"),
    c("train -x -1 is one epoch, -x -2 is not", train(lambda p: ["-x", -2]), "max_steps", "-1"),
    c("train -z 4", train(lambda p: ["-z", 4]), "ZeRO", "4"),
    c("train --eval-every -1", train(lambda p: ["--eval-data", p.eval, "--eval-every", -1]), "eval_every", "-1"),
    c("train int past int64", train(lambda p: ["-b", HUGE]), "--batch-size", "out of range"),
    *[c(f"train {f} {v}", train(lambda p, f=f, v=v: [f, v]), v if v[0] != "-" or f == "-q" else "got",
        "finite" if v in ("nan", "inf") else "")
      for f, low in TRAIN_FLOATS.items() for v in ("nan", "inf", low)],
    c("train -q 1.5", train(lambda p: ["-q", 1.5]), "final_lr_frac", "[0, 1]"),
    *[c(f"train --offload-ratio {v}", train(lambda p, v=v: ["--offload", "optimizer", "--offload-ratio", v]),
        "--offload-ratio", "finite" if v == "nan" else "0 < R <= 1") for v in ("0", "nan", "1.5")],
    c("train --offload-ratio without --offload", train(lambda p: ["--offload-ratio", 0.5]), "needs --offload optimizer"),
    c("train --attention flash4 --exact", train(lambda p: ["--attention", "flash4", "--exact"]), "--exact",
      "drop --attention"),
    c("train --attention flash4 --dtype fp32", train(lambda p: ["--attention", "flash4", "--dtype", "fp32"]),
      "--dtype fp32", "drop one"),
    c("train --attention flash4 on the CPU", train(lambda p: ["--attention", "flash4"]), "flash-attn-4",
      "--attention sdpa"),
    # train's paths
    c("train --out a file", lambda p: ["train", *TINY, "-i", p.data, "--out", p.file], lambda p: str(p.file), "is a file"),
    c("train --out under a file", lambda p: ["train", *TINY, "-i", p.data, "--out", p.file / "run"], "is a file"),
    c("train --out read-only", lambda p: ["train", *TINY, "-i", p.data, "--out", p.ro / "run"], "cannot write"),
    c("train --eval-data missing", train(lambda p: ["--eval-data", p.tmp / "nope.eval"]), "nope.eval"),
    c("train --eval-data empty", train(lambda p: ["--eval-data", p.empty]), lambda p: str(p.empty)),
    c("train --eval-data truncated", train(lambda p: ["--eval-data", p.eval_cut]), "truncated"),
    c("train --eval-data a token file", train(lambda p: ["--eval-data", next(p.data.glob("*val*.bin"))]),
      "token file"),
    c("train --eval-data of another tokenizer", train(lambda p: ["--eval-data", p.eval_gpt2]), "40000",
      "vocabulary"),
    c("train --init-from missing", train(lambda p: ["--init-from", p.tmp / "nope"]), "--init-from", "nope"),
    c("train --init-from a file", train(lambda p: ["--init-from", p.file]), "--init-from"),
    c("train --init-from truncated", train(lambda p: ["--init-from", p.hf_cut]), "--init-from", "model.safetensors"),
    c("train --init-from bad config.json", train(lambda p: ["--init-from", p.hf_bad_json]), "config.json", "JSON"),
    c("train --init-from another tokenizer", train(lambda p: ["--init-from", p.hf, "-i", p.gpt2_data]),
      "vocabulary", "256", "50257"),
    c("train --resume missing", train(lambda p: ["--resume", p.tmp / "nope"]), "--resume", "nope"),
    c("train --resume a file", train(lambda p: ["--resume", p.file]), "--resume", lambda p: str(p.file)),
    c("train -i empty file", train(lambda p: ["-i", p.empty, "--tokenizer", "bytes"]), lambda p: str(p.empty)),
    c("train -i a file not data", train(lambda p: ["-i", p.jsonl, "--tokenizer", "bytes"]), lambda p: str(p.jsonl)),
    c("train --config a folder", train(lambda p: ["--config", p.tmp]), "is a folder"),
    c("train --config with lr = nan", train(lambda p: ["--config", p.toml_nan]), "lr", "nan"),
    c("train --config with a size past 2^31", train(lambda p: ["--config", p.toml_big]), "keep_ckpts", "out of range"),
    # data prepare
    c("data prepare --out a file", lambda p: ["data", "prepare", "--tokenizer", "bytes", "--out", p.file],
      "is a file"),
    c("data prepare --out read-only", lambda p: ["data", "prepare", "--tokenizer", "bytes", "--out", p.ro / "d"],
      "cannot write"),
    c("data prepare --corpus empty", lambda p: ["data", "prepare", "--corpus", p.empty, "--tokenizer", "bytes",
                                                "--out", new(p, "out")], "no documents"),
    c("data prepare --val-fraction nan", lambda p: ["data", "prepare", "--val-fraction", "nan", "--out", new(p, "out")],
      "finite"),
    c("data prepare --val-fraction 1", lambda p: ["data", "prepare", "--val-fraction", 1, "--out", new(p, "out")],
      "val_fraction"),
    c("data prepare --shard-tokens 0", lambda p: ["data", "prepare", "--shard-tokens", 0, "--out", new(p, "out")],
      "shard_tokens"),
    c("data prepare --shard-tokens big", lambda p: ["data", "prepare", "--shard-tokens", BIG, "--out",
                                                    new(p, "out")], "shard_tokens"),
    c("data prepare --workers 0", lambda p: ["data", "prepare", "--workers", 0, "--out", new(p, "out")], "workers"),
    c("data prepare --workers huge", lambda p: ["data", "prepare", "--workers", BIG, "--out", new(p, "out")],
      "workers"),
    c("data prepare --name with a slash", lambda p: ["data", "prepare", "--name", "a/b", "--out", new(p, "out")],
      "--name"),
    # data prepare-eval
    c("prepare-eval --out a folder", lambda p: ["data", "prepare-eval", "--jsonl", p.jsonl, "--out", p.tmp],
      "is a folder"),
    c("prepare-eval --out in a missing folder", lambda p: ["data", "prepare-eval", "--jsonl", p.jsonl, "--out",
                                                           new(p, "out") / "x.eval"], "does not exist"),
    c("prepare-eval --out read-only", lambda p: ["data", "prepare-eval", "--jsonl", p.jsonl, "--out",
                                                 p.ro / "x.eval"], "cannot write"),
    c("prepare-eval --jsonl missing", lambda p: ["data", "prepare-eval", "--jsonl", p.tmp / "no.jsonl", "--out",
                                                 new(p, "x.eval")], "no.jsonl"),
    c("prepare-eval --jsonl empty", lambda p: ["data", "prepare-eval", "--jsonl", p.empty, "--out",
                                               new(p, "x.eval")], lambda p: str(p.empty)),
    c("prepare-eval --tokenizer unknown", lambda p: ["data", "prepare-eval", "--jsonl", p.jsonl, "--tokenizer", "foo",
                                                     "--out", new(p, "x.eval")], "foo"),
    # sample
    c("sample -g -1", lambda p: ["sample", p.run, "-g", -1], "--tokens", "-1"),
    c("sample -g big", lambda p: ["sample", p.run, "-g", BIG], "--tokens", "out of range"),
    c("sample --temperature 0", lambda p: ["sample", p.run, "--temperature", 0], "--temperature", "0"),
    c("sample --temperature -1", lambda p: ["sample", p.run, "--temperature", -1], "--temperature"),
    c("sample --temperature nan", lambda p: ["sample", p.run, "--temperature", "nan"], "finite"),
    c("sample --top-k 0", lambda p: ["sample", p.run, "--top-k", 0], "--top-k", "0"),
    c("sample --seed -1", lambda p: ["sample", p.run, "--seed", -1], "--seed", "-1"),
    c("sample --seed huge", lambda p: ["sample", p.run, "--seed", HUGE], "--seed", "out of range"),
    c("sample --device bogus", lambda p: ["sample", p.run, "--device", "bogus"], "bogus"),
    c("sample a missing run", lambda p: ["sample", p.tmp / "nope"], "nope"),
    c("sample a file", lambda p: ["sample", p.file], lambda p: str(p.file)),
    c("sample a run without checkpoints", lambda p: ["sample", p.no_run], "checkpoint"),
    c("sample a truncated checkpoint", lambda p: ["sample", p.cut_run], "checkpoint"),
    c("sample a damaged meta.json", lambda p: ["sample", p.bad_meta_run / "checkpoints" / p.ckpt.name], "meta.json"),
    # eval: every path before the model loads
    c("eval --out a folder", lambda p: ["eval", p.run, "--eval-data", p.eval, "--out", p.tmp], "is a folder"),
    c("eval --out read-only", lambda p: ["eval", p.run, "--eval-data", p.eval, "--out", p.ro / "e.json"],
      "cannot write"),
    c("eval --out in a missing folder", lambda p: ["eval", p.run, "--eval-data", p.eval, "--out",
                                                   new(p, "out") / "e.json"], "does not exist"),
    c("eval RUN missing", lambda p: ["eval", p.tmp / "nope", "--eval-data", p.eval], "nope"),
    c("eval RUN a file", lambda p: ["eval", p.file, "--eval-data", p.eval], lambda p: str(p.file)),
    c("eval a truncated checkpoint", lambda p: ["eval", p.cut_run, "--eval-data", p.eval], "checkpoint"),
    c("eval --eval-data missing", lambda p: ["eval", p.run, "--eval-data", p.tmp / "no.eval"], "no.eval"),
    c("eval --eval-data empty", lambda p: ["eval", p.run, "--eval-data", p.empty], lambda p: str(p.empty)),
    c("eval --eval-data truncated", lambda p: ["eval", p.run, "--eval-data", p.eval_cut], "truncated"),
    c("eval --eval-data of another tokenizer", lambda p: ["eval", p.run, "--eval-data", p.eval_gpt2], "vocabulary"),
    c("eval --device bogus", lambda p: ["eval", p.run, "--eval-data", p.eval, "--device", "bogus"], "bogus"),
    # export
    c("export --out a file", lambda p: ["export", p.run, "--out", p.file], "is a file"),
    c("export --out read-only", lambda p: ["export", p.run, "--out", p.ro / "hf"], "cannot write"),
    c("export RUN missing", lambda p: ["export", p.tmp / "nope", "--out", new(p, "out")], "nope"),
    c("export a truncated checkpoint", lambda p: ["export", p.cut_run, "--out", new(p, "out")], "no valid checkpoint"),
    c("export a damaged meta.json", lambda p: ["export", p.bad_meta_run / "checkpoints" / p.ckpt.name, "--out",
                                               new(p, "out")], "meta.json"),
    # plot
    c("plot --out a folder", lambda p: ["plot", p.run, "--out", p.tmp], "is a folder"),
    c("plot --out read-only", lambda p: ["plot", p.run, "--out", p.ro / "x.png"], "cannot write"),
    c("plot --out in a missing folder", lambda p: ["plot", p.run, "--out", new(p, "out") / "x.png"], "does not exist"),
    c("plot --out an unknown format", lambda p: ["plot", p.run, "--out", new(p, "x.nope")], ".nope"),
    c("plot RUN missing", lambda p: ["plot", p.tmp / "nope", "--out", new(p, "x.png")], "nope"),
    c("plot RUN a file", lambda p: ["plot", p.file, "--out", new(p, "x.png")], lambda p: str(p.file)),
    c("plot --schedule missing", lambda p: ["plot", "--schedule", p.tmp / "nope", "--out", new(p, "x.png")], "nope"),
    c("plot --experts of a dense run", lambda p: ["plot", "--experts", p.run, "--out", new(p, "x.png")], "moe_load"),
    # doctor
    c("doctor RUN missing", lambda p: ["doctor", p.tmp / "nope"], "nope"),
    c("doctor a run without flight logs", lambda p: ["doctor", p.run], "flight"),
    c("doctor a truncated flight log", lambda p: ["doctor", p.tmp / "flight_cut"], "rank_00000.jsonl", "unreadable"),
    c("doctor a flight log of no records", lambda p: ["doctor", p.tmp / "flight_list"], "rank_00000.jsonl"),
    # plan
    *[c(f"plan {f} {v}", lambda p, f=f, v=v: ["plan", f, v], LONG.get(f, f), str(v)) for f, v in
      (("--n-layer", 0), ("--n-head", -1), ("--n-embd", 0), ("--block-size", 0), ("--n-kv-heads", 0), ("--vocab", 0),
       ("--gpus", 0), ("--gpus-per-node", 0), ("--gpu-mem", 0), ("-t", 0), ("-d", -1), ("--tflops", -1),
       ("--busbw", 0), ("--tp-busbw", 0), ("--node-busbw", 0), ("--bucket-mb", 0), ("--tp", 0), ("--pp", -1),
       ("--cp", 0), ("--ep", 0), ("--moe-experts", -1), ("--moe-top-k", 0), ("--moe-every", 0),
       ("--moe-hidden", -1), ("--moe-capacity", -1), ("--alpha-us", -1), ("--top", -1))],
    c("plan --gpus out of range", lambda p: ["plan", "--gpus", BIG], "--gpus", "out of range"),
    c("plan -z 4", lambda p: ["plan", "-z", 4], "-z", "4"),
    c("plan -b 3", lambda p: ["plan", "-b", 3], "-b", "3"),
    c("plan --gpu-mem nan", lambda p: ["plan", "--gpu-mem", "nan"], "--gpu-mem", "finite"),
    c("plan --host-mem nan", lambda p: ["plan", "--host-mem", "nan"], "--host-mem", "finite"),
    c("plan --host-mem 0", lambda p: ["plan", "--host-mem", "0"], "--host-mem"),
    c("plan --tflops inf", lambda p: ["plan", "--tflops", "inf"], "--tflops", "finite"),
    c("plan --params 0", lambda p: ["plan", "--params", "0"], "--params"),
    c("plan --offload-ratio inf", lambda p: ["plan", "--offload-ratio", "inf"], "--offload-ratio", "finite"),
    c("plan --offload-ratio 0", lambda p: ["plan", "--offload-ratio", "0"], "--offload-ratio", "0 < R <= 1"),
    c("plan --offload-ratio with --no-offload", lambda p: ["plan", "--no-offload", "--offload-ratio", "0.5"],
      "needs --offload"),
    c("plan --params nonsense", lambda p: ["plan", "--params", "1.2.3B"], "--params"),
    c("plan --check --out a file", lambda p: ["plan", "--model", "tiny", "--check", "0,1", "--data", p.data, "--out",
                                              p.file], "is a file"),
    c("plan --check --data missing", lambda p: ["plan", "--model", "tiny", "--check", "0,1", "--data",
                                                p.tmp / "nope"], "nope"),
    # bench comm
    c("bench comm --iters 0", lambda p: ["bench", "comm", "--iters", 0], "--iters"),
    c("bench comm --warmup -1", lambda p: ["bench", "comm", "--warmup", -1], "--warmup"),
    c("bench comm --min-bytes 0", lambda p: ["bench", "comm", "--min-bytes", 0], "--min-bytes"),
    c("bench comm --min-bytes -1K", lambda p: ["bench", "comm", "--min-bytes", "-1K"], "--min-bytes"),
    c("bench comm --max-bytes inf", lambda p: ["bench", "comm", "--max-bytes", "infK"], "--max-bytes"),
    c("bench comm --max-bytes below --min-bytes", lambda p: ["bench", "comm", "--min-bytes", "1M", "--max-bytes",
                                                             "1K"], "--max-bytes"),
    c("bench comm --json a folder", lambda p: ["bench", "comm", "--json", p.tmp], "is a folder"),
    c("bench comm --json read-only", lambda p: ["bench", "comm", "--json", p.ro / "x.json"], "cannot write"),
    # bench train
    *[c(f"bench train {f} {v}", lambda p, f=f, v=v: ["bench", "train", "-i", p.data, f, v], LONG.get(f, f), str(v))
      for f, v in
      (("--n-layer", 0), ("--n-head", 0), ("--n-embd", -1), ("--n-kv-heads", 0), ("-b", 0), ("-t", 0), ("-d", -1),
       ("--steps", 0), ("--warmup", -1), ("--nproc", 0), ("--repeat", 0), ("--loss-tol", -1))],
    c("bench train --loss-tol nan", lambda p: ["bench", "train", "-i", p.data, "--loss-tol", "nan"], "finite"),
    c("bench train --json a folder", lambda p: ["bench", "train", "-i", p.data, "--json", p.tmp], "is a folder"),
    c("bench train --json read-only", lambda p: ["bench", "train", "-i", p.data, "--json", p.ro / "x.json"],
      "cannot write"),
    c("bench train --keep a file", lambda p: ["bench", "train", "-i", p.data, "--keep", p.file], "is a file"),
    c("bench train --keep read-only", lambda p: ["bench", "train", "-i", p.data, "--keep", p.ro / "k"],
      "cannot write"),
    c("bench train -i missing", lambda p: ["bench", "train", "-i", p.tmp / "nope"], "nope"),
]


@pytest.fixture
def guarded(monkeypatch):
    """The first step of each command's work raises Reached (a case that passed its checks)."""
    from braidtrain import evaluate, generate
    from braidtrain.bench import comm, train
    from braidtrain.collective import runtime
    from braidtrain.io import corpus
    from braidtrain.plan import check

    def reached(*a, **k):
        raise Reached()

    monkeypatch.setattr(runtime.Runtime, "join", reached)  # train: the process group
    monkeypatch.setattr(evaluate, "score", reached)
    monkeypatch.setattr(generate, "generate", reached)
    monkeypatch.setattr(comm, "init_runtime", reached)
    monkeypatch.setattr(train, "_run_variants", reached)
    monkeypatch.setattr(corpus, "encoded", reached)
    monkeypatch.setattr(check, "check", reached)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)


def call(argv) -> tuple[int, str]:
    """cli.main(argv) here: (exit code, stderr)."""
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        try:
            rc = cli.main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code
    return rc, err.getvalue()


def assert_one_line(rc, err: str, words) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("braidtrain: error: "), (rc, err)
    for w in words:
        assert w in lines[0], f"{w!r} missing from: {lines[0]}"
    return lines[0]


@pytest.mark.parametrize("argv,words,absent", CASES)
def test_bad_input(argv, words, absent, p, guarded):
    if p.ro is None and "ro" in argv.__code__.co_names:
        pytest.skip("no folder here that this process cannot write in")
    before = sorted(p.tmp.rglob("*"))
    shutil.rmtree(p.tmp / "new", ignore_errors=True)
    try:
        rc, err = call(argv(p))
    except Reached:
        pytest.fail("the command went on to its work: a check is missing")
    finally:
        left = [path for path in absent(p) if path.exists()]
        shutil.rmtree(p.tmp / "new", ignore_errors=True)  # (the next case starts clean)
    assert_one_line(rc, err, [w(p) if callable(w) else str(w) for w in words])
    assert not left, f"left behind: {left}"
    assert sorted(p.tmp.rglob("*")) == [f for f in before if "new" not in f.relative_to(p.tmp).parts], \
        "the command changed the fixtures' folder"


def numeric_flags():
    """(command, flag) of every int or float flag of every subcommand."""
    parser, _ = cli.build_parser()
    out, todo = [], [("", parser)]
    while todo:
        name, prs = todo.pop()
        for a in prs._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {k}".strip(), sp) for k, sp in a.choices.items()]
            elif a.type in (int, float) or getattr(a.type, "__name__", "") == "_size":
                out.append((name, a.option_strings))
    return out


def test_every_numeric_flag_has_a_case():
    """A numeric flag of any subcommand, added without a bad-value case in CASES, fails here."""
    ids = [case.id for case in CASES]
    missing = [f"{cmd} {opts[0]}" for cmd, opts in numeric_flags()
               if not any(i.startswith(f"{cmd} {o} ") for i in ids for o in opts)]
    assert not missing, f"numeric flags without a bad-value case: {missing}"


# ----------------------------------------------------------------------------- end to end

E2E = [
    ("train --out a file", lambda p: ["train", *TINY, "-i", p.data, "--out", p.file], ["is a file"]),
    ("eval --out in a missing folder", lambda p: ["eval", p.run, "--eval-data", p.eval, "--out",
                                                  new(p, "out") / "e.json"], ["does not exist"]),
    ("sample --temperature nan", lambda p: ["sample", p.run, "--temperature", "nan"], ["finite"]),
]


@pytest.mark.parametrize("argv,words", [e[1:] for e in E2E], ids=[e[0] for e in E2E])
def test_end_to_end(argv, words, p):
    """The same line and exit code from a process of its own: `python -m braidtrain ...`."""
    proc = braidtrain(*argv(p), cwd=p.tmp, check=False, timeout=120)
    assert_one_line(proc.returncode, proc.stderr, words)
    assert not new(p, "out").exists()
