"""Pipeline parallelism. In one 8-rank process group (tests/layouts_worker.py), many layouts of
one GPT on the same global batches: every schedule at pp 2 and 4, with dp, ZeRO and tp, against
the single process -- within 1e-5 by default, to the bit in exact mode -- with the activations
each rank holds and the two copies of the tied embedding checked. Then the schedules as data (in
this process), and the real command line: a pp 2 x dp 2 run that validates, samples and saves,
resumed at pp 1 and pp 4."""

import json
import shutil

import pytest
import torch

from helpers import SMALL, assert_bitwise, assert_follows, braidtrain, launch, metrics, summary
from braidtrain.parallel import pipeline
from braidtrain.parallel.schedule import Action


@pytest.fixture(scope="module")
def runs(layout_suites):
    return layout_suites["pipeline"]


def test_every_layout_matches_the_single_process(runs):
    ref = runs["ref"]
    default = [k for k in runs if not k.endswith("exact") and k != "ref"]
    assert len(default) == 12
    assert_follows(runs, default, ref, 1e-5)


def test_exact_mode_is_bitwise_across_pp_schedules_dp_and_zero(runs):
    ref = runs["ref-exact"]
    exact = [k for k in runs if k.endswith("exact") and k != "ref-exact"]
    assert len(exact) == 18 and all(any(s in n for n in exact) for s in pipeline.SCHEDULES)
    assert_bitwise(runs, exact, ref)


def test_activations_alive_at_once(runs):
    """1F1B holds at most p - r micro-batches on stage r (exactly that many with m >= p); GPipe all m."""
    for pp in (2, 4):
        r = runs[f"pp{pp}-1f1b"]
        assert r["live"] == [pp - s for s in r["stage_of_rank"]], r["live"]
        g = runs[f"pp{pp}-gpipe"]
        assert g["live"] == [g["micro"]] * pp


def test_the_tied_embeddings_two_copies_stay_bitwise_equal(runs):
    """After training, each pipeline's first stage (lookup) and last stage (head) hold the same wte
    to the bit, on every data-parallel replica."""
    for name, r in runs.items():
        dp = int(name.split("-dp")[1][0]) if "-dp" in name else 1
        assert r["wte_copies"] == (2 * dp if name.startswith("pp") else 1) and r["wte_copies_equal"], (name, r)


# -- the schedules, as data ---------------------------------------------------------------------

@pytest.mark.parametrize("name", pipeline.SCHEDULES)
@pytest.mark.parametrize("pp, m", [(2, 2), (2, 8), (3, 6), (4, 4), (4, 16), (8, 8)])
def test_each_schedule_is_valid_for_every_rank(name, pp, m):
    v = 2 if name == "interleaved" else 1
    plan = pipeline.build(name, pp, v, m)  # checked: pairs, order, no deadlock
    assert len(plan) == pp
    work = sum(a.op in ("F", "B", "W") for actions in plan for a in actions)
    assert work == pp * v * m * (3 if name == "zb" else 2)


def test_1f1b_warms_up_with_p_minus_r_minus_1_forwards():
    for r, actions in enumerate(pipeline.compute_order("1f1b", 4, 1, 8)):
        ops = [a.op for a in actions]
        assert ops.index("B") == 4 - r, (r, ops)  # the warm-up forwards, then the first F of the steady state


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_simulated_steps_match_the_papers_bubbles(pp, m):
    """With unit costs (F = 1, a whole backward 2; zb's B = W = 1; interleaved's chunks at 1/v of
    that), the simulated step is the papers' closed form: (m + p - 1) * 3 for gpipe and 1f1b,
    3m + 3(p-1)/v interleaved (Narayanan et al.), 3m + (p-1)(F + B - W) = 3m + p - 1 for zb
    (Qi et al.'s ZB-H1); 1f1b keeps p - r micro-batches alive on rank r, gpipe all m."""
    want = {"gpipe": 3 * (m + pp - 1), "1f1b": 3 * (m + pp - 1), "interleaved": 3 * m + 3 * (pp - 1) / 2,
            "zb": 3 * m + pp - 1}
    for name in pipeline.SCHEDULES:
        v = 2 if name == "interleaved" else 1
        cost = (lambda a: 1.0) if name == "zb" else (lambda a: (1.0 if a.op == "F" else 2.0) / v)
        ranks = pipeline.simulate(pipeline.build(name, pp, v, m), pp, cost, size=lambda _c: 1.0)
        assert max(r["end"] for r in ranks) == pytest.approx(want[name]), name
        assert sum(r["busy"] for r in ranks) == pytest.approx(3 * m * pp), name
        if name in ("gpipe", "1f1b"):
            assert [r["peak"] for r in ranks] == [m if name == "gpipe" else pp - r for r in range(pp)], name


def test_a_slow_link_or_stage_shows_in_the_simulated_step():
    """Two stages, two micro-batches, 1f1b, F = 1 and B = 2, timed by hand: rank 0 runs F0 F1,
    then B0 once rank 1's B0 is back, then B1. A transfer of h seconds: rank 1 runs F0 at 1+h,
    B0 to 4+h, F1, B1 to 7+h, so rank 0's B0 runs 4+2h..6+2h and its B1 ends at 9+2h. Rank 1
    twice as slow: F0 1-3, B0 3-7, F1 7-9, B1 9-13, and rank 0's B1 ends at 15."""
    plan = pipeline.build("1f1b", 2, 1, 2)
    unit = lambda a: 1.0 if a.op == "F" else 2.0
    ends = lambda ranks: [r["end"] for r in ranks]
    assert ends(pipeline.simulate(plan, 2, unit)) == [9.0, 7.0]
    assert ends(pipeline.simulate(plan, 2, unit, hop=0.25)) == [9.5, 7.25]
    slow = pipeline.simulate(plan, 2, lambda a: unit(a) * (2 if a.stage == 1 else 1))
    assert ends(slow) == [15.0, 13.0] and [r["start"] for r in slow] == [0.0, 1.0]
    assert slow[0]["busy"] == 6.0 and slow[1]["busy"] == 12.0


@pytest.mark.parametrize("broken, words", [
    # the first stage waits for micro-batch 0's gradient before sending its activation
    (lambda plan: plan[0].insert(1, plan[0].pop(plan[0].index(Action("RECV_B", 0, 0)))), "deadlocks"),
    (lambda plan: plan[0].pop(1), "do not pair up"),  # a send left out
    (lambda plan: plan[1].remove(Action("B", 1, 0)), "runs"),
    # a send before the forward that computes what it sends
    (lambda plan: plan[0].insert(0, plan[0].pop(plan[0].index(Action("SEND_F", 0, 0)))), "before what it needs"),
])
def test_a_plan_that_cannot_run_is_refused(broken, words):
    plan = pipeline.with_p2p(pipeline.compute_order("1f1b", 2, 1, 4), 2, 1)
    broken(plan)
    with pytest.raises(ValueError, match=words):
        pipeline.check(plan, 2, 1, 4)


def test_the_split_balances_flops():
    from braidtrain.model.registry import model_config

    gpt2 = model_config("gpt2", 50257)
    cuts = pipeline.split(12, 2, pipeline.flop_cost(gpt2, 1024, 2))
    assert [len(r) for r in cuts] == [8, 4]  # the head weighs 4.5 blocks
    assert [len(r) for r in pipeline.split(8, 4)] == [2, 2, 2, 2]
    assert pipeline.split(7, 2, by_hand=[3, 4]) == [range(0, 3), range(3, 7)]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bf16", [False, True])
def test_zero_bubbles_split_backward_is_the_backward_to_the_bit(device, bf16):
    """B then W (parallel/zb.py) on a middle chunk and on the last one (head and loss): the input's
    gradient and every parameter's equal those of one plain backward, bitwise -- in fp32 and
    under bf16 autocast (on the GPU too, where the GPU is: benchmarks/axes/pipeline_gpu.sh runs this)."""
    from braidtrain.parallel.placement import init_weights
    from braidtrain.model.registry import model_config, pipeline_chunks
    from braidtrain.parallel import zb

    cfg = model_config("tiny", 256, n_layer=4)
    torch.manual_seed(0)
    for chunk in pipeline_chunks(cfg, pipeline.split(4, 2), 2, 1)[:1] + pipeline_chunks(cfg, pipeline.split(4, 4), 4, 2):
        chunk.to(device)
        init_weights(chunk, 3)
        x = torch.randn(2, 32, cfg.n_embd, device=device)
        y = torch.randint(0, 256, (2, 32), device=device)
        grads = []
        for split in (False, True):
            chunk.zero_grad(set_to_none=True)
            inp = x.clone().requires_grad_()
            with torch.autocast(device, torch.bfloat16, enabled=bf16):
                out = chunk(inp, y if chunk.last else None)
            g = torch.ones_like(out) if out.dim() else None
            if split:
                dinp, pending = zb.backward_input(out, g, inp)
                del out  # as the executor does before W: what W needs must hold the graph itself
                zb.backward_weight(pending)
            else:
                out.backward(g)
                dinp = inp.grad
            grads.append([dinp] + [p.grad for p in chunk.parameters()])
        assert all(a is not None and torch.equal(a, b) for a, b in zip(*grads)), (chunk.stage, bf16)


# -- the command line ------------------------------------------------------------------------------

PIPE_MODEL = [*SMALL, "--n-layer", "4", "--val-every", "2", "--val-steps", "1", "--sample-tokens", "8"]


def test_a_pipeline_run_validates_samples_saves_and_resumes_on_other_pp(tmp_path, shakespeare):
    """pp 2 x dp 2 (1F1B, ZeRO-1, exact): the single process's losses, validation losses and
    weights; its checkpoint resumed at pp 1 (one process) and at pp 4 (interleaved-free zb) ends
    with the uninterrupted run's weights."""
    common = [*PIPE_MODEL, "-i", shakespeare, "-d", 512, "-x", 4, "--ckpt-every", 2, "--exact"]
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    braidtrain("train", *common, "--out", one)
    p = braidtrain("train", *common, "--out", pipe, "--pp", 2, "-z", 1, nproc=4)
    assert "pp 2 (1f1b, blocks 0-" in p.stdout and "--- sample ---" in p.stdout
    assert [(r["loss"], r.get("val_loss")) for r in metrics(pipe)] == [(r["loss"], r.get("val_loss")) for r in metrics(one)]
    assert summary(pipe)["weights_sha256"] == summary(one)["weights_sha256"]
    assert all(len(r["bubble"]) == 2 for r in metrics(pipe))
    sched = json.loads((pipe / "schedule.json").read_text())
    assert sched["schedule"] == "1f1b" and len(sched["ranks"]) == 4
    for nproc, extra in ((1, []), (4, ["--pp", 4, "--pp-schedule", "zb"])):
        again = tmp_path / f"again{nproc}"
        shutil.copytree(pipe, again)
        shutil.rmtree(again / "checkpoints" / "step_00000004")
        (again / "summary.json").unlink()
        p = braidtrain("train", *common, "--out", again, "--resume", "auto", *extra, nproc=nproc)
        assert "step_00000002" in p.stdout and "pp 2 -> " in p.stdout, p.stdout
        assert summary(again)["weights_sha256"] == summary(one)["weights_sha256"]


def test_1f1b_matches_torch_pipelining(tmp_path, shakespeare):
    """braidtrain's 1F1B and torch.distributed.pipelining's Schedule1F1B (braidtrain.bench.torchref's
    pipe-1f1b: the same stages, split, initialisation, data and optimizer), 2 stages, 5 steps:
    the losses within 1e-5."""
    model = ["--model", "tiny", "--n-layer", "4", "--n-embd", "64", "--n-head", "2", "-t", "64", "-b", "2"]
    ours = tmp_path / "ours"
    braidtrain("train", *model, "-i", shakespeare, "-d", 1024, "-x", 5, "--pp", 2, "--val-every", 0,
               "--sample-tokens", 0, "--no-progress", "--out", ours, nproc=2)
    theirs = tmp_path / "torch.json"
    p = launch("-m", "braidtrain.bench.torchref", "--mode", "pipe-1f1b", *model, "-i", shakespeare, "-d", 1024, "--steps", 5,
               "--json", theirs, "--device", "cpu", nproc=2)
    assert p.returncode == 0, p.stderr[-4000:]
    want = json.loads(theirs.read_text())["loss"]
    got = [r["loss"] for r in metrics(ours)]
    assert len(got) == len(want) == 5 and want[-1] < want[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)
