"""The data-parallel engine in 2 and 4 real processes: overlap, ZeRO-1 state, global norm."""

import json
import math
import subprocess
import sys

import pytest

from helpers import ROOT, env
from braidtrain.parallel.data import Q


def run_worker(nproc, zero):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "tests" / "engine_worker.py"), str(zero)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    assert len(rows) == nproc
    return rows


@pytest.fixture(scope="module", params=[(2, 1), (4, 1), (2, 0)], ids=["n2-zero1", "n4-zero1", "n2-zero0"])
def ranks(request):
    nproc, zero = request.param
    return zero, run_worker(nproc, zero)


def test_reduction_overlaps_backward(ranks):
    _, rows = ranks
    for r in rows:
        assert r["buckets"] >= 3
        assert r["records_after_first_micro"] == 0, "earlier micro-steps must not communicate"
        assert r["first_launch"] < r["last_grad"], "the first bucket must be launched before the backward ends"


def test_zero1_state_is_one_shard(ranks):
    zero, rows = ranks
    for r in rows:
        share = math.ceil(r["P"] / r["n"])
        if zero == 1:
            # ceil(P/N), plus the padding that makes each bucket split into Q-aligned shards
            assert share <= r["state"] <= share + Q * r["buckets"], r
        else:
            assert r["P"] <= r["state"] <= r["P"] + r["n"] * Q * r["buckets"], r


def test_global_norm_counts_each_parameter_once(ranks):
    _, rows = ranks
    for r in rows:
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"], r
