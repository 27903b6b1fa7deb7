"""Tensor (and sequence) parallelism composed with data parallelism and ZeRO: every step's loss
and gradient norm against the single process (in one process group of many layouts), then end to
end through the command line: checkpoints moving between tp degrees, exact mode at a fixed tp."""

import shutil

import pytest

from helpers import SMALL, assert_follows, braidtrain, check_pinned, metrics, portable_env, summary

TP_MODEL = [*SMALL, "--n-head", "4", "--bucket-mb", "0.05"]  # 4 heads: tp up to 4
D = 1024


def train(out, data, nproc, *extra, steps=10, environ=None):
    braidtrain("train", *TP_MODEL, "-i", data, "-d", D, "-x", steps, "--out", out, *extra, nproc=nproc, environ=environ)
    return metrics(out)


@pytest.fixture(scope="module")
def runs(layout_suites):
    """Eight tp layouts (tp 2 and 4; sp; dp 1, 2, 4; ZeRO 0-2) and the single process, in one
    8-rank process group (tests/layouts_worker.py): every step's loss and gradient norm."""
    return layout_suites["tp"]


def test_tp_matches_single_process(runs):
    ref = runs.pop("ref")
    assert len(runs) == 8 and {name.split("-")[0] for name in runs} == {"tp2", "tp4"}
    assert_follows(runs, list(runs), ref, 1e-5)


def test_checkpoint_moves_between_tp_degrees(tmp_path, shakespeare):
    """Saved at tp=2 (ZeRO-1, sp), loaded at tp=1 through the command line: the loaded weights hash
    to the saved ones (the hash is of the unsharded tensors). (Checkpoints resumed across tp, with
    dp, cp, pp and ZeRO-3, training on as the single process does: test_composition.py.)"""
    a = tmp_path / "a"
    train(a, shakespeare, 2, "--tp", 2, "--sp", "-z", 1, steps=3)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    p = braidtrain("train", *TP_MODEL, "-i", shakespeare, "-d", D, "-x", 3, "--out", b, "--resume", "auto")
    assert "tp 2 -> 1" in p.stdout
    assert summary(b)["weights_sha256"] == summary(a)["weights_sha256"]


def test_exact_at_a_fixed_tp_and_its_resume_on_another(tmp_path, shakespeare):
    """--exact with tp 2 keeps its pinned bits (dp 1 x tp 2 with sp, 6 steps, on the portable kernels:
    helpers.EXACT_PINS; 96f7579a... from commit 1bbac96, 3adc7316... since pipelines came, on the CI
    machine's kernels); resumed at tp 1 it trains on, and says in one line that from there its bits
    are not those of a run that stayed at tp 2 (resumed at tp 2, no line)."""
    a = tmp_path / "a"
    train(a, shakespeare, 2, "--tp", 2, "--sp", "-z", 1, "--exact", steps=6, environ=portable_env())
    check_pinned("tp2", summary(a)["weights_sha256"])
    for tp, nproc in ((1, 1), (2, 2)):
        b = tmp_path / f"b{tp}"
        shutil.copytree(a, b)
        p = braidtrain("train", *TP_MODEL, "-i", shakespeare, "-d", D, "-x", 7, "--out", b, "--resume", "auto",
                       "--exact", *(["--tp", 2, "--sp"] if tp == 2 else []), nproc=nproc)
        notes = [line for line in p.stdout.splitlines() if "at a fixed tp" in line]
        if tp == 1:
            assert len(notes) == 1 and "tp=2 checkpoint at tp=1" in notes[0], p.stdout
        else:
            assert notes == [], p.stdout
        assert [r["step"] for r in metrics(b)][-1] == 7
