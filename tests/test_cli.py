"""The command line, end to end: every bad input ends in exactly one line on stderr,
`braidtrain: error: <what to change>`, and exit code 2 (no traceback, no usage block);
a small run writes its run directory, and `sample` / `plot` read it back.

Every case runs the real CLI in a process of its own (`python -m braidtrain ...`, forked by
helpers.launch), so what is tested is what a user sees.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from braidtrain.io import data as D
from helpers import braidtrain

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
    [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}

# A small, fast model: 2 layers, 64 channels, 2 heads; -b 2 -t 64 (128 tokens a micro-step).
B, T = 2, 64
TINY = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "-t", str(T), "-b", str(B),
        "-x", "2", "--val-every", "0", "--sample-tokens", "0", "--no-progress"]


# TINY less -b
AUTO = TINY[:TINY.index("-b")] + TINY[TINY.index("-b") + 2:] + ["-d", str(4 * B * T), "--layout", "auto"]


def cli(*args, cwd, timeout=180, nproc=1) -> subprocess.CompletedProcess:
    """`python -m braidtrain ARGS` in a scratch folder (so nothing lands in the repo)."""
    return braidtrain(*args, cwd=cwd, environ=ENV, timeout=timeout, nproc=nproc, check=False)


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    """Exit code 2 and exactly one stderr line `braidtrain: error: ...` naming every word of the fix."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, f"exit code {proc.returncode}, expected 2; stderr:\n{proc.stderr}"
    lines = err.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got {len(lines)}:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith("braidtrain: error:"), line
    for w in words:
        assert w in line, f"{w!r} missing from the message: {line}"
    return line


def header(magic=D.MAGIC, version=D.VERSION, count=0) -> bytes:
    h = np.zeros(D.HEADER_INTS, np.int32)
    h[:3] = magic, version, count
    return h.tobytes()


# ----------------------------------------------------------------------------- fixtures
# The module starts every command it will check at once (a few at a time) in the `jobs` fixture,
# and each test waits for its own result.

@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def data_dir(scratch) -> Path:
    out = scratch / "data"
    proc = cli("data", "prepare", "--corpus", "shakespeare", "--tokenizer", "bytes", "--out", out, cwd=scratch)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["vocab_size"] == 256
    assert sorted(f.name for f in out.glob("*.bin")) == ["shakespeare_train_000000.bin", "shakespeare_val_000000.bin"]
    return out


@pytest.fixture(scope="module")
def paths(scratch, data_dir) -> SimpleNamespace:
    """Every bad input file the cases need, each in its own folder."""
    p = SimpleNamespace(data=data_dir, scratch=scratch)
    tokens = np.arange(1000, dtype=np.uint16) % 200

    def folder(name):
        d = scratch / name
        d.mkdir()
        return d

    # a folder with training data but no *val*.bin
    p.no_val = folder("no_val")
    D.write_bin(p.no_val / "x_train_000000.bin", tokens)
    # garbage: 4 KiB of text, no llm.c header (wrong magic)
    p.garbage = folder("garbage") / "junk_train.bin"
    p.garbage.write_bytes(b"this is not a token file\n" * 170)
    # garbage shorter than the 1024-byte header
    p.short = folder("short") / "short_train.bin"
    p.short.write_bytes(b"oops")
    # right magic, version 7
    p.bad_version = folder("bad_version") / "v7_train.bin"
    p.bad_version.write_bytes(header(version=7, count=tokens.size) + tokens.tobytes())
    # header says 5000 tokens, file holds 1000
    p.truncated = folder("truncated") / "cut_train.bin"
    p.truncated.write_bytes(header(count=5000) + tokens.tobytes())
    # token 300 in a bytes (256) corpus, announced by tokenizer.json beside it
    p.oov_dir = folder("oov")
    p.oov = p.oov_dir / "oov_train.bin"
    D.write_bin(p.oov, np.concatenate([tokens, [300], tokens]).astype(np.uint16))
    (p.oov_dir / "tokenizer.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 256}))
    # config files
    p.unknown_key = scratch / "unknown_key.toml"
    p.unknown_key.write_text("batch_size = 2\nfoo = 1\n")
    p.bad_type = scratch / "bad_type.toml"
    p.bad_type.write_text('batch_size = "x"\n')
    p.bad_toml = scratch / "bad_toml.toml"
    p.bad_toml.write_text("batch_size = = 2\n")
    p.empty = folder("empty_run")
    return p


# ----------------------------------------------------------------------------- bad input: train
# Each case: (id, args(p) -> command line after `train`, words(p) -> what the message must name).

def _d_values(d: int) -> list[str]:
    """The nearest multiples of b*t (dp = 1) around d: the values the message should suggest."""
    unit = B * T
    lo = max(unit, d // unit * unit)
    hi = lo + unit if lo < d else lo
    return sorted({f"-d {lo}", f"-d {hi}"})


TRAIN_CASES = [
    # 1. data files
    ("missing-train-data", lambda p: ["-i", "/nonexistent/shards"], lambda p: ["/nonexistent/shards", "-i"]),
    ("missing-val-data", lambda p: ["-i", p.data, "-j", p.no_val], lambda p: [str(p.no_val), "val", "-j"]),
    ("garbage-bin-wrong-magic", lambda p: ["-i", p.garbage, "--tokenizer", "bytes"],
     lambda p: [str(p.garbage), "magic", str(D.MAGIC)]),
    ("garbage-bin-shorter-than-header", lambda p: ["-i", p.short, "--tokenizer", "bytes"],
     lambda p: [str(p.short), "truncated"]),
    ("bin-bad-version", lambda p: ["-i", p.bad_version, "--tokenizer", "bytes"],
     lambda p: [str(p.bad_version), "version 7"]),
    ("bin-truncated", lambda p: ["-i", p.truncated, "--tokenizer", "bytes"],
     lambda p: [str(p.truncated), "5000", "1000", "truncated"]),
    ("bin-token-outside-vocab", lambda p: ["-i", p.oov], lambda p: [str(p.oov), "300", "256"]),
    # 2. -d not a multiple of b*t*dp: the two nearest valid values
    ("d-not-multiple", lambda p: ["-i", p.data, "-d", 200], lambda p: ["-d 200", str(B * T), *_d_values(200)]),
    ("d-below-one-micro-step", lambda p: ["-i", p.data, "-d", 100], lambda p: ["-d 100", *_d_values(100)]),
    # 3. config files
    ("config-unknown-key", lambda p: ["-i", p.data, "--config", p.unknown_key], lambda p: ["'foo'", p.unknown_key.name]),
    ("config-wrong-type", lambda p: ["-i", p.data, "--config", p.bad_type], lambda p: ["batch_size", "int", "'x'"]),
    ("config-invalid-toml", lambda p: ["-i", p.data, "--config", p.bad_toml], lambda p: [p.bad_toml.name, "TOML"]),
    ("config-file-missing", lambda p: ["-i", p.data, "--config", p.scratch / "nope.toml"], lambda p: ["nope.toml", "not found"]),
    # 4. zero or negative sizes
    ("batch-size-0", lambda p: ["-i", p.data, "-b", 0], lambda p: ["batch_size", "positive", "0"]),
    ("seq-len-negative", lambda p: ["-i", p.data, "-t", -5], lambda p: ["seq_len", "positive", "-5"]),
    ("max-steps-0", lambda p: ["-i", p.data, "-x", 0], lambda p: ["max_steps", "positive", "0"]),
    ("n-layer-0", lambda p: ["-i", p.data, "--n-layer", 0], lambda p: ["n_layer", "positive", "0"]),
    ("total-batch-0", lambda p: ["-i", p.data, "-d", 0], lambda p: ["total_batch", "positive", "0"]),
    ("lr-0", lambda p: ["-i", p.data, "--lr", 0], lambda p: ["lr", "positive", "0"]),
    # 5. sequence longer than the context (tiny: block_size 256)
    ("seq-len-over-context", lambda p: ["-i", p.data, "-t", 100000], lambda p: ["100000", "context", "256", "-t 256"]),
    # 6. an unknown config name lists the known ones
    ("config-unknown-name", lambda p: ["-i", p.data, "--config", "nosuchconfig"],
     lambda p: ["nosuchconfig", *sorted(f.stem for f in (REPO / "braidtrain" / "configs").glob("*.toml"))]),
    # 7. ZeRO stage not available
    ("zero-stage-7", lambda p: ["-i", p.data, "-z", 7], lambda p: ["ZeRO", "7", "-z 0"]),
    # 8. a combination that does not exist yet
    ("compile-with-tp", lambda p: ["-i", p.data, "--tp", 2, "--compile"], lambda p: ["--compile", "tp", "drop --compile"]),
    ("cuda-graph-zero-2", lambda p: ["-i", p.data, "-z", 2, "--cuda-graph"], lambda p: ["--cuda-graph", "ZeRO", "-z 0 or 1"]),
    ("cuda-graph-on-cpu", lambda p: ["-i", p.data, "--device", "cpu", "--cuda-graph"], lambda p: ["--cuda-graph", "GPU", "cpu"]),
    # 9. the layout (layout.py's checks: test_layout has every one; here, that each reaches the user so)
    ("ep-without-experts", lambda p: ["-i", p.data, "--ep", 2], lambda p: ["--ep 2", "mixture of experts", "--ep 1"]),
    ("cp-seq-len", lambda p: ["-i", p.data, "--cp", 2, "-t", 62], lambda p: ["-t 62", "2*cp = 4 "
                                                                                      "chunks", "-t 60 or -t 64"]),
    ("sp-without-tp", lambda p: ["-i", p.data, "--sp"], lambda p: ["--sp", "--tp 2 or more"]),
    ("tp-not-dividing-heads", lambda p: ["-i", p.data, "--tp", 3], lambda p: ["tp=3", "n_head=2", "{1,2}"]),
    ("tp-not-dividing-world", lambda p: ["-i", p.data, "--tp", 2], lambda p: ["= 2 does not divide the world size 1"]),
    ("layout-auto-with-b", lambda p: ["-i", p.data, "--layout", "auto"], lambda p: ["--layout auto", "--batch-size"]),
]


@pytest.fixture(scope="module")
def jobs(paths):
    """Every command of this module that needs nothing but `paths`, started at once on a small pool:
    name -> Future of its CompletedProcess. The slow ones (real runs, torchrun) go first."""
    workers = max(2, min(4, os.cpu_count() or 2))
    with ThreadPoolExecutor(workers) as pool:
        futures = {
            "exact": pool.submit(torchrun_exact, paths),
            "good": pool.submit(good_run, paths),
            "llmc": pool.submit(cli, "train", *TINY, "-i", paths.data, "--out", paths.scratch / "runs" / "llmc",
                                "-h", "1", "-f", "1", cwd=paths.scratch),
            "auto": pool.submit(cli, "train", *AUTO, "-i", paths.data, "--out", paths.scratch / "runs" / "auto",
                                cwd=paths.scratch),
            "sample-empty": pool.submit(cli, "sample", paths.empty, cwd=paths.scratch),
            "plot-empty": pool.submit(cli, "plot", paths.empty, "--out", paths.scratch / "never.png", cwd=paths.scratch),
        }
        for name, args, _ in TRAIN_CASES:
            # TINY first, the case's flags last: the case's value of a flag wins
            futures[name] = pool.submit(cli, "train", *TINY, "--out", paths.scratch / "runs" / name, *args(paths),
                                        cwd=paths.scratch)
        yield futures
        for f in futures.values():
            f.cancel()


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_bad_input(case, paths, jobs):
    name, _, words = case
    assert_one_line_error(jobs[name].result(), *words(paths))
    # a run that never started leaves no metrics behind
    assert not (paths.scratch / "runs" / name / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- bad input: argparse
ARGPARSE_CASES = [
    ("train-unknown-option", ["train", "--bogus-flag", "1"], ["--bogus-flag"]),
    ("train-bad-int", ["train", "-b", "two"], ["-b", "two"]),
    ("train-bad-choice", ["train", "--init-method", "carrier-pigeon"], ["carrier-pigeon", "env"]),
    ("unknown-subcommand", ["fly"], ["fly", "train"]),
    ("no-subcommand", [], []),
    ("data-prepare-missing-out", ["data", "prepare"], ["--out"]),
    ("sample-unknown-option", ["sample", "somewhere", "--bogus"], ["--bogus"]),
]


@pytest.mark.parametrize("argv,words", [c[1:] for c in ARGPARSE_CASES], ids=[c[0] for c in ARGPARSE_CASES])
def test_argparse_errors_are_one_line(argv, words, scratch):
    assert_one_line_error(cli(*argv, cwd=scratch), *words)


HELP_HINTS = [
    (["train", "--bogus-flag"], "`braidtrain train --help`"),
    (["train", "-b", "two"], "`braidtrain train --help`"),
    (["data", "prepare"], "`braidtrain data prepare --help`"),
    (["fly"], "`braidtrain --help`"),
]


@pytest.mark.parametrize("argv,hint", HELP_HINTS, ids=["unknown-option", "bad-int", "data-prepare", "unknown-subcommand"])
def test_argparse_error_points_to_the_right_help(argv, hint, scratch):
    """The hint must name a command that exists, the one whose options were wrong."""
    line = assert_one_line_error(cli(*argv, cwd=scratch))
    assert hint in line, line


# ----------------------------------------------------------------------------- bad input: sample, plot

def test_sample_without_checkpoints(paths, jobs):
    assert_one_line_error(jobs["sample-empty"].result(), str(paths.empty), "checkpoint")


def test_plot_without_metrics(paths, jobs):
    assert_one_line_error(jobs["plot-empty"].result(), str(paths.empty), "metrics.jsonl")
    assert not (paths.scratch / "never.png").exists()


# ----------------------------------------------------------------------------- bad input: --exact under torchrun

EXACT_DP = 2
EXACT_UNIT = B * T * EXACT_DP  # tokens of one micro-step over all ranks


def torchrun_exact(paths) -> subprocess.CompletedProcess:
    """2 ranks, --exact, 3 micro-steps per rank."""
    return cli("train", *TINY, "-i", paths.data, "--out", paths.scratch / "runs" / "exact", "--exact",
               "-d", 3 * EXACT_UNIT, cwd=paths.scratch, timeout=240, nproc=EXACT_DP)


def test_exact_needs_power_of_two_micro_steps(paths, jobs):
    """dp=2 with 3 micro-steps per rank cannot be the canonical pairwise tree: each child says so
    on one line, suggesting the power-of-two -d values around it (2 and 4 micro-steps per rank)."""
    unit = EXACT_UNIT
    out = paths.scratch / "runs" / "exact"
    proc = jobs["exact"].result()
    assert proc.returncode != 0, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "braidtrain: error:" in line]
    assert errors, f"no braidtrain error line from the children:\n{proc.stderr}"
    for line in errors:
        line = line[line.index("braidtrain: error:"):]
        assert "power-of-two" in line, line
        assert f"-d {2 * unit}" in line and f"-d {4 * unit}" in line, line
    # each child stops with its one line, not a traceback of ours
    # (torchrun prints its own traceback; a child's would run through our files)
    assert f'File "{REPO / "braidtrain"}' not in proc.stderr, proc.stderr
    assert not (out / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- a good run, end to end

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gb", "step_s", "host_s"}


def good_run(paths) -> SimpleNamespace:
    """A 2-step run, then `sample` and `plot` on it (one chain, so it overlaps the other jobs)."""
    out = paths.scratch / "runs" / "good"
    r = SimpleNamespace(out=out, png=out.parent / "x.png", sample=None, plot=None)
    r.proc = cli("train", *TINY, "-i", paths.data, "--out", out, cwd=paths.scratch)
    if r.proc.returncode == 0:
        r.sample = cli("sample", out, "--prompt", "ROMEO:", "-g", "20", cwd=out.parent)
        r.plot = cli("plot", out, out, "--out", r.png, cwd=out.parent)
    return r


@pytest.fixture(scope="module")
def run(jobs):
    return jobs["good"].result()


def test_train_two_steps(run):
    assert run.proc.returncode == 0, run.proc.stderr
    assert "braidtrain: error" not in run.proc.stderr
    out = run.out
    cfg = (out / "config.toml").read_text()
    assert "batch_size = 2" in cfg and "seq_len = 64" in cfg and "n_layer = 2" in cfg
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert METRIC_KEYS <= r.keys(), sorted(r)
        assert np.isfinite(r["loss"]) and r["loss"] > 0 and r["lr"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["host_s"] <= r["step_s"], r  # the host's part of the step: issuing its work
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 2
    assert re.fullmatch(r"[0-9a-f]{64}", summary["weights_sha256"]), summary["weights_sha256"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sample_from_run(run):
    assert run.proc.returncode == 0, run.proc.stderr
    proc = run.sample
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ROMEO:"), proc.stdout
    assert len(proc.stdout.rstrip("\n")) > len("ROMEO:")


def test_plot_runs(run):
    assert run.proc.returncode == 0, run.proc.stderr
    png, proc = run.png, run.plot
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_llmc_ignored_flags_are_accepted(paths, jobs):
    """llm.c's -h 1 (HellaSwag) and -f 1 (flash attention) parse, do nothing, and say so."""
    out = paths.scratch / "runs" / "llmc"
    proc = jobs["llmc"].result()
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("braidtrain: note:")]
    assert len(notes) == 1 and "-h" in notes[0] and "-f" in notes[0] and "no effect" in notes[0], proc.stderr
    assert (out / "summary.json").is_file()


def test_layout_auto_trains_the_planners_recommendation(paths, jobs):
    """--layout auto on one CPU process: it prints the layout it took, that is the planner's
    recommendation for the same model, memory and batch, and the run trains with it."""
    import tomllib

    from braidtrain.plan.memory import GB
    from braidtrain.plan.search import plan
    from braidtrain.plan.space import Setup
    from braidtrain.model.registry import model_config

    proc = jobs["auto"].result()
    assert proc.returncode == 0, proc.stderr
    said = next(line for line in proc.stdout.splitlines() if "--layout auto:" in line)
    cfg = tomllib.loads((paths.scratch / "runs" / "auto" / "config.toml").read_text())
    model = model_config("tiny", json.loads((Path(paths.data) / "tokenizer.json").read_text())["vocab_size"],
                         n_layer=2, n_embd=64, n_head=2)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    best = plan(Setup(model, 1, mem, T, 4 * B * T, cpu=True))["rows"][0]["layout"]
    assert f"--layout auto: {best.name()}, dp 1" in said, (said, best)
    assert (cfg["batch_size"], cfg["zero"], cfg.get("recompute", False)) == (best.b, best.zero, best.recompute)
    assert len([line for line in (paths.scratch / "runs" / "auto" / "metrics.jsonl").read_text().splitlines() if line]) == 2
