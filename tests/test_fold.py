"""Exact mode's first level folded into the backward (parallel/exact.py): an odd micro-batch's
gradient added straight into its complete even sibling's leaf gives the bits of the tree that adds
the two leaves -- the same gradients every step and the same weights with the fold on and off
(Engine(fold=False)), at 1-5 micro-steps (odd counts: a last leaf with no sibling), dp 1 and 2,
ZeRO 0-3, the tied head's own tree, lean bf16 buckets, every pipeline schedule, ep 2's sourced
experts, and one stage's backwards reversed and scrambled. And the fold happens where it should:
each tree hands the backward exactly the odd micro-batches whose even sibling's backward ran
before (counted from the schedule's actions), never ep's sourced leaves, and does that many
additions fewer itself. One 2-rank launch (tests/fold_worker.py)."""

import json

import pytest

from fold_worker import cases
from helpers import ROOT, launch

CASES = [name for name, *_ in cases()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fold")
    p = launch(ROOT / "tests" / "fold_worker.py", out, nproc=2)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((out / "fold.json").read_text())


def names(runs):
    return sorted({k.rsplit(".", 1)[0] for k in runs})


def test_the_cases_cover_what_the_fold_touches(runs):
    cases = names(runs)
    assert cases == sorted(CASES)
    assert {runs[f"{n}.fold"]["m"] for n in cases if n.startswith("dp1-")} == {1, 2, 3, 4, 5}
    assert {runs[f"{n}.fold"]["m"] for n in cases if n.startswith("dp2-")} == {1, 2, 4}
    assert all(any(n.startswith(f"dp2-z{z}-") for n in cases) for z in range(4))
    for must in ("pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "pp2-zb", "ep2-", "reverse", "scrambled", "bf16"):
        assert any(must in n for n in cases), must


@pytest.mark.parametrize("case", CASES)
def test_fold_on_and_off_give_the_same_bits(runs, case):
    off, on = runs[f"{case}.off"], runs[f"{case}.fold"]
    assert on["sha"] == off["sha"]  # the weights after 2 steps
    for a, b in zip(off["ranks"], on["ranks"], strict=True):
        assert a["grads"] == b["grads"]  # each step's reduced gradient, each rank's part


def test_the_fold_happens_where_the_order_allows_and_nowhere_else(runs):
    heads = sourced = folded = 0
    for name in names(runs):
        off, on = runs[f"{name}.off"], runs[f"{name}.fold"]
        for a, b in zip(off["ranks"], on["ranks"], strict=True):
            for step_off, step_on in zip(a["trees"], b["trees"], strict=True):
                for (stage, whose, adds_off, folds_off), (_, _, adds, folds) in zip(step_off, step_on, strict=True):
                    assert folds_off == 0, name  # fold=False: the tree does every addition
                    want = 0 if whose == "sourced" else b["expect"][str(stage)]
                    assert folds == want, (name, stage, whose)
                    assert adds + folds == adds_off, name  # the backward did the additions the tree no longer does
                    heads += whose == "head" and folds > 0
                    sourced += whose == "sourced"
                    folded += folds
    assert heads and sourced and folded  # the tied head folded; ep's sourced trees were there, unfolded


def test_in_order_backwards_fold_every_pair(runs):
    """Micro-steps in order: floor(m / 2) pairs fold in every tree (the schedule's count agrees);
    reversed, none does."""
    for name in names(runs):
        if not name.startswith(("dp1-z", "dp2-z")) and not name.endswith("reverse"):
            continue
        on = runs[f"{name}.fold"]
        want = 0 if name.endswith("reverse") else on["m"] // 2
        for rank in on["ranks"]:
            assert rank["expect"]["0"] == want, name
            assert {folds for step in rank["trees"] for *_, folds in step} == {want}, name
