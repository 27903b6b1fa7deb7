"""A lean state (parallel/buckets.py): in a bf16 run a block's matrices compute from bf16 buckets, the
fp32 master exists once, in the optimizer's shard, and a bf16 weight's gradient is added by a hook
into the fp32 gradient buffer -- the same numbers as bf16 autocast over fp32 weights (the old path),
whose cast rounds to nearest even as the master's copy does, and whose cast's backward adds the
same bf16 gradient, made fp32.

The layouts run in the 8-rank launch (tests/layouts_worker.py, suite "lean", 4 steps under CPU bf16
autocast, clipping at 1.0): default mode against the old path in the same layout to 1e-6; exact mode
bitwise against the old path's single process on 1, 2 and 4 ranks at ZeRO 0-3, with a pipeline, tp
(at its own tp), Llama's shape (RMSNorm, an untied head), experts over ep ranks and --offload
optimizer; exact runs that save midway and resume with the lean state (and offload) switched.
Then, in this process: what a rank holds, bucket by bucket, against buckets.py's table and the
planner's count.
"""

import pytest

from helpers import assert_bitwise, assert_follows


@pytest.fixture(scope="module")
def runs(layout_suites):
    return layout_suites["lean"]


def test_default_mode_follows_the_old_path_in_each_layout(runs):
    lean = [k for k in runs if k.startswith("dp") and not k.endswith(("-old", "-exact"))]
    assert len(lean) == 4
    for name in lean:
        assert_follows(runs, [name], runs[name + "-old"], 1e-6)


def test_exact_mode_is_the_old_paths_bits_on_1_2_4_ranks_at_every_zero_stage(runs):
    dp = [k for k in runs if k.startswith("dp") and k.endswith("-exact") and "offload" not in k]
    assert len(dp) == 9
    assert_bitwise(runs, dp + ["pp2-dp2-z1-exact", "dp2-z1-offload-exact", "dp4-z3-offload-exact"],
                   runs["ref-exact-old"])
    assert_bitwise(runs, ["tp2-dp2-z1-exact"], runs["tp2-dp2-z1-exact-old"])
    assert_bitwise(runs, ["llama-dp2-z3-exact", "llama-pp2-dp2-z2-exact"], runs["llama-ref-exact-old"])
    assert_bitwise(runs, ["moe-dp4-ep2-z3-exact"], runs["moe-ref-exact-old"])


def test_a_run_resumes_across_the_lean_state_and_offload(runs):
    ref = runs["ref-exact-old"]
    for name in ("into-lean", "out-of-lean", "lean-into-offload", "offload-out-of-lean"):
        r = runs[name]
        assert (r["sha"], r["losses"], r["norms"]) == (ref["sha"], ref["losses"][2:], ref["norms"][2:]), name
