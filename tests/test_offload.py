"""--offload optimizer (parallel/offload.py): the optimizer's state in host memory, the update on
the host -- the same optimizer step as on the device.

On the CPU the "host" copies are separate tensors, and the copies, their order and the host
update run as on a GPU. The layouts run in the 8-rank launch (tests/layouts_worker.py, suite
"offload", 4 steps, clipping at 1.0 active at the first step): default mode against the same layout
without offload to 1e-6, exact mode bitwise against the single process without offload, on 1, 2
and 4 ranks at ZeRO 0-3, with tp and with experts over ep ranks; exact runs that save midway and
resume with offload switched on or off. Then the command line: a pipeline, a resume into offload
through build.py, the one-line refusals.
"""

import shutil

import pytest
from test_cli import assert_one_line_error

from helpers import SMALL, assert_bitwise, assert_follows, braidtrain, metrics, summary


@pytest.fixture(scope="module")
def runs(layout_suites):
    return layout_suites["offload"]


def test_default_mode_is_the_same_step_as_without_offload(runs):
    pairs = [k for k in runs if k.startswith("dp") and k.endswith("-offload")]
    assert len(pairs) == 7
    for name in pairs:
        assert_follows(runs, [name], runs[name.removesuffix("-offload")], 1e-6)


def test_exact_mode_is_bitwise_on_1_2_4_ranks_at_every_zero_stage(runs):
    exact = [k for k in runs if k.startswith("dp") and k.endswith("-offload-exact")]
    assert len(exact) == 9
    assert_bitwise(runs, exact, runs["ref-exact"])
    assert_bitwise(runs, ["tp2-dp2-z1-offload-exact"], runs["tp2-dp2-z1-exact"])
    assert_bitwise(runs, ["pp2-dp2-z1-offload-exact"], runs["ref-exact"])
    assert_bitwise(runs, ["moe-dp4-ep2-z3-offload-exact"], runs["moe-ref-exact"])


def test_a_run_resumes_with_and_without_offload(runs):
    ref = runs["ref-exact"]
    for name in ("into-offload", "out-of-offload"):
        r = runs[name]
        assert (r["sha"], r["losses"], r["norms"]) == (ref["sha"], ref["losses"][2:], ref["norms"][2:]), name


def test_command_line_pipeline_and_resume_into_offload(tmp_path, shakespeare):
    """Exact mode through `braidtrain train`: pp 2 x dp 2 with offload, and a one-process run
    without offload resumed at step 2 with it, each the straight run's weights to the bit."""
    base = ["train", *SMALL, "-i", shakespeare, "-d", 512, "-x", 4, "--exact"]
    full = tmp_path / "full"
    braidtrain(*base, "--ckpt-every", 2, "--out", full)
    piped = tmp_path / "piped"
    braidtrain(*base, "--pp", 2, "-z", 1, "--offload", "optimizer", "--out", piped, nproc=4)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000004")
    (cut / "summary.json").unlink()
    p = braidtrain(*base, "--offload", "optimizer", "--out", cut, "--resume", "auto")
    assert "step_00000002" in p.stdout and "offload None -> optimizer" in p.stdout
    for run in (piped, cut):
        assert summary(run)["weights_sha256"] == summary(full)["weights_sha256"], run
        assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(full)], run


def test_live_recovery_with_offload_is_one_line(tmp_path, shakespeare):
    p = braidtrain("train", *SMALL, "-i", shakespeare, "-x", 1, "--offload", "optimizer", "--live-recovery",
                   "--out", tmp_path / "r", check=False)
    assert_one_line_error(p, "--offload optimizer", "--live-recovery")


def test_the_planner_offloads_only_where_nothing_fits_and_counts_the_host(monkeypatch):
    """llama3.1-8b at -t 2048 -d 65536 on one GPU: on 150 GB a layout fits without offload (the
    table has no offload rows, at the assumed host rates); on 80 GB none does, so the recommendation
    offloads, with the host's 12 bytes an element (+ staging) and the copies' time; a host too small
    is one line."""
    from braidtrain.config import Config
    from braidtrain.model import registry
    from braidtrain.plan import timing
    from braidtrain.plan.memory import bucket_numels
    from braidtrain.plan.search import plan
    from braidtrain.plan.space import Setup

    for k, v in (("HOST_ADAM_PPS", 1e9), ("PCIE_D2H_GBPS", 25.0), ("PCIE_H2D_GBPS", 25.0)):  # slow: never faster
        monkeypatch.setattr(timing, k, v)
    cfg = registry.model_config("llama3.1-8b", None)
    big = plan(Setup(cfg, 1, 150.1, 2048, 65536), zeros=(0,), bs=(1, 4), variants=False)
    assert big["rows"][0]["fits"] and not any(e["layout"].offload for e in big["rows"])
    small = plan(Setup(cfg, 1, 80, 2048, 65536), zeros=(0,), bs=(1, 4), variants=False)
    best = small["rows"][0]
    assert best["fits"] and best["layout"].offload and "--offload" in small["recommendation"]
    P = cfg.num_params()
    # 12 bytes an element, and offload.SLOTS fp32 staging slots as wide as the widest bucket (the
    # untied embedding's: 525 M elements, 8.4 GB)
    widest = max(k for _, k in bucket_numels(cfg, Config.bucket_mb))
    assert best["host"] == 12 * P + 4 * 4 * widest and best["mem"]["optimizer"] == 0 and best["offload_s"] > 0
    tight = plan(Setup(cfg, 1, 80, 2048, 65536, host_gb=64), zeros=(0,), bs=(1, 4), variants=False)
    assert not tight["rows"][0]["fits"]
    p = braidtrain("plan", "--model", "llama3.1-8b", "--gpu-mem", "80", "-t", "2048", "-d", "65536", "--offload",
                   "--host-mem", "64", check=False)
    assert_one_line_error(p, "--offload: the host cannot hold", "--host-mem 64")
