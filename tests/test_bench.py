"""`braidtrain bench comm` on 2 gloo processes: every operation checked correct, nccl-tests' accounting."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT, braidtrain, env
from braidtrain.bench import OPS, bus_factor, sizes


def test_bench_comm_two_ranks(tmp_path):
    out = tmp_path / "comm.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "braidtrain",
           "bench", "comm", "--min-bytes", "1K", "--max-bytes", "64K", "--iters", "3", "--warmup", "1", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, s) for op in OPS for s in sizes(1024, 65536)]
    for r in rows:
        assert r["correct"] and r["ranks"] == 2 and r["time_us"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], 2))
    assert "busbw GB/s" in p.stdout


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("reduce_scatter", 8) == bus_factor("all_gather", 8) == bus_factor("all_to_all", 8) == pytest.approx(0.875)
    assert bus_factor("send_recv", 8) == 1.0
    assert sizes(1024, 1 << 30)[-1] == 1 << 30 and len(sizes(1024, 1 << 30)) == 11


@pytest.mark.parametrize("args", [["--ops", "all_reduce,bogus"], ["--max-bytes", "12Q"], ["--min-bytes", "1M", "--max-bytes", "1K"]])
def test_bench_bad_input_is_one_line(args):
    p = braidtrain("bench", "comm", *args, check=False)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and p.stderr.startswith("braidtrain: error:"), p.stderr
