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
from layouts_worker import SHALLOW
from braidtrain.parallel.buckets import Q
from braidtrain.plan.memory import bucket_numels, model_state_bytes, param_counts


@pytest.fixture(scope="module")
def runs(layout_suites):
    return layout_suites["lean"]


def test_default_mode_follows_the_old_path_in_each_layout(runs):
    lean = [k for k in runs if k.startswith("dp") and not k.endswith(("-old", "-exact", "-offload"))]
    assert len(lean) == 4
    for name in lean:
        assert_follows(runs, [name], runs[name + "-old"], 1e-6)
    assert_follows(runs, ["dp2-z1-offload", "dp2-z1-ratio0.5-offload"], runs["dp2-z1-old"], 1e-6)


def test_exact_mode_is_the_old_paths_bits_on_1_2_4_ranks_at_every_zero_stage(runs):
    dp = [k for k in runs if k.startswith("dp") and k.endswith("-exact")]
    assert len(dp) == 9 + 4 + 2  # (ZeRO-0 and one rank: fp32 buckets, but with offload a lean state; R = 0.5)
    assert_bitwise(runs, dp + ["pp2-dp2-z1-exact"], runs["ref-exact-old"])
    assert_bitwise(runs, ["tp2-dp2-z1-exact"], runs["tp2-dp2-z1-exact-old"])
    assert_bitwise(runs, ["llama-dp2-z3-exact", "llama-pp2-dp2-z2-exact"], runs["llama-ref-exact-old"])
    assert_bitwise(runs, ["moe-dp4-ep2-z3-exact"], runs["moe-ref-exact-old"])


def test_a_run_resumes_across_the_lean_state_and_offload(runs):
    ref = runs["ref-exact-old"]
    for name in ("into-lean", "out-of-lean", "lean-into-offload", "offload-out-of-lean"):
        r = runs[name]
        assert (r["sha"], r["losses"], r["norms"]) == (ref["sha"], ref["losses"][2:], ref["norms"][2:]), name


@pytest.mark.parametrize("name", ["dp2-z1", "dp2-z3", "dp4-z2"])
def test_what_a_rank_holds_is_the_planners_count(runs, name):
    """Rank 0 between steps: its compute weights (a lean state's matrices in bf16, bucket by bucket),
    fp32 masters apart, gradients and Adam's moments, against plan/memory.py's model_state_bytes --
    and the old path's fp32 buckets against its count without the lean state. Within the buckets'
    padding (and at ZeRO-3 the 1-D parameters' buckets, which stay whole: ZeRO-2's mechanics)."""
    n, zero = int(name[2]), int(name[-1])
    counts = param_counts(SHALLOW)
    P, matrices = counts["rank"], counts["matrices"]
    sizes = bucket_numels(SHALLOW, 0.01)
    block, embed = max(k for kind, k in sizes if kind == "block"), sum(k for kind, k in sizes if kind == "embed")
    slack = 20 * n * Q * 2 * len(sizes) + (4 * (P - matrices - embed) if zero == 3 else 0)
    for run, lean in ((runs[name], matrices), (runs[name + "-old"], 0)):
        plan = model_state_bytes(P, n, zero, block, embed, lean=lean)
        want = plan["params"] + plan["grads"] + plan["optimizer"] - plan["transient"]
        got = run["state_bytes"] + 8 * run["optimizer_numel"]
        assert want <= got <= want + slack, (name, lean, want, got)
        # the matrices' bf16 compute weights: whole at ZeRO 1-2, a shard at ZeRO-3; their masters a shard
        pad = n * Q * len(sizes)
        if lean:
            share = 1 if zero < 3 else n
            assert matrices / share <= run["bf16_numel"] <= matrices / share + pad, run
            assert matrices / n <= run["masters_apart"] <= matrices / n + pad, run
        else:
            assert run["bf16_numel"] == run["masters_apart"] == 0, run
