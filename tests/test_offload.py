"""--offload optimizer (parallel/offload.py): the optimizer's state in host memory, the update on
the host, on a worker thread overlapped with the next step's forward -- the same optimizer step as
on the device.

On the CPU the "host" copies are separate tensors, and the worker, the copies, their order, the
events and the waits run as on a GPU. The layouts run in the 8-rank launch (tests/layouts_worker.py,
suite "offload", 4 steps, clipping at 1.0 active at the first step): default mode against the same
layout without offload to 1e-6, exact mode bitwise against the single process without offload, on
1, 2 and 4 ranks at ZeRO 0-3, with tp, pp and with experts over ep ranks; exact runs that save midway
and resume with offload switched on or off; --offload-ratio 0.5 (and 1e-6) on 1 and 2 ranks, and 0.5
with tp, pp and ep, every rank's kept buckets checked. Exact mode's offloaded runs hold each bucket's
update back until the main thread asks for it (the test hook `Offload.hold`): a forward, a gather or a reader
between steps that did not wait for its bucket would read the weights of before the step, every
time, not only when the race goes that way. Then the command line: a pipeline, a resume into
offload through build.py, every reader of the weights between steps (held), the one-line refusals.
"""

import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from test_cli import assert_one_line_error

from helpers import SMALL, assert_bitwise, assert_follows, braidtrain, env, metrics, summary


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
    assert_bitwise(runs, ["pp2-dp2-z1-offload-exact", "pp2-z0-offload-exact"], runs["ref-exact"])
    assert_bitwise(runs, ["moe-dp4-ep2-z3-offload-exact"], runs["moe-ref-exact"])
    assert_bitwise(runs, ["recompute-dp2-z3-offload-exact"], runs["ref-exact"])
    assert runs["fp8-exact"]["losses"] != runs["ref-exact"]["losses"]  # (float8 is on)
    assert_bitwise(runs, ["fp8-dp2-z2-offload-exact"], runs["fp8-exact"])


def test_the_forward_waits_for_each_bucket_in_its_order(runs):
    """The held runs are bitwise (above): every read waited for its bucket. Here: the main thread
    did wait -- the overlapped path ran, not a synchronous one -- inside the next step's forward,
    once for each bucket of each of the first 3 updates (the 4th: the hash's wait for the whole),
    asking for them one by one in the order the worker updates them (the forward's): a forward
    that waited for the whole update at once would wait once a step. A pipeline's ZeRO-1 gathers
    wait for the whole update at the step's start (offload.py)."""
    held = [k for k in runs if k.endswith("-offload-exact")]
    assert len(held) == 15
    for name in held:
        r, n = runs[name], runs[name]["buckets"]
        want = {"forward": 0, "whole": 4 * n} if name.startswith("pp2-dp2-z1") else {"forward": 3 * n, "whole": n}
        assert r["offload_waits"] == want and n > 1, (name, r["offload_waits"], n)
    assert runs["into-offload"]["offload_waits"]["forward"] == runs["into-offload"]["buckets"]  # (resumed at step 2)
    free = [k for k in runs if k.startswith("dp") and k.endswith("-offload")]
    assert len(free) == 7 and all(runs[k]["offload_waits"] is not None for k in free)


def test_a_run_resumes_with_and_without_offload(runs):
    ref = runs["ref-exact"]
    for name in ("into-offload", "out-of-offload"):
        r = runs[name]
        assert (r["sha"], r["losses"], r["norms"]) == (ref["sha"], ref["losses"][2:], ref["norms"][2:]), name


def test_a_ratio_keeps_the_leading_buckets_on_the_device_and_is_the_same_step(runs):
    """--offload-ratio R (offload.kept): the buckets the next forward reads first, as many as fit in (1 - R) of
    the rank's owned elements, keep their master and moments on the device and are updated there; the
    rest are hosted, and the forward waits for those only (held: once a bucket a step). The same step as
    without offload: to 1e-6 at R = 0.5, 1e-6 (all but the last buckets kept) and 1e-17 (1 - R rounds to
    1: still one bucket hosted), bitwise in exact mode on 1 and 2 ranks at ZeRO 0-3; at R = 0.5 with the
    other axes, as R = 1 (above): tp 2 x dp 2 at ZeRO-1 bitwise at its own tp, pp 2 x dp 2 at ZeRO-1 and
    pp 2 at ZeRO-0 bitwise, pp 2 to 1e-6 in default mode, the experts' dp 4 x ep 2 at ZeRO-3 bitwise --
    on every rank, a pipeline's stage keeping its own leading buckets, its tied embedding hosted on
    both; a run of R = 1 resumes at R = 0.5 (and ZeRO-3) to the bit."""
    default = [f"dp2-z{z}-ratio{r:g}" for z in (1, 3) for r in (0.5, 1e-6, 1e-17)]
    for name in default:
        assert_follows(runs, [name], runs[name.split("-ratio")[0]], 1e-6)
    assert_follows(runs, ["pp2-z0-ratio0.5"], runs["dp1-z0"], 1e-6)
    exact = [k for k in runs if k.startswith("dp") and k.endswith("-ratio0.5-exact")]
    assert len(exact) == 5
    assert_bitwise(runs, exact, runs["ref-exact"])
    assert_bitwise(runs, ["tp2-dp2-z1-ratio0.5-exact"], runs["tp2-dp2-z1-exact"])
    assert_bitwise(runs, ["pp2-dp2-z1-ratio0.5-exact", "pp2-z0-ratio0.5-exact"], runs["ref-exact"])
    assert_bitwise(runs, ["moe-dp4-ep2-z3-ratio0.5-exact"], runs["moe-ref-exact"])
    ref, r = runs["ref-exact"], runs["into-ratio"]
    assert (r["sha"], r["losses"], r["norms"]) == (ref["sha"], ref["losses"][2:], ref["norms"][2:])
    ratios = [k for k in runs if "-ratio" in k and k != "into-ratio"]
    assert len(ratios) == 16
    for name in ratios:
        ratio = float(name.split("-ratio")[1].removesuffix("-exact"))
        stages = set()
        for rank, (owned, waits) in enumerate(zip(runs[name]["owned"], runs[name]["waits"], strict=True)):
            owned = sorted(owned, key=lambda o: o[1:4])  # the next forward's order
            stages.add(tuple(sorted({o[1] for o in owned})))
            split = [o for o in owned if o[5]]  # a tied embedding split over the pipeline: hosted on both stages
            assert not any(o[4] for o in split) and bool(split) == name.startswith("pp2"), (name, rank, split)
            budget = sum(o[0] for o in owned) - math.ceil(ratio * sum(o[0] for o in owned))
            sizes, kept = [o[0] for o in owned if not o[5]], [o[4] for o in owned if not o[5]]
            n = kept.count(True)
            assert 0 < n < len(kept) and kept == [True] * n + [False] * (len(kept) - n), (name, rank, kept)
            assert sum(sizes[:n]) <= budget < sum(sizes[: n + 1]), (name, rank, sizes, n)
            hosted = len(owned) - n
            want = {"forward": 0, "whole": 4 * hosted} if name.startswith("pp2-dp2-z1") else {"forward": 3 * hosted,
                                                                                              "whole": hosted}
            assert waits == want, (name, rank, waits)
        assert len(stages) == (2 if name.startswith("pp2") else 1), (name, stages)  # (each stage's own buckets)


def test_a_bad_ratio_is_one_line(tmp_path, shakespeare):
    for args, words in ((["--offload-ratio", 0.5], ("--offload-ratio 0.5", "needs --offload optimizer")),
                        (["--offload", "optimizer", "--offload-ratio", 0], ("--offload-ratio 0", "0 < R <= 1")),
                        (["--offload", "optimizer", "--offload-ratio", 1.5], ("--offload-ratio 1.5", "0 < R <= 1"))):
        p = braidtrain("train", *SMALL, "-i", shakespeare, "-x", 1, *args, "--out", tmp_path / "r", check=False)
        assert_one_line_error(p, *words)
    p = braidtrain("plan", "--model", "gpt2", "--offload-ratio", 2, check=False)  # (the planner's, as train's)
    assert_one_line_error(p, "--offload-ratio 2", "0 < R <= 1")


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


def test_every_reader_between_steps_waits_for_the_update(tmp_path, shakespeare):
    """Through `braidtrain train` with --compile, dp 2 at ZeRO-1 with offload, every step's update
    held back until the run asks for each bucket (BRAIDTRAIN_FAULT hold-offload): the validation
    losses, the sample, both checkpoints (weights, m and v) and the final hash are the run's without
    offload, to the bit -- each reader between steps waited for the whole update, and the waits'
    hooks sit outside the compiled blocks."""
    from braidtrain.io.checkpoint import Reader, saved_config, verify
    from braidtrain.parallel.placement import for_config

    base = ["train", *SMALL, "-i", shakespeare, "-d", 512, "-x", 4, "--exact", "--val-every", 3, "--sample-tokens", 24,
            "--ckpt-every", 2, "--compile"]
    plain, held = tmp_path / "plain", tmp_path / "held"
    p = braidtrain(*base, "--out", plain)
    q = braidtrain(*base, "-z", 1, "--offload", "optimizer", "--out", held, nproc=2,
                   environ=dict(env(), BRAIDTRAIN_FAULT="hold-offload:step=1"))
    sample = lambda out: out[out.index("--- sample ---"):]
    assert sample(q.stdout) == sample(p.stdout)
    assert [r.get("val_loss") for r in metrics(held)] == [r.get("val_loss") for r in metrics(plain)] != [None] * 4
    assert summary(held)["weights_sha256"] == summary(plain)["weights_sha256"]
    assert all(r["offload_s"] >= 0 and r["offload_update_s"] >= 0 for r in metrics(held))
    for step in ("step_00000002", "step_00000004"):
        a, b = (plain / "checkpoints" / step), (held / "checkpoints" / step)
        ra, rb = Reader(a, verify(a)), Reader(b, verify(b))
        for e in for_config(saved_config(verify(a))):
            for kind in ("param", "m", "v"):
                assert torch.equal(ra.full(kind, e.name), rb.full(kind, e.name)), (step, kind, e.name)


def test_a_non_finite_step_is_skipped_on_the_host_too(tmp_path, shakespeare):
    """Step 2's loss NaN (BRAIDTRAIN_FAULT nan): the device's skip flag goes down with the clip
    scale, the host update changes nothing, and the run ends with the weights of the run without
    offload that skipped the same step -- dp 2 at ZeRO-2, in exact mode, to the bit."""
    base = ["train", *SMALL, "-i", shakespeare, "-d", 512, "-x", 4, "--exact", "--max-skipped", 2]
    nan = dict(env(), BRAIDTRAIN_FAULT="nan:step=2")
    plain, off = tmp_path / "plain", tmp_path / "off"
    braidtrain(*base, "--out", plain, environ=nan)
    braidtrain(*base, "-z", 2, "--offload", "optimizer", "--out", off, nproc=2, environ=nan)
    assert [r.get("skipped", False) for r in metrics(off)] == [False, True, False, False]
    assert summary(off)["weights_sha256"] == summary(plain)["weights_sha256"]


def test_narrower_weights_come_back_converted_and_a_failed_update_is_raised():
    """Device weights narrower than the master (bf16, as the lean state makes them; an engine of
    six one-bucket shards on the CPU): each bucket's update lands rounded (to nearest even, as
    publish() rounds), the fp32 master keeps the update -- that of the device's optimizer: bit for
    bit in exact mode, to 1e-6 in default mode (the host's decay inside the fused kernel, the
    device's a pass of its own), over a decayed range that ends off the vector width; and a host
    update that fails is raised at the next wait, not lost with its thread."""
    import torch.nn as nn

    from braidtrain.optim import AdamW

    class Bucket:  # a lean bucket: bf16 compute weights, its fp32 master apart (engine.owned yields the master)
        def __init__(self, index, master):
            self.index, self.stage, self.modules, self.zero, self.master = index, 0, [], 0, master
            self.compute = master.bfloat16()

        def compute_shard(self):
            return self.compute

    for exact in (True, False):
        gen = torch.Generator().manual_seed(0)
        buckets = [Bucket(i, torch.randn(192, generator=gen)) for i in range(6)]
        params = [b.compute for b in buckets]
        grads = [torch.randn(192, generator=gen) for _ in buckets]
        part = nn.Module()
        part.stage, part.blocks = 0, lambda: []
        engine = SimpleNamespace(device=torch.device("cpu"), exact=exact, parts=[part], pp=SimpleNamespace(size=1),
                                 updates=None, owned=lambda: ((b, b.master, g) for b, g in zip(buckets, grads)),
                                 decay_segments=lambda b: [(32, 100)])
        want = [b.master.clone() for b in buckets]
        opt = AdamW(engine, offload=True)
        scale, ref = torch.tensor(1.5), [(torch.zeros(192), torch.zeros(192), [(32, 100)]) for _ in buckets]
        for _ in range(2):  # (the second step: moments not zero)
            opt.prepare(1e-2)
            # (the fused kernel unscales its gradient in place) -- the device's update, the decay a pass of its own
            opt.apply(want, [g.clone() for g in grads], ref, scale)
            opt.update(scale)
            opt.wait()
        for m, w, p in zip(opt.offload.master, want, params):
            if exact:
                assert torch.equal(m, w) and torch.equal(p, w.bfloat16())
            else:
                torch.testing.assert_close(m, w, rtol=1e-6, atol=0)
            assert p.dtype == torch.bfloat16 and torch.equal(p, m.bfloat16())
    opt.apply = lambda *a, **kw: 1 / 0
    opt.prepare(1e-2)
    opt.update()
    with pytest.raises(RuntimeError, match="host's optimizer update failed: ZeroDivisionError"):
        opt.wait()


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
    from braidtrain.plan.memory import HOST_PROCESS, bucket_numels
    from braidtrain.plan.search import plan
    from braidtrain.plan.space import Setup

    for k, v in (("HOST_ADAM_PPS", 1e8), ("PCIE_D2H_GBPS", 2.5), ("PCIE_H2D_GBPS", 2.5)):  # slow: never faster, R < 1 too
        monkeypatch.setattr(timing, k, v)
    cfg = registry.model_config("llama3.1-8b", None)
    big = plan(Setup(cfg, 1, 150.1, 2048, 65536), zeros=(0,), bs=(1, 4), variants=False)
    assert big["rows"][0]["fits"] and not any(e["layout"].offload for e in big["rows"])
    small = plan(Setup(cfg, 1, 80, 2048, 65536), zeros=(0,), bs=(1, 4), variants=False)
    assert small["rows"][0]["fits"] and small["rows"][0]["layout"].offload and "--offload" in small["recommendation"]
    # (the pick keeps a share on the GPU, --offload-ratio < 1: test_plan.py; here all of it hosted, R = 1)
    best = plan(Setup(cfg, 1, 80, 2048, 65536), zeros=(0,), bs=(1, 4), variants=False, ratio=1.0)["rows"][0]
    assert best["fits"] and best["layout"].offload and best["layout"].ratio == 1
    P = cfg.num_params()
    # 12 bytes an element, and offload.SLOTS fp32 staging slots as wide as the widest bucket (the
    # untied embedding's: 525 M elements, 8.4 GB); on the GPU one such slot the bf16 weights come up by
    # (of the blocks' bf16 buckets: the embedding's and head's stay fp32 and go up as they are); and
    # the process's own resident memory (plan/memory.HOST_PROCESS: a GPU's plan)
    buckets = bucket_numels(cfg, Config.bucket_mb)
    widest, narrow = max(k for _, k in buckets), max(k for kind, k in buckets if kind == "block")
    assert narrow < widest / 2 and best["host"] == 12 * P + 4 * 4 * widest + HOST_PROCESS
    assert best["mem"]["optimizer"] == 4 * narrow and best["offload_s"] > 0
    tight = plan(Setup(cfg, 1, 80, 2048, 65536, host_gb=64), zeros=(0,), bs=(1, 4), variants=False)
    assert not tight["rows"][0]["fits"]
    p = braidtrain("plan", "--model", "llama3.1-8b", "--gpu-mem", "80", "-t", "2048", "-d", "65536", "--offload",
                   "--host-mem", "64", check=False)
    assert_one_line_error(p, "--offload: the host cannot hold", "--host-mem 64")
