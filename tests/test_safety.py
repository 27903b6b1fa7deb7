"""A run that goes wrong stops safely (issue #23): non-finite steps are skipped on every rank
alike and, K in a row, stop the run (exit 3) with its last good checkpoint intact; out of memory
is one line with the planner's view; checkpoint folders that are not shared are named at the
first save; a --resume path that does not exist says so. Faults come from the BRAIDTRAIN_FAULT
test hook (collective/inject.py): "nan", "nan-on", "oom", "local-disk"."""

import pytest
import torch

from helpers import SMALL, braidtrain, env, metrics, summary
from test_cli import assert_one_line_error
from braidtrain.plan.estimate import estimate
from braidtrain.plan.memory import GB
from braidtrain.plan.search import advice
from braidtrain.plan.space import Candidate, Setup
from braidtrain.model.registry import model_config

BASE = [*SMALL, "-d", 256]


def run(*args, fault=None, nproc=1, fsize=None):
    """`fsize`: a file-size limit (bytes) on the run, as a full disk would stop its writes."""
    e = dict(env(), **({"BRAIDTRAIN_FAULT": fault} if fault else {}))
    return braidtrain("train", *args, nproc=nproc, environ=e, fsize=fsize, check=False)


def stopped(p) -> str:
    """The one error line of a run that stopped itself (exit 3)."""
    lines = [line for line in p.stderr.splitlines() if line.startswith("braidtrain: error:")]
    assert p.returncode == 3 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr
    return lines[0]


def test_the_diverging_run_skips_its_steps_and_stops(tmp_path, shakespeare):
    """The issue's run: lr 1e4 without clipping diverges at step 2; steps 2-4 are skipped (logged
    with their reason), the run stops after 3 with exit 3 naming the step and what to try; no
    checkpoint is written from what it did; the flight log is."""
    out = tmp_path / "run"
    p = run(*BASE, "-i", shakespeare, "-x", 30, "--lr", "1e4", "--grad-clip", 0, "--ckpt-every", 5, "--out", out)
    line = stopped(p)
    for w in ("steps 2-4 were skipped, 3 in "
              "a row", "stopped at step 4", "no checkpoint was saved", "--lr", "--grad-clip"):
        assert w in line, (w, line)
    rows = metrics(out)
    assert [r.get("skipped", False) for r in rows] == [False, True, True, True]
    assert all(r["grad_norm"] is None and "gradient norm" in r["skip_reason"] for r in rows[1:])
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("step_*"))
    assert (out / "flight" / "rank_00000.jsonl").is_file()


def test_nan_from_step_7_keeps_the_step_5_checkpoint_and_resume_loads_it(tmp_path, shakespeare):
    out = tmp_path / "run"
    args = [*BASE, "-i", shakespeare, "-x", 12, "--ckpt-every", 5, "--max-skipped", 3, "--out", out]
    line = stopped(run(*args, fault="nan-on:step=7"))
    assert "steps 7-9 were skipped" in line and "step_00000005" in line, line
    assert [c.name for c in (out / "checkpoints").glob("step_*")] == ["step_00000005"]
    assert [r["step"] for r in metrics(out) if r.get("skipped")] == [7, 8, 9]
    p = run(*args, "--resume", "auto")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "step_00000005 (step 5)" in p.stdout
    assert summary(out)["step"] == 12 and summary(out)["skipped_steps"] == 0


def test_one_nan_on_one_rank_is_skipped_on_every_rank(tmp_path, shakespeare):
    """Exact mode: a NaN loss on rank 1 of 2 at step 3 skips step 3 on both (the global norm decides);
    the run trains on to the single process's weights with the same step skipped -- had rank 0
    applied it, its weights (the ones hashed) would differ -- and not to a clean run's."""
    args = [*BASE, "-i", shakespeare, "-x", 5, "--exact"]
    two, one, clean = tmp_path / "two", tmp_path / "one", tmp_path / "clean"
    p = run(*args, "--out", two, fault="nan:step=3:rank=1", nproc=2)
    assert p.returncode == 0 and "does not see the checkpoint files" not in p.stdout, p.stderr[-3000:]
    q = run(*args, "--out", one, fault="nan:step=3")
    assert q.returncode == 0, q.stderr[-3000:]
    assert run(*args, "--out", clean).returncode == 0
    for r in (two, one):
        assert [m["step"] for m in metrics(r) if m.get("skipped")] == [3] and summary(r)["skipped_steps"] == 1
        assert "loss is nan" in next(m for m in metrics(r) if m.get("skipped"))["skip_reason"]
    assert summary(two)["weights_sha256"] == summary(one)["weights_sha256"] != summary(clean)["weights_sha256"]
    assert [m["loss"] for m in metrics(two)] == [m["loss"] for m in metrics(one)]


@pytest.mark.parametrize("exact", [False, True], ids=["fused", "exact"])
def test_a_skipped_update_changes_no_weight_or_moment(exact):
    """AdamW with skip = 1: parameters (decay too), m and v bitwise as they were; skip = 0 moves them
    -- the fused kernel's update and exact mode's (optim.exact_adamw) alike."""
    from types import SimpleNamespace

    from braidtrain.optim import AdamW

    p, g = torch.randn(256), torch.randn(256)
    bucket = SimpleNamespace(data=p, grad=g, padded=256, params=[("w", p.view(16, 16))], offsets=[0])
    engine = SimpleNamespace(owned=lambda: iter([(bucket, p, g)]), buckets=[bucket], zero=0, exact=exact,
                             decay_segments=lambda b: [(0, 256)], owned_range=lambda b: (0, 256), device=torch.device("cpu"),
                             publish=lambda buckets: None)  # (the shards are the weights: no bf16 copy to write)
    opt = AdamW(engine, weight_decay=0.1)
    opt.prepare(1e-2)
    opt.update(skip=torch.zeros(()))
    before = [t.clone() for t in (p, *opt.groups[0][:2])]
    opt.prepare(1e-2)
    opt.update(skip=torch.ones(()))
    assert all(torch.equal(a, b) for a, b in zip(before, (p, *opt.groups[0][:2])))
    opt.update(skip=torch.zeros(()))
    assert not torch.equal(before[0], p)


def test_a_full_disk_keeps_the_previous_checkpoint_and_stops_or_goes_on(tmp_path, shakespeare):
    """Under a 1 MB file-size limit (the checkpoint's rank file is ~4 MB) the step-4 save fails on
    the first write: by default one line (exit 2) and the step-2 checkpoint intact; with
    --on-save-error continue a line, training to the end (where the final save failing fails the
    run), the step-2 checkpoint still the newest, and a resume without the limit loads it."""
    from braidtrain.io import checkpoint

    out = tmp_path / "run"
    args = [*BASE, "-i", shakespeare, "--ckpt-every", 2, "--out", out]
    assert run(*args, "-x", 2).returncode == 0
    p = run(*args, "-x", 4, "--resume", "auto", fsize=1 << 20)
    err = [line for line in p.stderr.splitlines() if line.startswith("braidtrain: error:")]
    assert p.returncode == 2 and len(err) == 1 and "could not write checkpoint" in err[0], p.stderr[-3000:]
    assert "File too large" in err[0] and "previous checkpoint is intact" in err[0]
    checkpoint.verify(out / "checkpoints" / "step_00000002")
    p = run(*args, "-x", 6, "--resume", "auto", "--on-save-error", "continue", fsize=1 << 20)
    assert p.returncode == 2 and "final checkpoint" in p.stderr, p.stderr[-3000:]  # (the final save fails the run)
    # step 4's; step 6's, the final one, is the error
    assert sum("training goes on (--on-save-error continue)" in line for line in p.stdout.splitlines()) == 1
    assert [m["step"] for m in metrics(out)][-1] == 6
    assert [c.name for c in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_00000002"]
    p = run(*args, "-x", 3, "--resume", "auto")
    assert p.returncode == 0 and "step_00000002 (step 2)" in p.stdout


def test_out_of_memory_is_one_line_with_the_planners_view(tmp_path, shakespeare):
    """(The hook's own line announces the fault; the run's is the one error line, exit 2.)"""
    out = tmp_path / "run"
    p = run(*BASE, "-i", shakespeare, "-x", 3, "--out", out, fault="oom:step=2")
    errors = [line for line in p.stderr.splitlines() if not line.startswith("braidtrain: fault injected")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr
    for w in ("braidtrain: error: out of memory on cpu (rank 0) at step 2", "the planner estimates", "braidtrain plan"):
        assert w in errors[0], (w, errors[0])
    assert (out / "flight" / "rank_00000.jsonl").is_file()


def test_the_planners_advice_for_a_layout_that_does_not_fit():
    """gpt2-xl at b = 16 on one 40 GB GPU: the estimate over 40 GB, and changes that the planner
    itself says fit."""
    s = Setup(model_config("gpt2-xl", 50257), 1, 40, 1024, 16384)
    msg = advice(s, Candidate(1, 0, 16, False))
    est = estimate(s, Candidate(1, 0, 16, False))["mem"]["total"] / GB
    assert est > 40 and msg.startswith(f"the planner estimates {est:.1f} GB a rank for ZeRO-0 b=16 (of 40.0 GB); use ")
    assert "b=2" in msg and estimate(s, Candidate(1, 0, 2, False))["fits"]


def test_checkpoint_folders_that_are_not_shared_are_named_at_the_first_save(tmp_path, shakespeare):
    """Rank 1's marker lands in a folder of its own (the hook standing in for a node-local disk)."""
    p = run(*BASE, "-i", shakespeare, "-x", 2, "--out", tmp_path / "run", fault="local-disk:step=1:rank=1", nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    warn = [line for line in p.stdout.splitlines() if "does not see the checkpoint files of rank(s) 1" in line]
    assert len(warn) == 1 and "--out" in warn[0] and "node-local" in warn[0], p.stdout
    # (and no such line where the folder is shared: test_one_nan_on_one_rank_is_skipped_on_every_rank's run)


def test_resume_from_a_path_that_does_not_exist(tmp_path, shakespeare):
    assert_one_line_error(braidtrain("train", *BASE, "-i", shakespeare, "-x", 1, "--resume", tmp_path / "nope", check=False),
                          f"--resume {tmp_path / 'nope'}: no such folder")


def test_max_skipped_must_be_positive(shakespeare):
    assert_one_line_error(braidtrain("train", *BASE, "-i", shakespeare, "--max-skipped", 0, check=False), "max_skipped")
