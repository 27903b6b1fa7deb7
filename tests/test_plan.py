"""`braidtrain plan`: the model-state formulas against hand arithmetic, the planner's view of the
engine's buckets against the engine, the table and its fixes, and `--check` against real CPU
training runs (estimated model state within 5% of the run's mem_gb).

The command is driven through add_parser on the CLI's own Parser class, in process, so the
test does not depend on cli.py's wiring (one test checks that wiring, and skips until it exists).
The --check runs are real subprocesses (`braidtrain train`, under torchrun for 2 ranks), started
together by a module fixture so their torch imports overlap.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.errors import UserError
from braidtrain.model.gpt2 import GPT
from braidtrain.model.registry import model_config
from braidtrain.options import Parser
from braidtrain.parallel import placement
from braidtrain.parallel.engine import Engine
from braidtrain.plan import check
from braidtrain.plan.command import run, setup_from
from braidtrain.plan.estimate import estimate
from braidtrain.plan.flags import add_parser
from braidtrain.plan.memory import (ALLOCATOR_SLACK, CONTEXT_BYTES, GB, NCCL_BYTES, activation_bytes, bucket_numels,
                                    model_state_bytes, param_counts)
from braidtrain.plan.report import COLUMNS, table
from braidtrain.plan.search import auto_layout, plan
from braidtrain.plan.space import Candidate, Setup, layout_of
from braidtrain.plan import timing
from braidtrain.plan.timing import busbw_of, offload_s, tp_comm_s
from helpers import braidtrain, forked, prepare_bytes


def parse(*argv):
    parser = Parser(prog="braidtrain")
    add_parser(parser.add_subparsers(dest="cmd", required=True, parser_class=Parser))
    return parser.parse_args(["plan", *map(str, argv)])


def run_plan(*argv, capsys) -> str:
    assert run(parse(*argv)) == 0
    return capsys.readouterr().out


# ----------------------------------------------------------------------------- formulas

def small_model(n_layer=4):
    return model_config("tiny", 256, n_layer=n_layer)  # 128 channels, byte vocabulary


def sizes(cfg, bucket_mb):
    """(P, largest block bucket, embedding group) from the planner."""
    buckets = bucket_numels(cfg, bucket_mb)
    return cfg.num_params(), max(k for kind, k in buckets if kind == "block"), buckets[-1][1]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_model_state_formulas_match_hand_arithmetic(n):
    cfg = small_model()
    P, block, embed = sizes(cfg, 25.0)
    c = cfg.n_embd
    assert block == cfg.n_layer * (12 * c * c + 13 * c)  # 25 MB holds all four blocks
    assert embed == cfg.padded_vocab * c + cfg.block_size * c + 2 * c
    assert P == block + embed
    scratch = 4 * (embed + 2 * block)  # the embedding group's gradient, a block bucket's, one in flight
    working = 4 * (2 * block + embed)  # ZeRO-3: two block buckets and the embedding group, fp32
    want = {  # (params, grads, optimizer): fp32 weights and grads, fp32 Adam m and v
        0: (4 * P, 4 * P, 8 * P),
        1: (4 * P, 4 * P, 8 * P / n),
        2: (4 * P, 4 * P / n + scratch, 8 * P / n),
        3: (4 * P / n + working, 4 * P / n + scratch, 8 * P / n),
    }
    if n == 1:  # one rank: nothing to shard, every stage holds what ZeRO-0 does (buckets.zero_stage)
        want, scratch, working = {z: want[0] for z in want}, 0, 0
    for zero, (params, grads, opt) in want.items():
        got = model_state_bytes(P, n, zero, block, embed)
        assert (got["params"], got["grads"], got["optimizer"]) == pytest.approx((params, grads, opt), rel=1e-12), zero
        # (ZeRO-0/1's gradient exists from the backward to the update: parallel/grads.py)
        assert got["transient"] == (4 * P, 4 * P, scratch, scratch + working)[zero if n > 1 else 0]


@pytest.mark.parametrize("n", [2, 4])
def test_each_zero_stage_needs_no_more_than_the_one_before(n):
    # ZeRO-2 trades 4P(1 - 1/n) of gradients for a scratch (the embedding group's and two block
    # buckets'), ZeRO-3 4P(1 - 1/n) of parameters for the working set: a gain when buckets are small
    # next to the model, as here (16 blocks, one per 0.5 MB bucket). With 4 blocks in one bucket it
    # would not be.
    cfg = small_model(n_layer=16)
    P, block, embed = sizes(cfg, 0.5)
    assert block == 12 * cfg.n_embd**2 + 13 * cfg.n_embd  # one block per bucket
    total = [sum(v for k, v in model_state_bytes(P, n, z, block, embed).items() if k != "transient")
             for z in range(4)]
    assert total[0] == 16 * P
    assert all(b <= a for a, b in zip(total, total[1:])), total


@pytest.mark.parametrize("bucket_mb", [25.0, 0.5, 1.7])
def test_planner_buckets_are_the_engines(bucket_mb):
    cfg = small_model(n_layer=6)
    comm = Comm(torch.device("cpu"))
    engine = Engine(GPT(cfg), build_mesh(0, 1, comm), comm, zero=0, exact=False, bucket_mb=bucket_mb,
                    device=torch.device("cpu"))
    assert [b.numel for b in engine.buckets] == [k for _, k in bucket_numels(cfg, bucket_mb)]


# ----------------------------------------------------------------------------- the table

def test_gpt2_on_8_gpus_prints_a_ranked_table_and_a_recommendation(capsys):
    out = run_plan("--model", "gpt2", "--gpus", 8, "--gpu-mem", 80, "--tp", 1, "--pp", 1, "--cp", 1, "--variants",
                   capsys=capsys)
    lines = out.splitlines()
    assert "124.5M parameters" in lines[0] and "8 x 80 GB," in lines[0]
    assert lines[1].split()[:7] == ["dp", "zero", "b", "micro", "recomp", "mem", "GB"]
    rows = [line.split() for line in lines[2:] if line.split() and line.split()[0] == "8"]
    assert len(rows) == 12 and all(r[-1] == "yes" for r in rows)  # gpt2 fits 80 GB at the top
    times = [float(r[-3]) for r in rows]
    assert times == sorted(times)
    assert lines[-1].startswith("recommended: ZeRO-") and "tokens/s" in lines[-1]
    # by default one row a mesh (its best ZeRO stage, b and recompute), still ranked
    lines = run_plan("--model", "gpt2", "--gpus", 8, "--gpu-mem", 80, "--top", 0, capsys=capsys).splitlines()
    assert lines[1].split()[:7] == ["dp", "tp", "sp", "pp", "sched", "bubble", "cp"]
    rows = [line.split() for line in lines[2:] if line[:1] == " " or line[:1].isdigit()]
    meshes = [tuple(r[:7]) for r in rows]  # dp, tp, sp, pp, schedule, bubble (a function of the rest), cp
    assert len(meshes) == len(set(meshes)) > 12 and {"4", "2"} <= {r[3] for r in rows} and "2" in {r[1] for r in rows}
    fit = [float(r[-3]) for r in rows if r[-1] == "yes"]
    assert fit == sorted(fit) and rows[: len(fit)] == [r for r in rows if r[-1] == "yes"]  # fits first, then by time


def test_gpt2_xl_on_one_24gb_gpu_names_the_smallest_change(capsys):
    out = run_plan("--model", "gpt2-xl", "--gpus", 1, "--gpu-mem", 24, "-z", 0, "-b", 1, "--no-recompute", "--no-offload",
                   capsys=capsys)
    fix = next(line for line in out.splitlines() if line.startswith("ZeRO-0 b=1 needs"))
    # 16P of model state alone is 25 GB: no setting fits one GPU, so the fix is hardware
    assert "> 24 GB: use GPUs with >= " in fix and "GPUs with ZeRO-3" in fix
    assert out.splitlines()[-1].startswith("nothing fits on 1 x 24 GB")
    # with the optimizer's state in host memory (--offload optimizer, 12 bytes a parameter there), it fits --
    # and with a share of it kept on the GPU (--offload-ratio < 1: faster) too, which the planner picks
    out = run_plan("--model", "gpt2-xl", "--gpus", 1, "--gpu-mem", 24, "-z", 0, "-b", 1, "--no-recompute", capsys=capsys)
    assert out.splitlines()[-1].startswith("recommended: ZeRO-0 b=1 --offload --offload-ratio 0.")
    out = run_plan("--model", "gpt2-xl", "--gpus", 1, "--gpu-mem", 24, "-z", 0, "-b", 1, "--no-recompute",
                   "--offload-ratio", 1, capsys=capsys)
    assert out.splitlines()[-1].startswith("recommended: ZeRO-0 b=1 --offload on 1 GPU(s)")
    # --offload-ratio alone asks for offloaded layouts at that R, also where the GPU has room without
    out = run_plan("--model", "gpt2", "--gpus", 1, "-z", 0, "--offload-ratio", 0.5, capsys=capsys)
    assert "--offload --offload-ratio 0.5 on 1 GPU(s)" in out.splitlines()[-1], out


def test_a_layout_that_does_not_fit_gets_single_setting_fixes(capsys):
    out = run_plan("--model", "gpt2", "--gpus", 2, "--gpu-mem", 8, "-z", 0, "-b", 16, "--no-recompute", capsys=capsys)
    assert "ZeRO-0 b=16 needs 11.7 GB > 8 GB: use b=8, or --recompute" in out


def test_json_parses_and_every_layout_has_the_breakdown(capsys):
    data = json.loads(run_plan("--model", "gpt2", "--gpus", 8, "--json", capsys=capsys))
    assert data["model"]["params"] == 124_475_904 and data["recommendation"].startswith("recommended:")
    # without a pipeline or cp, meshes (dp, tp, sp): (8, 1, off), (4, 2, off/on), (2, 4, off/on);
    # tp=8 does not divide 12 heads
    assert sum(r["pp"] == 1 and r["cp"] == 1 for r in data["layouts"]) == 4 * 7 * 2 * 5
    for row in data["layouts"]:
        mem = row["mem_gb"]
        parts = ("params", "grads", "optimizer", "activations", "comm", "overhead")
        assert mem["total"] == pytest.approx(sum(mem[k] for k in parts))
        assert row["tokens_per_s"] == pytest.approx(524288 / row["step_s"])
        if row["pp"] > 1:  # the table's memory is the fullest stage's
            assert mem["total"] == pytest.approx(max(row["stages_gb"])) and len(row["stages_gb"]) == row["pp"]


def test_bad_input_is_one_user_error(capsys):
    for argv, words in ((["--params", "12Q"], "not a count"), (["-d", "1000"], "-d 1024"),
                        (["--check", "1,x", "--data", "x"], "ZERO,B"), (["--check"], "--data")):
        with pytest.raises(UserError, match=words):
            run_plan(*argv, capsys=capsys)


def test_plan_is_wired_into_the_cli():
    p = braidtrain("plan", "--model", "gpt2", "--gpus", 8, check=False)
    if p.returncode == 2 and "invalid choice" in p.stderr:
        pytest.skip("`plan` is not wired into braidtrain/cli.py yet")
    assert p.returncode == 0, p.stderr
    assert "recommended:" in p.stdout


# ----------------------------------------------------------------------------- tensor parallelism

def meshes_of(data) -> set:
    return {(r["dp"], r["tp"], r["sp"]) for r in data["layouts"] if r["pp"] == r["cp"] == 1}


def test_tp_layouts_appear_for_gpt2_on_8_gpus(capsys):
    data = json.loads(run_plan("--model", "gpt2", "--gpus", 8, "--json", capsys=capsys))
    assert meshes_of(data) == {(8, 1, False), (4, 2, False), (4, 2, True), (2, 4, False), (2, 4, True)}
    for row in data["layouts"]:
        assert (row["tp_comm_s"] > 0) == (row["tp"] > 1)
        assert row["step_s"] == pytest.approx(row["compute_s"] + row["dp_exposed_comm_s"] + row["tp_comm_s"]
                                              + row["pp_comm_s"] + row["cp_comm_s"])
    out = run_plan("--model", "gpt2", "--gpus", 8, "--tp", 2, "--sp", "--pp", 1, "--cp", 1, "--top", 0, "--variants",
                   capsys=capsys)
    lines = out.splitlines()
    assert lines[1].split()[:4] == ["dp", "tp", "sp", "zero"]  # the mesh columns, when tp rows are shown
    rows = [line.split() for line in lines[2:] if line[:1] == " " or line[:1].isdigit()]
    assert len(rows) == 4 * 7 * 2 and all(r[:3] == ["4", "2", "on"] for r in rows)
    assert lines[-1].startswith("recommended: ZeRO-") and " tp=2 --sp" in lines[-1]


def replicated_by_hand(cfg):
    """wpe, ln_f, and per block ln_1, ln_2 (weight + bias each) and the biases of both c_proj."""
    c = cfg.n_embd
    return cfg.block_size * c + 2 * c + cfg.n_layer * (2 * 2 * c + 2 * c)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_divides_the_sharded_model_state_by_hand(tp):
    cfg = model_config("tiny", 50257)  # 50304 rows at tp 1; 128*tp-padding adds rows at tp 2, 4
    P, R, c = cfg.num_params(), replicated_by_hand(cfg), cfg.n_embd
    extra = (cfg.vocab_rows(tp) - cfg.padded_vocab) * c  # wte's further padding rows
    assert cfg.vocab_rows(tp) % (128 * tp) == 0 and extra > 0
    per_rank = (P + extra - R) // tp + R
    # the model's own placement table agrees: replicated parameters whole, the rest divided by tp
    model = GPT(cfg)
    table = placement.build(model)
    by_spec = sum(p.numel() if table[n].replicated else p.numel() // tp for n, p in model.named_parameters())
    assert by_spec + extra // tp == per_rank == param_counts(cfg, tp)["rank"]
    assert sum(p.numel() for n, p in model.named_parameters() if table[n].replicated) == R

    s = Setup(cfg, gpus=tp, mem_gb=80, t=256, d=256 * 8)
    dense, split = (estimate(s, Candidate(dp, 0, 8, False, t)) for dp, t in ((tp, 1), (1, tp)))
    assert [dense["state"][k] for k in ("params", "grads", "optimizer")] == [4 * P, 4 * P, 8 * P]
    assert [split["state"][k] for k in ("params", "grads", "optimizer")] == [4 * per_rank, 4 * per_rank, 8 * per_rank]
    # ZeRO-0: 16 bytes per parameter; the sharded part divides by tp, the replicated part stays
    saved = 16 * P - sum(split["state"][k] for k in ("params", "grads", "optimizer"))
    assert saved == 16 * ((P - R) - (P + extra - R) // tp)
    assert split["mem"]["comm"] == NCCL_BYTES and dense["mem"]["comm"] == NCCL_BYTES  # tp's; dp's
    # ZeRO over the replica group divides the per-tp-rank state further, as at tp 1
    s8 = replace(s, gpus=2 * tp)
    z1 = estimate(s8, Candidate(2, 1, 8, False, tp))
    M = cfg.n_layer * 12 * c * c // tp  # the blocks' matrices, this tp rank's: a lean state's bf16, masters apart
    assert z1["state"]["optimizer"] == (8 * per_rank + 4 * M) // 2 and z1["state"]["params"] == 4 * per_rank - 2 * M
    assert z1["mem"]["comm"] == 2 * NCCL_BYTES  # a communicator for each group: replica and tp


def test_tp_activations_by_hand():
    """The layers term is traced from the block itself (model/counts.py); for gpt2 it finds the hand
    count: 38 bytes a token x channel (Korthikanti et al.'s 34 with fp32 LayerNorm inputs and no
    dropout), plus what that count leaves out, the softmax's log-sum-exp (4 bytes a head, a token)
    and each LayerNorm's mean and rstd (2 x 2 x 4 bytes a token)."""
    cfg, b, t = model_config("gpt2", 50257), 4, 1024
    L, x, P, H, bt = cfg.n_layer, b * t * cfg.n_embd, 1000, cfg.n_head, b * t
    act = lambda tp, sp, rc=False: activation_bytes(cfg, b, t, rc, False, P, tp, sp)
    assert act(1, False)["layers"] == (38 * x + (4 * H + 16) * bt) * L
    assert act(1, False)["logits"] == 2 * b * t * 50304  # the fused head's bf16 buffer
    # tp: LayerNorm inputs (4 + 4) and the column-parallel inputs (2 + 2) whole, 26 of 38 split
    assert act(2, False)["layers"] == ((12 + 26 / 2) * x + (16 + 4 * H / 2) * bt) * L
    assert act(4, False)["layers"] == ((12 + 26 / 4) * x + (16 + 4 * H / 4) * bt) * L
    # sp: the LayerNorm inputs split too; the all-gathered bf16 inputs of c_attn, c_fc stay whole
    sp4 = (4 + 34 / 4) * x + (16 + 4 * H) / 4 * bt
    assert act(4, True)["layers"] == sp4 * L
    assert act(4, True)["head"] == (4 / 4 + 2) * x and act(4, False)["head"] == 6 * x
    # recompute under sp keeps each block's fp32 input, t/tp rows of it
    assert act(4, True, True)["layers"] == 4 * x / 4 * L and act(4, True, True)["block_recomputed"] == sp4
    # vocab-parallel cross-entropy: 4 + 2 bytes per token x local vocabulary row, never gathered
    assert act(4, False)["logits"] == b * t * (cfg.vocab_rows(4) // 4) * 6 == b * t * 50688 // 4 * 6


def test_compile_traces_its_own_partition():
    """plan --compile: the layers term is the block as torch.compile partitions it (model/counts.py:
    inductor's min-cut recomputes pointwise results in the backward rather than keep them), for
    every term that grows with the layers; eager's trace otherwise. (On an H200, llama3.2-3b b 8:
    the estimate within 0.4% of the measured peak; docs/performance.md.)"""
    from braidtrain.model.counts import block_activations

    cfg, b, t = model_config("llama3-tiny", 256), 2, 64
    eager, compiled = block_activations(cfg, fused=True), block_activations(cfg, compiled=True, fused=True)
    assert compiled < eager  # SwiGLU's product and the norms' bf16 outputs are rebuilt, not kept
    # the GPU's SwiGLU operator (model/swiglu.py) keeps gate_up alone: the plain expression keeps
    # silu(gate) too, F bf16 values a token; layers.RMSNorm keeps each norm's r (fp32, two norms a
    # block), which model/rmsnorm.py's operators recompute
    assert block_activations(cfg) - eager == 2 * cfg.mlp_width + 2 * 4
    # compiled, the operators' bf16 output (C values a token) is kept where inductor rebuilt its own
    assert compiled - block_activations(cfg, compiled=True) == 2 * cfg.n_embd - 2 * 4
    for rc in (False, True):
        e = [estimate(Setup(cfg, 1, 80, t, b * t, compile=c), Candidate(1, 0, b, rc)) for c in (False, True)]
        layer = "block_recomputed" if rc else "layers"
        assert e[0]["activations"][layer] == eager * b * t * (1 if rc else cfg.n_layer)
        assert e[1]["activations"][layer] == compiled * b * t * (1 if rc else cfg.n_layer)


def test_tp_communication_by_hand():
    cfg, b, t, d = model_config("gpt2", 50257), 8, 1024, 8 * 1024 * 4
    L, x = cfg.n_layer, b * t * cfg.n_embd
    s = Setup(cfg, gpus=2, mem_gb=80, t=t, d=d, busbw=300.0, alpha_us=10.0, tp_busbw=100.0)
    ar = lambda nbytes: 10e-6 + 2 * (2 - 1) / 2 * nbytes / 100e9  # all-reduce over 2 ranks at --tp-busbw
    per_micro = L * (2 * ar(2 * x) + 2 * ar(4 * x)) + 2 * ar(4 * x) + ar(4 * b * t) + ar(8 * b * t)
    e = estimate(s, Candidate(1, 0, b, False, 2))
    assert e["micro_steps"] == 4 and e["dp_comm_s"] == 0  # dp = 1: no gradient reduction
    assert e["tp_comm_s"] == pytest.approx(4 * per_micro, rel=1e-12)
    assert e["step_s"] == pytest.approx(e["compute_s"] + 4 * per_micro, rel=1e-12)
    # recompute runs the layers' forward messages again
    rc = estimate(s, Candidate(1, 0, b, True, 2))
    assert rc["tp_comm_s"] == pytest.approx(4 * (per_micro + L * 2 * ar(2 * x)), rel=1e-12)
    # sp: all-gather + reduce-scatter pairs move the same bus volume (alpha aside)
    s0 = replace(s, alpha_us=0.0)
    no_sp, sp = (tp_comm_s(s0, Candidate(1, 0, b, False, 2, v)) for v in (False, True))
    assert sp == pytest.approx(no_sp, rel=1e-12)
    # ... and once a step sp adds the replicated parameters' partial gradients, gathered over tp
    R = replicated_by_hand(cfg)
    e_sp = estimate(s0, Candidate(1, 0, b, False, 2, True))
    assert e_sp["tp_comm_s"] == pytest.approx(4 * sp + (2 - 1) / 2 * (4 * R * 2) / 100e9, rel=1e-12)
    # the dp reduction moves the per-tp-rank parameter bytes: under ZeRO-1 on dp = 2 the exposed part
    # is the last reduce-scatter (the embedding group) and the all-gather of every bucket, at --busbw
    counts = param_counts(cfg, 2)
    assert sum(k for _, k in bucket_numels(cfg, s.bucket_mb, 2)) == counts["rank"]
    # (the blocks' buckets all-gathered in bf16: a lean state's)
    z1 = estimate(replace(s, gpus=4, alpha_us=0.0), Candidate(2, 1, b, False, 2))
    gathered = 4 * counts["embed"] + 2 * (counts["rank"] - counts["embed"])
    assert z1["dp_comm_s"] == pytest.approx(1 / 2 * (4 * counts["embed"] + gathered) / 300e9, rel=1e-12)


def test_zero3_gathers_blocks_again_for_the_backward():
    """ZeRO-3 on 2 ranks with compute too fast to hide anything: every message is exposed, so the
    reduction is the sum of its collectives -- a gather and a reduce-scatter per bucket per
    micro-step, plus a second gather of the blocks for the backward, which reads the parameters
    themselves: fp32 ones on the CPU, a lean state's bf16 ones on a GPU (its blocks gathered in bf16)."""
    cfg, b, t = model_config("gpt2", 50257), 8, 1024
    s = Setup(cfg, gpus=2, mem_gb=80, t=t, d=2 * b * t * 4, tflops=1e12, alpha_us=0.0)
    one = lambda nbytes: (2 - 1) / 2 * nbytes / 300e9  # a gather or reduce-scatter over 2 ranks
    for cpu in (False, True):
        for recompute in (False, True):
            gathers = [(4 if cpu or kind == "embed" else 2) * k for kind, k in bucket_numels(cfg, s.bucket_mb)]
            scatters = [4 * k for _, k in bucket_numels(cfg, s.bucket_mb)]
            once = 4 * sum(one(g) + one(r) for g, r in zip(gathers, scatters))  # 4 micro-steps
            blocks_again = 4 * sum(one(g) for g in gathers[:-1])  # all but the embedding group (launched last)
            e = estimate(replace(s, cpu=cpu), Candidate(2, 3, b, recompute))
            assert e["micro_steps"] == 4 and e["dp_comm_s"] == pytest.approx(once + blocks_again, rel=1e-6), (cpu, recompute)


def test_a_tp_that_does_not_divide_the_heads_is_never_planned(capsys):
    # gpt2-xl has 25 heads: on 8 GPUs no tp > 1 divides both
    xl = json.loads(run_plan("--model", "gpt2-xl", "--gpus", 8, "--gpu-mem", 141, "--json", capsys=capsys))
    assert {r["tp"] for r in xl["layouts"]} == {1}
    # 6 heads on 4 GPUs: tp 2, never 4
    six = json.loads(run_plan("--model", "gpt2", "--n-head", 6, "--gpus", 4, "--json", capsys=capsys))
    assert meshes_of(six) == {(4, 1, False), (2, 2, False), (2, 2, True)}
    # 12 heads, -t 1022: tp 4 splits the heads but not the sequence, so tp 4 without sp only
    odd = json.loads(run_plan("--model", "gpt2", "--gpus", 4, "-t", 1022, "-d", 1022 * 64, "--json", capsys=capsys))
    assert meshes_of(odd) == {(4, 1, False), (2, 2, False), (2, 2, True), (1, 4, False)}
    for argv, words in ((["--gpus", 8, "--tp", 8], "n_head=12"), (["--gpus", 8, "--tp", 3], "does not divide --gpus 8"),
                        (["--gpus", 8, "--tp", 1, "--sp"], "--tp 2 or more"), (["--gpus", 1, "--sp"], "no tp > 1")):
        with pytest.raises(UserError, match=words):
            run_plan("--model", "gpt2", *argv, capsys=capsys)


# ----------------------------------------------------------------------------- pipelines

def test_pipeline_stage_memory_by_hand():
    """gpt2 on 2 stages (blocks 0-7 | 8-11, the head weighing 4.5 blocks), 1f1b, 4 micro-batches,
    ZeRO-0 on a GPU: each stage holds its own parameters (the last a copy of wte for the head),
    16 bytes each, their bf16 copies, and a block's activations (38 bytes a token x channel, 4 a
    head, 16 a token: test_tp_activations_by_hand) per block of each micro-batch alive -- 2 on the
    first stage (p - r), 1 on the last, which adds the head's input and the fused head's logits."""
    cfg, b, t = model_config("gpt2", 50257), 4, 1024
    h, V, blk = cfg.n_embd, cfg.padded_vocab, 12 * cfg.n_embd**2 + 13 * cfg.n_embd
    s = Setup(cfg, gpus=2, mem_gb=80, t=t, d=b * t * 4)
    e = estimate(s, Candidate(1, 0, b, False, pp=2, schedule="1f1b"))
    P = [V * h + t * h + 8 * blk, 4 * blk + 2 * h + V * h]
    x = t * b * h
    a = 38 * x + (4 * cfg.n_head + 16) * t * b  # one block, one micro-batch
    act = [2 * 8 * a + 2 * P[0], 4 * a + 6 * x + 2 * b * t * V + 2 * P[1]]
    for r in range(2):
        allocated = 16 * P[r] + act[r]
        comm = NCCL_BYTES * 3  # the pp group's, and one for each direction between the stages
        want = allocated + comm + CONTEXT_BYTES + ALLOCATOR_SLACK * allocated
        assert e["stages_gb"][r] * GB == pytest.approx(want, rel=1e-12), r
    assert e["mem"]["total"] == pytest.approx(max(e["stages_gb"]) * GB)
    # ZeRO-1 over dp = 2 divides each stage's Adam state, as without a pipeline
    z1 = estimate(replace(s, gpus=4, d=2 * b * t * 4), Candidate(2, 1, b, False, pp=2, schedule="1f1b"))
    M = 4 * 12 * h * h  # the last stage's blocks' matrices: a lean state's bf16, with fp32 masters apart
    assert z1["stage_state"][1]["optimizer"] == (8 * P[1] + 4 * M) // 2


@pytest.mark.parametrize("m", [4, 32])  # 32: past the simulated cycles, extrapolated
def test_pipeline_step_by_hand(m):
    """Two stages, the last the slower (4 blocks + the head against 8 blocks), transfers free: the
    last stage works without a break from the first forward's arrival, so a 1f1b step is
    F0 + m * (F1 + B1) + B0, B = 2F, F a third of the stage's share of the training FLOPs."""
    from braidtrain.parallel import pipeline

    cfg, b, t = model_config("gpt2", 50257), 4, 1024
    s = Setup(cfg, gpus=2, mem_gb=80, t=t, d=b * t * m, alpha_us=0.0, busbw=1e12)
    flops = pipeline.flop_cost(cfg, t, 2)
    share = [flops(0, range(0, 8)), flops(1, range(8, 12))]
    micro = cfg.flops_per_token(t) * b * t / (s.tflops * 1e12)
    F = [c / sum(share) * micro / 3 for c in share]
    assert F[1] > F[0]
    e = estimate(s, Candidate(1, 0, b, False, pp=2, schedule="1f1b"))
    assert e["micro_steps"] == m and e["compute_s"] == pytest.approx(F[0] + m * 3 * F[1] + 2 * F[0], rel=1e-9)
    # each stage's bubble as train measures it: idle from the step's start to the stage's last work
    ends = [F[0] + m * 3 * F[1] + 2 * F[0], F[0] + m * 3 * F[1]]
    assert e["bubble"] == pytest.approx([1 - m * 3 * F[0] / ends[0], 1 - m * 3 * F[1] / ends[1]], rel=1e-9)
    # zero bubble splits the backward: on 4 stages its step is below 1f1b's, gpipe's equal to it
    s4 = replace(s, gpus=4, d=b * t * 8)
    steps = {name: estimate(s4, Candidate(1, 0, b, False, pp=4, schedule=name))["compute_s"]
             for name in ("gpipe", "1f1b", "zb")}
    assert steps["zb"] < steps["1f1b"] == pytest.approx(steps["gpipe"])


def test_pipelines_in_the_table(capsys):
    out = run_plan("--model", "gpt2-xl", "--gpus", 8, "--gpu-mem", 16, "--pp", 4, "--top", 0, capsys=capsys)
    lines = out.splitlines()
    assert lines[1].split()[:6] == ["dp", "pp", "sched", "bubble", "cp", "zero"]  # cp: pp 4 leaves 2 ranks to share
    rows = [line.split() for line in lines[2:] if line[:1] == " " or line[:1].isdigit()]
    assert rows and {r[1] for r in rows} == {"4"} and {r[2] for r in rows} == {"gpipe", "1f1b", "interleavedx2", "zb"}
    assert " pp=4 " in lines[-1]
    zb = json.loads(run_plan("--model", "gpt2", "--gpus", 4, "--pp-schedule", "zb", "--json", capsys=capsys))
    assert {(r["pp"], r["schedule"]) for r in zb["layouts"]} == {(2, "zb"), (4, "zb")}
    assert not any(r["recompute"] or r["zero"] == 3 for r in zb["layouts"])  # what layout.py refuses, never planned


def test_bad_pipeline_or_cp_input_is_one_user_error(capsys):
    for argv, words in ((["--pp", 3], "does not divide --gpus 8"), (["--pp", 0], "--pp must be positive"),
                        (["--pp", 1, "--pp-schedule", "zb"], "give --pp 2 or more"),
                        (["--cp", 3, "-t", 1020], "does not "
                                                  "divide --gpus 8"), (["--cp", 2, "-t", 1022], "-t 1020 or -t 1024")):
        with pytest.raises(UserError, match=words):
            run_plan("--model", "gpt2", "--gpus", 8, *argv, capsys=capsys)


# ----------------------------------------------------------------------------- --check

# (processes, ZeRO, tp, pp, cp[, ep: a mixture of experts]); tp 2 with --sp
CHECKS = [(1, 0, 1, 1, 1), (2, 0, 1, 1, 1), (2, 1, 1, 1, 1), (2, 0, 2, 1, 1), (4, 1, 1, 2, 1), (4, 1, 1, 1, 2),
          (2, 1, 1, 1, 1, 2)]


@pytest.fixture(scope="module")
def checks(tmp_path_factory, monkeypatch_module):
    data = prepare_bytes(tmp_path_factory.mktemp("plan") / "shakespeare")

    def one(case):
        n, zero, tp, pp, cp = case[:5]
        s = Setup(model_config("tiny", 256), gpus=n, mem_gb=80, t=64, d=256)
        if case[5:]:  # the experts' state at 1/ep, ZeRO-1's Adam over the dp/ep ranks of the same experts
            args = parse("--model", "tiny", "--vocab", 256, "--moe-experts", 4, "--moe-hidden", 128, "--gpus", n,
                         "-t", 64, "-d", 256, "--check", f"{zero},2", "--ep", case[5], "--data", data)
            assert check.check_layout(args) == Candidate(n, zero, 2, False, ep=case[5])
            return check.check(setup_from(args), check.check_layout(args), str(data), None)
        if cp > 1:  # ZeRO-1's shard of Adam over the dp x cp = 4 replicas
            args = parse("--model", "tiny", "--vocab", 256, "--gpus", n, "-t", 64, "-d", 256, "--check", f"{zero},2",
                         "--cp", cp, "--data", data)
            assert check.check_layout(args) == Candidate(n // cp, zero, 2, False, cp=cp)
            return check.check(setup_from(args), check.check_layout(args), str(data), None)
        if pp > 1:  # rank 0's model state: the first stage's, its ZeRO-1 shard of Adam over dp = 2
            args = parse("--model", "tiny", "--vocab", 256, "--gpus", n, "-t", 64, "-d", 512, "--check", f"{zero},2",
                         "--pp", pp, "--pp-schedule", "zb", "--data", data)
            assert check.check_layout(args) == Candidate(n // pp, zero, 2, False, pp=pp, schedule="zb")
            return check.check(setup_from(args), check.check_layout(args), str(data), None)
        if tp == 1:
            return check.check(s, Candidate(n, zero, 2, False), str(data), None)
        # from the command line, as a user asks for it: the mesh comes from --tp and --sp
        args = parse("--model", "tiny", "--vocab", 256, "--gpus", n, "-t", 64, "-d", 256, "--check", f"{zero},2",
                     "--tp", tp, "--sp", "--data", data)
        assert check.check_layout(args) == Candidate(n // tp, zero, 2, False, tp, True)
        return check.check(setup_from(args), check.check_layout(args), str(data), None)

    with ThreadPoolExecutor(len(CHECKS)) as pool:
        return dict(zip(CHECKS, pool.map(one, CHECKS)))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:  # (helpers.forked sets OMP_NUM_THREADS and PYTHONPATH)
        mp.delenv("RANK", raising=False)
        mp.setattr(check, "run_job", forked)
        yield mp


@pytest.mark.parametrize("case", CHECKS, ids=lambda c: f"{c[0]}proc-zero{c[1]}" + (f"-tp{c[2]}-sp" if c[2] > 1 else "")
                         + (f"-pp{c[3]}" if c[3] > 1 else "") + (f"-cp{c[4]}" if c[4] > 1 else "")
                         + (f"-ep{c[5]}" if c[5:] else ""))
def test_check_model_state_matches_a_real_cpu_run(checks, case):
    r = checks[case]
    assert r["device"] == "cpu" and r["layout"]["zero"] == case[1] and r["layout"]["tp"] == case[2]
    assert r["layout"]["pp"] == case[3] and r["layout"]["cp"] == case[4] and r["layout"]["ep"] == (case[5:] or (1,))[0]
    assert abs(r["rel_error"]) < 0.05, r


def test_check_compares_the_offloaded_host_state_with_a_real_cpu_run(tmp_path, monkeypatch_module):
    """plan --check --offload on 1 process at ZeRO-0 and 2 gloo ranks at ZeRO-1: the run's host state
    (metrics' host_gb, on the CPU the offloaded master, m, v and staging of a rank's shards: as many
    slots as buckets, up to offload.SLOTS, each the widest shard) is the planned host bytes a rank;
    the model state as without offload."""
    data = prepare_bytes(tmp_path / "shakespeare")
    for n, zero in ((1, 0), (2, 1)):
        args = parse("--model", "tiny", "--vocab", 256, "--gpus", n, "-t", 64, "-d", 256, "--check", f"{zero},2",
                     "--offload", "--data", data)
        lay = check.check_layout(args)
        assert lay == Candidate(n, zero, 2, False, offload=True)
        r = check.check(setup_from(args), lay, str(data), None)
        assert abs(r["rel_error"]) < 0.05 and abs(r["host_rel_error"]) < 0.05, r
        assert r["host_estimated_gb"] == pytest.approx(r["estimate"]["host_gb"] / n)  # the node's, over its ranks


def test_offload_host_plan_meets_the_h200_runs():
    """The planned host bytes on a GPU against the max RSS of two --offload optimizer --compile runs on
    the H200 (docs/performance.md): llama3.1-8b ZeRO-0 b 4 at -d 262144, 113.0 GB at ec9d8ad, and
    llama3.2-3b b 2 at -d 4096, 53.0 GB at 7634611 -- the offloaded state and the process itself. It pins
    plan/memory.HOST_PROCESS, which was read off these same runs (8.2 and 8.1 GB beyond the state): a
    check that the constant and the state's count stay where the runs put them, not a prediction."""
    for name, b, d, measured in (("llama3.1-8b", 4, 262144, 113.02), ("llama3.2-3b", 2, 4096, 53.0)):
        s = Setup(model_config(name, None), 1, 150.1, 2048, d, compile=True)
        host = estimate(s, Candidate(dp=1, zero=0, b=b, recompute=False, offload=True))["host"] / GB
        assert host == pytest.approx(measured, rel=0.02), (name, host)


def test_offload_time_is_the_slower_of_the_copies_and_the_host_update(monkeypatch):
    """The copies (4 bytes an owned element down, 4 up, one stream: summed) against the host's
    AdamW (the node's rate over its ranks): the step waits for the slower."""
    monkeypatch.setattr(timing, "PCIE_D2H_GBPS", 40.0)
    monkeypatch.setattr(timing, "PCIE_H2D_GBPS", 50.0)
    monkeypatch.setattr(timing, "HOST_ADAM_PPS", 4e9)
    t = offload_s(1e9, 2)
    assert (t["down"], t["up"], t["update"]) == pytest.approx((0.1, 0.08, 0.5)) and t["exposed"] == t["update"]
    monkeypatch.setattr(timing, "HOST_ADAM_PPS", 4e11)
    assert offload_s(1e9, 2)["exposed"] == pytest.approx(0.18)


def test_layout_auto_offloads_when_faster_or_when_nothing_fits(monkeypatch):
    """llama3.1-8b at -t 2048 -d 65536 on one GPU: on 150 GB it fits without offload only with
    --recompute; a host that updates and copies fast makes offload without recompute faster, and
    --layout auto takes it, saying why; a slow one leaves it out. On 80 GB nothing fits without, so
    auto offloads whatever the host's speed, saying so; a host too small to hold the state fits nothing.
    (A slow host: 1e8 elements/s, not 1e9, since partial offload -- test_layout_auto_offloads_part --
    makes 1e9's fast enough.)"""
    from braidtrain.config import Config

    model, cfg = model_config("llama3.1-8b", None), Config(seq_len=2048, total_batch=65536)
    auto = lambda gb, host=128: auto_layout(cfg, model, 1, "cuda", mem_gb=gb, host_gb=host)
    monkeypatch.setattr(timing, "HOST_ADAM_PPS", 1e8)  # the copies and the update: 80 s a step
    chosen, said = auto(150.1)
    assert chosen["offload"] is None and chosen["recompute"] and "--offload" not in said
    chosen, said = auto(80)
    assert chosen["offload"] == "optimizer" and said.endswith("since nothing fits on the GPU alone"), said
    with pytest.raises(UserError, match="nothing fits"):
        auto(80, host=64)
    monkeypatch.setattr(timing, "HOST_ADAM_PPS", 1e11)
    monkeypatch.setattr(timing, "PCIE_D2H_GBPS", 1e4)
    monkeypatch.setattr(timing, "PCIE_H2D_GBPS", 1e4)
    chosen, said = auto(150.1)
    assert chosen["offload"] == "optimizer" and not chosen["recompute"], said
    assert "faster than the best layout without it (ZeRO-0 b=4 --recompute, " in said and "GB of host memory" in said


def test_layout_auto_offloads_part_of_the_state_and_counts_it_by_the_ratio(monkeypatch):
    """--offload-ratio R: llama3.1-8b at -t 2048 -d 65536 on 150 GB, a host updating 1e9 elements/s
    (all of the state's update: 8 s a step): hosting all of it loses to the best layout without
    offload (b=4 --recompute); hosting the smallest share R = k/16 that lets the GPU hold the rest
    wins, and --layout auto picks it. R of the host's state, copies and update; the kept 1 - R of
    the optimizer's state on the GPU."""
    from braidtrain.config import Config
    from braidtrain.plan.memory import HOST_STATE

    model, cfg = model_config("llama3.1-8b", None), Config(seq_len=2048, total_batch=65536)
    monkeypatch.setattr(timing, "HOST_ADAM_PPS", 1e9)
    chosen, said = auto_layout(cfg, model, 1, "cuda", mem_gb=150.1, host_gb=128)
    R = chosen["offload_ratio"]
    assert chosen["offload"] == "optimizer" and 0 < R < 1 and (16 * R).is_integer() and not chosen["recompute"]
    assert f"--offload-ratio {R:g}" in said and "faster than the best layout without it" in said
    s = Setup(model, 1, 150.1, 2048, 65536)
    lay = Candidate(dp=1, zero=0, b=chosen["batch_size"], recompute=False, offload=True)
    part, whole, less = (estimate(s, replace(lay, ratio=r)) for r in (R, 1.0, R - 1 / 16))
    assert part["fits"] and not less["gpu_fits"] and whole["step_s"] > part["step_s"]
    state, owned = whole["state"], (whole["state"]["optimizer"] - whole["state"]["master"]) / 8
    assert part["offload_s"] == pytest.approx(R * whole["offload_s"])
    assert whole["host"] - part["host"] == pytest.approx(HOST_STATE * (1 - R) * owned)
    assert part["mem"]["optimizer"] - whole["mem"]["optimizer"] == pytest.approx((1 - R) * state["optimizer"])
    no = plan(s, zeros=(0,), recomputes=(True,), offloads=(False,))["rows"][0]
    assert no["fits"] and no["step_s"] > part["step_s"] and whole["step_s"] > no["step_s"]


def test_a_sequence_too_long_for_one_gpu_is_planned_over_cp_ranks():
    """gpt2 at t = 262144 on 2 x 80 GB without recompute: a whole sequence a GPU (dp 2) does not
    fit; each sequence over 2 cp ranks does, each rank keeping its t/cp tokens' activations, and
    is what plan recommends."""
    cfg = model_config("gpt2", 50257, block_size=262144)
    s = Setup(cfg, gpus=2, mem_gb=80, t=262144, d=2 * 262144)
    r = plan(s, recomputes=(False,))
    pick = lambda cp: next(e for e in r["rows"] if (e["layout"].cp, e["layout"].tp, e["layout"].pp,
                                                    e["layout"].zero) == (cp, 1, 1, 0))
    one, two = pick(1), pick(2)
    assert not one["fits"] and two["fits"]
    assert two["activations"]["layers"] == pytest.approx(one["activations"]["layers"] / 2)
    assert two["cp_comm_s"] > 0 and one["cp_comm_s"] == 0
    assert r["rows"][0]["layout"].cp == 2 and "cp=2" in r["recommendation"]
    assert "cp" in table(r, 4).splitlines()[0].split()


def test_the_planner_says_when_the_ring_or_the_all_gather_wins():
    """cp_comm_s against the docstring's counts: the all-gather pays one latency per collective
    and hides nothing; the ring pays one per hop and hides its keys and values behind two block
    pairs. At t = 1024 over 8 ranks with a 20 us latency the all-gather wins; at t = 131072 (the
    ring's transfers hidden) the ring does. Its gathered keys and values also count in memory."""
    cfg = model_config("gpt2", 50257, block_size=131072)
    for t, winner in ((1024, "allgather"), (131072, "ring")):
        s = Setup(cfg, gpus=8, mem_gb=80, t=t, d=t, alpha_us=20.0, busbw=100.0)
        ring, ag = (estimate(s, Candidate(1, 0, 1, False, cp=8, cp_impl=i)) for i in ("ring", "allgather"))
        C, L, kv = cfg.n_embd, cfg.n_layer, 2 * t // 8 * cfg.n_embd * 2
        gather = 20e-6 + 7 / 8 * kv * 8 / 100e9
        scatter = 20e-6 + 7 / 8 * 2 * kv * 8 / 100e9
        assert ag["cp_comm_s"] == pytest.approx(L * (2 * gather + scatter), rel=1e-9)
        c = t / 16
        hop, pairs = (lambda n: 20e-6 + n / 100e9), 8 * c * c * C / (s.tflops * 1e12)
        want = L * (7 * max(0, hop(kv) - pairs) + 7 * max(0, hop(kv) - 2 * pairs) + 8 * hop(2 * kv))
        assert ring["cp_comm_s"] == pytest.approx(want, rel=1e-9)
        best = min((ring, ag), key=lambda e: e["step_s"])
        assert best["layout"].cp_impl == winner, (t, ring["cp_comm_s"], ag["cp_comm_s"])
        assert ag["activations"]["ring_scores"] - ring["activations"]["ring_scores"] == 2 * t * C * (2 + 4)
    rows = plan(s)["rows"]
    assert {e["layout"].cp_impl for e in rows if e["layout"].cp > 1} == {"ring", "allgather"}


def test_zero_bubble_at_zero_2_holds_every_block_buckets_scratch_at_w():
    """Under zb, W computes a chunk's weight gradients at once: ZeRO-2's scratch is then every block
    bucket of the stage, not the two of an unsplit backward (1f1b): on gpt2's first stage (8 blocks,
    4 buckets of 2) two buckets more; its last (4 blocks, 2 buckets) the same."""
    s = Setup(model_config("gpt2", 50257), gpus=4, mem_gb=80, t=1024, d=4 * 1024 * 8)
    est = {name: estimate(s, Candidate(2, 2, 4, False, pp=2, schedule=name)) for name in ("1f1b", "zb")}
    grads = {name: [st["grads"] for st in e["stage_state"]] for name, e in est.items()}
    bucket = 4 * bucket_numels(s.cfg, s.bucket_mb)[0][1]
    assert grads["zb"] == [grads["1f1b"][0] + 2 * bucket, grads["1f1b"][1]], grads


def test_a_mixture_of_experts_is_planned_over_ep_ranks():
    """gpt2 with 8 experts (521M parameters): at ep the experts' parameters, gradients and Adam
    state are 1/ep a rank (the dense ones whole at ZeRO-0); the all-to-alls cost what
    ep_comm_s's docstring counts; on 8 x 10 GB ZeRO-0 fits only with the experts sharded, and
    plan proposes ep (without a pipeline: the planner weighs ep at pp 1)."""
    cfg = model_config("gpt2", 50257, moe_experts=8, moe_top_k=2)
    experts = param_counts(cfg)["expert"]
    dense = param_counts(cfg)["rank"] - experts
    assert experts == 12 * 8 * (2 * 768 * 3072 + 3072 + 768)
    s = Setup(cfg, gpus=8, mem_gb=80, t=1024, d=8 * 1024 * 4, alpha_us=10.0, busbw=100.0)
    for ep in (1, 2, 8):
        e = estimate(s, Candidate(8, 0, 1, False, ep=ep))
        assert e["state"]["params"] == 4 * (dense + experts // ep)
        rows = 2 * 1024 * 768 * 2  # k = 2 rows a token, bf16
        one = 10e-6 + (ep - 1) / ep * rows / 100e9 + 10e-6
        assert e["ep_comm_s"] == pytest.approx(4 * (12 * 4 * one if ep > 1 else 0), rel=1e-9)  # 4 micro-steps
    tight = Setup(cfg, gpus=8, mem_gb=9, t=1024, d=8 * 1024 * 4)
    r = plan(tight, zeros=(0,), pps=(1,))
    fits = {e["layout"].ep for e in r["rows"] if e["fits"]}
    assert 1 not in fits and 8 in fits
    assert r["rows"][0]["layout"].ep > 1 and "ep=" in r["recommendation"]
    assert "ep" in table(r, 4).splitlines()[0].split()


# ----------------------------------------------------------------------------- five axes together

def test_a_pipeline_of_cp_and_tp_ranks_by_hand():
    """gpt2 (blocks 0-7 | 8-11) on pp 2 x cp 2 x tp 2 (dp 1), 1f1b, 4 micro-batches of b = 1 at
    t = 1024, ZeRO-1 on a GPU. Per rank: the stage's parameters, tp's shards plus the replicated
    ones; ZeRO-1 shards Adam over the dp*cp = 2 replicas; each block of each live micro-batch (2
    on the first stage, 1 on the last) keeps (12 + 26/tp) bytes per token x channel of its t/cp
    tokens and the ring's fp32 output and log-sum-exp; the last stage adds the head's input and
    the vocab-parallel logits; one ring tile of scores at a time. ZeRO-1 over 2 replicas on a GPU:
    a lean state -- the blocks' matrices M in bf16, their fp32 masters counted with Adam's m and v,
    and of autocast's bf16 copies only the fp32 head's (the last stage's copy of wte)."""
    from braidtrain.parallel.context import tile_rows

    cfg, b, t, tp, cp = model_config("gpt2", 50257), 1, 1024, 2, 2
    h, a, Vt = cfg.n_embd, cfg.n_head, cfg.vocab_rows(2)
    s = Setup(cfg, gpus=8, mem_gb=80, t=t, d=b * t * 4)
    e = estimate(s, Candidate(1, 1, b, False, tp, pp=2, schedule="1f1b", cp=cp))
    block = (12 * h * h + 7 * h) // tp + 6 * h  # sharded / tp + ln_1, ln_2 and the two c_proj biases
    P = [Vt * h // tp + cfg.block_size * h + 8 * block, 4 * block + 2 * h + Vt * h // tp]
    x = (t // cp) * b * h
    ring = 4 * b * (t // cp) * (h // tp + a // tp)
    c = t // (2 * cp)
    scores = 16 * b * (a // tp) * tile_rows(c) * c
    blk = (12 + 26 / tp) * x + (16 + 4 * a / tp) * b * (t // cp) + ring  # (test_tp_activations_by_hand)
    act = [2 * 8 * blk, 4 * blk + 6 * x + b * (t // cp) * Vt // tp * 6]
    M = [8 * 12 * h * h // tp, 4 * 12 * h * h // tp]
    head = [0, Vt * h // tp]
    for r in range(2):
        params, optimizer = 4 * P[r] - 2 * M[r], (8 * P[r] + 4 * M[r]) // 2
        assert (e["stage_state"][r]["params"], e["stage_state"][r]["optimizer"]) == (params, optimizer)
        allocated = params + 4 * P[r] + optimizer + act[r] + scores + 2 * head[r]
        comm = NCCL_BYTES * 5  # the replicas' (= the cp group), tp's, pp's, one each way to the other stage
        want = allocated + comm + CONTEXT_BYTES + ALLOCATOR_SLACK * allocated
        assert e["stages_gb"][r] * GB == pytest.approx(want, rel=1e-12), r
    assert e["cp_comm_s"] > 0 and e["tp_comm_s"] > 0


def test_a_pipeline_of_expert_ranks_holds_its_experts_over_ep():
    """gpt2 with 8 experts on pp 2 x dp 2 at ep 2: a stage's experts are 1/ep a rank (counted
    here from the stage's own modules, by name), its dense parameters whole at ZeRO-0."""
    from braidtrain.model.registry import pipeline_chunks

    cfg = model_config("gpt2", 50257, moe_experts=8, moe_top_k=2)
    s = Setup(cfg, gpus=4, mem_gb=80, t=1024, d=2 * 1024 * 4)
    lay = Candidate(2, 0, 1, False, pp=2, schedule="1f1b", ep=2)
    e = estimate(s, lay)
    split = layout_of(s, lay, s.d).split
    for r in range(2):
        with torch.device("meta"):
            named = [(n, p.numel()) for m in pipeline_chunks(cfg, split, 2, r) for n, p in m.named_parameters()]
        experts = sum(k for n, k in named if ".experts." in n)
        assert experts and e["stage_state"][r]["params"] == 4 * (sum(k for _, k in named) - experts // 2), r
    assert e["ep_comm_s"] > 0
    plain = estimate(s, replace(lay, ep=1))
    assert plain["ep_comm_s"] == 0 and plain["mem"]["total"] > e["mem"]["total"]


def test_groups_that_span_nodes_talk_at_the_node_bandwidth():
    """The mesh is pp, dp, cp, tp outer to inner: on nodes of 4 GPUs, pp 2 x dp 2 x cp 2 x tp 2
    keeps tp (2 ranks) and cp (4) inside a node, while the replicas (8) and the pipeline's hops
    (16) span nodes; tp 4 on nodes of 2 costs what tp 4 costs at the node bandwidth."""
    s = Setup(model_config("gpt2", 50257), gpus=16, mem_gb=80, t=1024, d=1024 * 64, busbw=300.0,
                   gpus_per_node=4, node_busbw=25.0)
    lay = Candidate(2, 0, 1, False, 2, pp=2, schedule="1f1b", cp=2)
    assert [busbw_of(s, lay, k) for k in ("tp", "cp", "dp", "pp")] == [300.0, 300.0, 25.0, 25.0]
    four = Candidate(4, 0, 1, False, 4)
    apart, together = replace(s, gpus_per_node=2), replace(s, gpus_per_node=None, tp_busbw=25.0)
    assert tp_comm_s(apart, four) == pytest.approx(tp_comm_s(together, four), rel=1e-12)
    assert tp_comm_s(apart, four) > tp_comm_s(s, four)


def test_gpt2_xl_on_two_nodes_lists_pp_cp_and_tp_with_memory_that_adds_up(capsys):
    """The issue's command; gpt2-xl's 25 heads take no tp that divides 16 GPUs (the header says
    so), so the same model with 32 heads shows the tp rows."""
    argv = ("--model", "gpt2-xl", "--gpus", 16, "--gpus-per-node", 8, "--gpu-mem", 80, "-t", 8192)
    out = run_plan(*argv, "--pp", 1, "--cp", 1, "-z", 3, capsys=capsys)  # (the header does not depend on the filters)
    assert "no tp: no divisor of n_head 25" in out.splitlines()[0]
    data = json.loads(run_plan(*argv, "--n-head", 32, "--json", capsys=capsys))
    used = lambda k: any(r[k] > 1 and r["fits"] for r in data["layouts"])
    assert used("pp") and used("cp") and used("tp")
    assert any(r["pp"] > 1 and r["cp"] > 1 and r["tp"] > 1 for r in data["layouts"])
    for row in data["layouts"]:
        mem = row["mem_gb"]
        assert mem["total"] == pytest.approx(sum(mem[k] for k in COLUMNS))


def test_layout_auto_takes_the_best_layout_train_accepts():
    """auto_layout is the planner's best fitting layout, unless the run's other settings refuse
    it: on 6 processes exact mode takes no dp of 6 (not a power of two), so it takes the best
    layout that make_layout accepts with --exact."""
    from braidtrain.config import AUTO_CHOSEN, Config
    from braidtrain.layout import make_layout

    model = model_config("gpt2", 50257)
    cfg = Config(seq_len=1024, total_batch=6 * 1024 * 8)
    chosen, said = auto_layout(cfg, model, 6, "cpu", mem_gb=80)
    best = plan(Setup(model, 6, 80, 1024, cfg.total_batch, cpu=True))["rows"][0]["layout"]
    assert set(chosen) == set(AUTO_CHOSEN) and said.startswith(f"--layout auto: {best.name()}, dp {best.dp} ")
    assert (chosen["tp"], chosen["pp"], chosen["cp"], chosen["zero"], chosen["batch_size"]) == (
        best.tp, best.pp, best.cp, best.zero, best.b)
    exact, _ = auto_layout(replace(cfg, exact=True), model, 6, "cpu", mem_gb=80)
    kw = {k: v for k, v in exact.items() if k not in ("batch_size", "pp_split", "pp_schedule", "pp_virtual")}
    lay = make_layout(6, model, seq_len=1024, batch_size=exact["batch_size"], total_batch=cfg.total_batch, exact=True,
                      device="cpu", schedule=exact["pp_schedule"], virtual=exact["pp_virtual"], **kw)
    assert best.dp == 6 and lay.dp in (1, 2)
    with pytest.raises(UserError, match="-d"):
        auto_layout(Config(), model, 6, "cpu", mem_gb=80)
    with pytest.raises(UserError, match="nothing fits"):
        auto_layout(cfg, model_config("gpt2-xl", 50257), 1, "cpu", mem_gb=4)
