"""`braidtrain plan`: the model-state formulas against hand arithmetic, the planner's view of the
engine's buckets against the engine, the table and its fixes, and `--check` against real CPU
training runs (estimated model state within 5% of the run's mem_gb).

The command is driven through plan.add_parser on the CLI's own Parser class, in process, so the
test does not depend on cli.py's wiring (one test checks that wiring, and skips until it exists).
The --check runs are real subprocesses (`braidtrain train`, under torchrun for 2 ranks), started
together by a module fixture so their torch imports overlap.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from braidtrain import plan
from braidtrain.cli import Parser
from braidtrain.comm import Comm
from braidtrain.errors import UserError
from braidtrain.mesh import build_mesh
from braidtrain.model.gpt import GPT, model_config
from braidtrain.parallel.data import DataParallel
from helpers import ROOT, braidtrain, prepare_bytes


def run_plan(*argv, capsys) -> str:
    parser = Parser(prog="braidtrain")
    plan.add_parser(parser.add_subparsers(dest="cmd", required=True, parser_class=Parser))
    assert plan.run(parser.parse_args(["plan", *map(str, argv)])) == 0
    return capsys.readouterr().out


# ----------------------------------------------------------------------------- formulas

def small_model(n_layer=4):
    return model_config("tiny", 256, n_layer=n_layer)  # 128 channels, byte vocabulary


def sizes(cfg, bucket_mb):
    """(P, largest bucket in bytes, largest block bucket, embedding group) from the planner."""
    buckets = plan.bucket_numels(cfg, bucket_mb)
    blocks = [k for kind, k in buckets if kind == "block"]
    return cfg.num_params(), 4 * max(k for _, k in buckets), max(blocks), buckets[-1][1]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_model_state_formulas_match_hand_arithmetic(n):
    cfg = small_model()
    P, bucket, block, embed = sizes(cfg, 25.0)
    c = cfg.n_embd
    assert block == cfg.n_layer * (12 * c * c + 13 * c)  # 25 MB holds all four blocks
    assert embed == cfg.padded_vocab * c + cfg.block_size * c + 2 * c
    assert P == block + embed
    scratch = 2 * bucket  # two buckets' reduce-scatters in flight
    working = 4 * (2 * block + embed)  # ZeRO-3: two block buckets and the embedding group, fp32
    want = {  # (params, grads, optimizer): fp32 weights and grads, fp32 Adam m and v
        0: (4 * P, 4 * P, 8 * P),
        1: (4 * P, 4 * P, 8 * P / n),
        2: (4 * P, 4 * P / n + scratch, 8 * P / n),
        3: (4 * P / n + working, 4 * P / n + scratch, 8 * P / n),
    }
    for zero, (params, grads, opt) in want.items():
        got = plan.model_state_bytes(P, n, zero, bucket, block, embed)
        assert (got["params"], got["grads"], got["optimizer"]) == pytest.approx((params, grads, opt), rel=1e-12), zero
        assert got["transient"] == (0, 0, scratch, scratch + working)[zero]


@pytest.mark.parametrize("n", [2, 4])
def test_each_zero_stage_needs_no_more_than_the_one_before(n):
    # ZeRO-2 trades 4P(1 - 1/n) of gradients for 2 buckets of scratch, ZeRO-3 4P(1 - 1/n) of
    # parameters for the working set: a gain when buckets are small next to the model, as here
    # (16 blocks, one per 0.5 MB bucket). With 4 blocks in one bucket it would not be.
    cfg = small_model(n_layer=16)
    P, bucket, block, embed = sizes(cfg, 0.5)
    assert block == 12 * cfg.n_embd**2 + 13 * cfg.n_embd  # one block per bucket
    total = [sum(v for k, v in plan.model_state_bytes(P, n, z, bucket, block, embed).items() if k != "transient")
             for z in range(4)]
    assert total[0] == 16 * P
    assert all(b <= a for a, b in zip(total, total[1:])), total


@pytest.mark.parametrize("bucket_mb", [25.0, 0.5, 1.7])
def test_planner_buckets_are_the_engines(bucket_mb):
    cfg = small_model(n_layer=6)
    engine = DataParallel(GPT(cfg), build_mesh(0, 1), Comm(torch.device("cpu")), zero=0, exact=False,
                          bucket_mb=bucket_mb, device=torch.device("cpu"))
    assert [b.numel for b in engine.buckets] == [k for _, k in plan.bucket_numels(cfg, bucket_mb)]


# ----------------------------------------------------------------------------- the table

def test_gpt2_on_8_gpus_prints_a_ranked_table_and_a_recommendation(capsys):
    out = run_plan("--model", "gpt2", "--gpus", 8, "--gpu-mem", 80, capsys=capsys)
    lines = out.splitlines()
    assert "124.5M parameters" in lines[0]
    assert lines[1].split()[:6] == ["dp", "zero", "b", "micro", "recomp", "mem"]
    rows = [l.split() for l in lines[2:] if l.split() and l.split()[0] == "8"]
    assert len(rows) == 12 and all(r[-1] == "yes" for r in rows)  # gpt2 fits 80 GB at the top
    times = [float(r[-3]) for r in rows]
    assert times == sorted(times)
    assert lines[-1].startswith("recommended: ZeRO-") and "tokens/s" in lines[-1]


def test_gpt2_xl_on_one_24gb_gpu_names_the_smallest_change(capsys):
    out = run_plan("--model", "gpt2-xl", "--gpus", 1, "--gpu-mem", 24, "-z", 0, "-b", 1, "--no-recompute", capsys=capsys)
    fix = next(l for l in out.splitlines() if l.startswith("ZeRO-0 b=1 needs"))
    # 16P of model state alone is 25 GB: no setting fits one GPU, so the fix is hardware
    assert "> 24 GB: use GPUs with >= " in fix and "GPUs with ZeRO-3" in fix
    assert out.splitlines()[-1].startswith("nothing fits on 1 x 24 GB")


def test_a_layout_that_does_not_fit_gets_single_setting_fixes(capsys):
    out = run_plan("--model", "gpt2", "--gpus", 2, "--gpu-mem", 16, "-z", 0, "-b", 16, "--no-recompute", capsys=capsys)
    assert "ZeRO-0 b=16 needs 20.3 GB > 16 GB: use b=8, or --recompute" in out


def test_json_parses_and_every_layout_has_the_breakdown(capsys):
    data = json.loads(run_plan("--model", "gpt2", "--gpus", 8, "--json", capsys=capsys))
    assert data["model"]["params"] == 124_475_904 and data["recommendation"].startswith("recommended:")
    assert len(data["layouts"]) == 4 * 7 * 2
    for row in data["layouts"]:
        mem = row["mem_gb"]
        parts = ("params", "grads", "optimizer", "activations", "comm", "overhead")
        assert mem["total"] == pytest.approx(sum(mem[k] for k in parts))
        assert row["tokens_per_s"] == pytest.approx(524288 / row["step_s"])


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


# ----------------------------------------------------------------------------- --check

CHECKS = [(1, 0), (2, 0), (2, 1)]  # (processes, ZeRO stage)


@pytest.fixture(scope="module")
def checks(tmp_path_factory, monkeypatch_module):
    data = prepare_bytes(tmp_path_factory.mktemp("plan") / "shakespeare")

    def one(case):
        n, zero = case
        s = plan.Setup(model_config("tiny", 256), gpus=n, mem_gb=80, t=64, d=256)
        return plan.check(s, plan.Layout(n, zero, 2, False), str(data), None)

    with ThreadPoolExecutor(len(CHECKS)) as pool:
        return dict(zip(CHECKS, pool.map(one, CHECKS)))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("PYTHONPATH", str(ROOT))
        mp.delenv("RANK", raising=False)
        yield mp


@pytest.mark.parametrize("case", CHECKS, ids=lambda c: f"{c[0]}proc-zero{c[1]}")
def test_check_model_state_matches_a_real_cpu_run(checks, case):
    r = checks[case]
    assert r["device"] == "cpu" and r["layout"]["zero"] == case[1]
    assert abs(r["rel_error"]) < 0.05, r
