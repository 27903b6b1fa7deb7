"""A mixture of experts and expert parallelism. The router on its own against the formulas
(the balance loss, capacity in priority order); in one 8-rank process group
(tests/layouts_worker.py "ep"): one MoE layer's dispatch over ep 2 and 4 against a plain
reference written in the worker, then many layouts of one MoE GPT -- ep 1, 2, 4 with dp, ZeRO 0-3,
tp (and sp) and cp (pp: test_composition.py); 4 steps -- against the single process (within 1e-5) and, in exact
mode (3 steps), to the bit across ep, dp and ZeRO. Then the command line: an ep 2 run's metrics, its checkpoint
resumed at ep 1, the load plot; and bad input."""

import math
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from helpers import SMALL, assert_bitwise, assert_follows, braidtrain, metrics, summary
from test_cli import assert_one_line_error
from braidtrain.io.checkpoint import latest, load_model
from braidtrain.model.gpt2 import GPT
from braidtrain.parallel.placement import init_weights
from braidtrain.model.registry import model_config
from braidtrain.model import registry
from braidtrain.model.moe import capacity_of, move_bias, route


@pytest.fixture(scope="module")
def runs(layout_suites):
    return layout_suites["ep"]


def test_the_balance_loss_is_switchs_formula():
    """E * sum_i f_i P_i, f_i the share of the k N assignments to expert i, P_i its mean
    probability -- computed here from the softmax by hand; 1 for a router that splits evenly."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 6, generator=g)
    _, idx, _, aux, routed = route(logits, 2, 0.0)
    p = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    f = torch.tensor([(idx == i).sum().item() / 100 for i in range(6)])
    assert aux.item() == pytest.approx(6 * (f * p.mean(0)).sum().item(), rel=1e-6)
    assert routed.tolist() == [(idx == i).sum().item() for i in range(6)]
    _, _, _, even, _ = route(torch.zeros(12, 4), 1, 0.0)  # (ties: topk takes the first)
    assert even.item() == pytest.approx(1.0)


def test_capacity_keeps_first_choices_first_and_drops_the_rest():
    """ceil(C N k / E) a expert; every token's first choice in token order, then second choices."""
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 0.0, 4.0], [5.0, 4.0, 0.0], [0.0, 4.0, 5.0]])
    w, idx, keep, _, _ = route(logits, 2, 0.75)  # capacity ceil(0.75 * 4 * 2 / 3) = 2
    assert capacity_of(0.75, 4, 2, 3) == 2
    assert idx.tolist() == [[0, 1], [0, 2], [0, 1], [2, 1]]
    # first choices in token order: 0 and 1 fill expert 0, 2's is dropped, 3's takes expert 2; then
    # second choices: 0's and 2's take expert 1, 1's the second place of expert 2, 3's finds expert 1 full
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert torch.allclose(w.sum(-1), torch.ones(4))
    _, _, keep, _, _ = route(logits, 2, 0.0)
    assert keep.all()


def test_routers_and_bias_balancing_against_plain_formulas():
    """softmax-topk: softmax over the E logits, the top k renormalised (renorm off: as they are);
    topk-softmax: a softmax of the top k logits alone -- the same weights up to rounding; with a
    bias, the experts chosen by probability + bias, weighted by the probabilities; capacity's queue
    places counted one assignment at a time; DeepSeek-V3's bias step by its sign rule."""
    g = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(40, 8, generator=g), torch.randn(8, generator=g) * 0.1
    p = torch.softmax(logits.double(), -1)
    for kind in ("softmax-topk", "topk-softmax"):
        w, idx, _, _, _ = route(logits, 3, 0.0, router=kind)
        want = p.topk(3, -1)
        assert torch.equal(idx, want.indices)
        torch.testing.assert_close(w.double(), want.values / want.values.sum(-1, keepdim=True), atol=1e-6, rtol=0)
    w, idx, _, _, _ = route(logits, 3, 0.0, renorm=False)
    torch.testing.assert_close(w.double(), p.topk(3, -1).values, atol=1e-6, rtol=0)
    w, idx, _, _, routed = route(logits, 3, 0.0, bias=bias)
    chosen = (p + bias.double()).topk(3, -1).indices
    assert torch.equal(idx, chosen)
    torch.testing.assert_close(w.double(), p.gather(1, chosen) / p.gather(1, chosen).sum(-1, keepdim=True), atol=1e-6,
                               rtol=0)
    assert routed.tolist() == [(chosen == e).sum().item() for e in range(8)]
    _, idx, keep, _, _ = route(logits, 3, 0.5)
    cap, taken, want = capacity_of(0.5, 40, 3, 8), [0] * 8, torch.zeros(40, 3, dtype=torch.bool)
    for slot in range(3):  # priority order: every first choice in token order, then every second ...
        for t in range(40):
            e = int(idx[t, slot])
            want[t, slot], taken[e] = taken[e] < cap, taken[e] + (taken[e] < cap)
    assert torch.equal(keep, want) and not keep.all()
    table, loads = torch.zeros(2, 4), torch.tensor([[3.0, 1.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    move_bias(table, loads, 0.5)  # over the mean (2): down; under: up; at it, or no load: still
    assert table.tolist() == [[-0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_llama_experts_and_a_shared_one_against_a_plain_reference():
    """A Llama MoE layer (SwiGLU experts, one shared expert) in training, dropless and at capacity:
    its output and the input's, the router's, every expert's and the shared expert's gradients
    against the formulas computed token by token here (float64: the formulas to 1e-6); then in
    fp32 its grouped GEMM against its loop of experts."""
    cfg = model_config("mixtral-tiny", 256, n_layer=1, n_embd=32, n_head=4, n_kv_heads=2, moe_hidden=16,
                       moe_experts=4, moe_top_k=2, moe_shared=1, moe_aux=0.0)
    moe = registry.build(cfg).layers[0].mlp.train()
    torch.manual_seed(0)
    for prm in moe.parameters():
        torch.nn.init.normal_(prm, std=0.2)
    swiglu = lambda z, up, down: F.linear(F.silu(F.linear(z, up).chunk(2, -1)[0]) * F.linear(z, up).chunk(2, -1)[1], down)

    def grads(f, x, dy):  # f's output, and its gradients of x and of the layer's parameters
        x = x.clone().requires_grad_()
        moe.zero_grad()
        y = f(x)
        (y * dy).sum().backward()
        return [y.detach(), x.grad] + [q.grad for q in moe.parameters()]

    for capacity in (0.0, 0.75):
        moe.capacity = capacity
        m64 = moe.double()
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        dy = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        ours = [t.clone() for t in grads(m64, x, dy)]

        def reference(x):
            tokens = x.reshape(-1, 32)
            w, idx, keep, _, _ = route(tokens @ m64.router.weight.T, 2, capacity)
            rows = []
            for t in range(12):
                acc = swiglu(tokens[t], m64.shared.gate_up_proj.weight, m64.shared.down_proj.weight)
                for s in range(2):
                    if keep[t, s]:
                        e, ex = int(idx[t, s]), m64.experts
                        acc = acc + w[t, s] * swiglu(tokens[t], ex.gate_up_proj.weight[e], ex.down_proj.weight[e])
                rows.append(acc)
            return torch.stack(rows).view(2, 6, 32)

        for a, b in zip(ours, grads(reference, x, dy)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        moe.float()
        x32, dy32 = x.float(), dy.float()
        grouped = [t.clone() for t in grads(moe, x32, dy32)]
        moe.dispatch.grouped = False
        for a, b in zip(grouped, grads(moe, x32, dy32)):  # (the loop: one expert a call)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        moe.dispatch.grouped = True


def test_a_training_step_of_experts_does_not_wait_for_the_device():
    """Outside exact mode at ep 1, a mixture's forward and backward -- dropless and at capacity --
    use no tensor's value on the host (no .item, .tolist, nonzero, bool(t), sizes from values):
    each is a GPU's wait for the device inside a step, and a graph break under --compile. The guard
    refuses them; on the exact path (nonzero) it catches one."""
    from torch.overrides import TorchFunctionMode

    class NoSync(TorchFunctionMode):
        banned = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.__bool__,
                  torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.cpu, torch.unique,
                  torch.bincount, torch.Tensor.unique}

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in self.banned or (func is torch.repeat_interleave and "output_size" not in kwargs):
                raise AssertionError(f"{func.__name__} waits for the device")
            return func(*args, **kwargs)

    cfg = model_config("mixtral-tiny", 256, n_layer=1, n_embd=32, n_head=4, n_kv_heads=2, moe_hidden=16)
    moe = registry.build(cfg).layers[0].mlp.train()
    moe.loss_scale = 1.0
    x = torch.randn(2, 8, 32, requires_grad=True)
    for capacity in (0.0, 1.0):
        moe.capacity = capacity
        with NoSync():
            moe(x).sum().backward()
    moe.dispatch.exact = True  # (exact mode sorts out only the kept assignments: a wait it may take)
    with pytest.raises(AssertionError, match="waits for the device"), NoSync():
        moe(x).sum().backward()


def test_a_compiled_mixture_is_one_graph_and_matches_eager():
    """--compile with experts: a Mixtral layer (with a shared expert) under bf16 autocast, as on the
    GPU, at capacity and dropless, compiles whole (fullgraph: no graph break, so no wait for the
    device) and gives eager's output, gradients and step figures (to bf16's precision)."""
    cfg = model_config("mixtral-tiny", 256, n_layer=1, n_embd=32, n_head=4, n_kv_heads=2, moe_hidden=16, moe_shared=1)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    for capacity in (1.0, 0.0):
        got = []
        for compiled in (False, True):
            torch.manual_seed(0)
            moe = registry.build(replace(cfg, moe_capacity=capacity)).layers[0].mlp.train()
            moe.loss_scale = 1.0
            xi = x.clone().requires_grad_()
            run = torch.compile(moe, fullgraph=True, dynamic=False) if compiled else moe
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = run(xi)
            (y.float() * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
            got.append([y, xi.grad, moe.last] + [p.grad for p in moe.parameters()])
        assert len(got[0]) == len(got[1]) > 5
        for a, b in zip(*got):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        assert (got[1][2][3] > 0) == (capacity > 0)  # (the step's dropped assignments)


def test_capacity_is_a_training_setting_evaluation_routes_dropless():
    """With a capacity that drops, a training forward's routing group is its whole batch; outside
    training (validation, multiple-choice evaluation, sampling) every token takes its k experts,
    so a sequence's logits are the same alone or beside others, and the dropless model's."""
    def model(capacity):
        m = GPT(model_config("tiny", 256, n_layer=2, moe_experts=4, moe_top_k=2, moe_capacity=capacity))
        init_weights(m, 0)
        return m

    tight, free = model(0.5), model(0.0)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    tight.train()
    with torch.no_grad():  # a training forward drops: its logits are not the dropless model's
        assert not torch.allclose(tight(x), free(x), atol=1e-4)
    tight.eval()
    with torch.no_grad():
        batch, alone, ref = tight(x), tight(x[:1]), free.eval()(x)
    assert torch.allclose(batch, ref, atol=1e-6, rtol=0)
    assert torch.allclose(batch[:1], alone, atol=1e-6, rtol=0)


def test_the_dispatch_matches_a_plain_reference(runs):
    for ep in (2, 4):
        for capacity in (1.0, 0.0):
            r = runs[f"dispatch-ep{ep}-capacity{capacity}"]
            assert r["err"] <= 1e-6 and r["dropped_ok"], (ep, capacity, r)
            assert (r["dropped"] > 0) == (capacity > 0), r


def test_every_layout_matches_the_single_process(runs):
    """(cp and sp dropless without the balance loss: their routing groups are a rank's share.)"""
    groups = {"ref": [k for k in runs if k.startswith(("dp", "tp", "pp")) and k.endswith(("z1", "z2", "z3", "ep1", "ep2"))],
              "ref-free": ["cp2-ep2-free", "tp2-sp-dp2-ep2-free"]}
    assert len(groups["ref"]) == 5, groups
    for ref, names in groups.items():
        assert_follows(runs, names, runs[ref], 1e-5)


def test_exact_mode_is_bitwise_across_ep_dp_and_zero(runs):
    exact = [k for k in runs if k.endswith("-exact") and k != "ref-exact" and not k.startswith("mix")]
    assert len(exact) == 6
    assert_bitwise(runs, exact, runs["ref-exact"])


def test_mixtral_on_every_axis(runs):
    """Mixtral's shape (SwiGLU experts, GQA, RoPE; capacity 1.0 and the balance loss) with ep 2 beside
    pp 2 and beside tp 2, against the single process; DeepSeek-V3's bias balancing with a shared
    expert at tp 2 x ep 2: the same losses and, every step, the same biases; exact mode bitwise
    across ep 1, 2, 4 at dp 4 and ZeRO 0 and 3."""
    assert_follows(runs, ["mix-dp2-ep2-pp2", "mix-tp2-dp2-ep2"], runs["mix-ref"], 1e-5)
    assert_follows(runs, ["mix-bias-dp2-ep2-tp2"], runs["mix-bias-ref"], 1e-5)
    bias = runs["mix-bias-ref"]["balance"]
    assert runs["mix-bias-dp2-ep2-tp2"]["balance"] == bias and any(b != 0 for row in bias for b in row)
    assert all(b == 0 for row in runs["mix-ref"]["balance"] for b in row)  # (the loss balances it, not the bias)
    exact = [k for k in runs if k.startswith("mix-dp4") and k.endswith("-exact")]
    assert len(exact) == 5
    assert_bitwise(runs, exact, runs["mix-ref-exact"])


MOE = [*SMALL, "--moe-experts", "4", "--moe-top-k", "2", "--moe-hidden", "64", "-d", "256"]


def test_an_ep_run_logs_its_experts_and_resumes_at_ep_1(tmp_path, shakespeare):
    """Exact mode, ep 2 on 2 ranks: the single process's losses and figures to the bit; moe_aux,
    moe_dropped and the load in metrics.jsonl; its checkpoint resumed on one process trains on
    to the single process's weights; plot --experts draws the load."""
    one, two = tmp_path / "one", tmp_path / "two"
    flags = [*MOE, "-i", shakespeare, "--moe-capacity", "1.0", "--ckpt-every", 2, "--exact"]
    braidtrain("train", *flags, "-x", 2, "--out", one)
    p = braidtrain("train", *flags, "-x", 2, "--out", two, "--ep", 2, nproc=2)
    assert "dp 2 x ep 2" in p.stdout, p.stdout
    a, b = metrics(one)[-2], metrics(two)[-2]
    for key in ("loss", "grad_norm", "moe_aux", "moe_dropped", "moe_load"):
        assert b[key] == a[key], key
    assert 0 < b["moe_dropped"] < 1 and b["moe_aux"] >= 1 - 1e-6 and len(b["moe_load"]) == 4
    assert math.isclose(sum(b["moe_load"]), 1, rel_tol=1e-6) and b["moe_load_max"] >= 1
    p = braidtrain("train", *flags, "-x", 4, "--out", two, "--resume", "auto")
    assert "ep 2 -> 1" in p.stdout, p.stdout
    braidtrain("train", *flags, "-x", 4, "--out", one, "--resume", "auto")
    after = lambda run: [r for r in metrics(run) if r.get("step", 0) > 2 and "grad_norm" in r]
    assert [r["step"] for r in after(two)] == [3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in after(one)] == [(r["loss"], r["grad_norm"]) for r in after(two)]
    assert summary(two)["weights_sha256"] == summary(one)["weights_sha256"]
    braidtrain("plot", "--experts", two, "--out", tmp_path / "load.png")
    assert (tmp_path / "load.png").stat().st_size > 10_000
    p = braidtrain("export", one, "--format", "hf", "--out", tmp_path / "hf", check=False)
    assert_one_line_error(p, "GPT-2 mixture of experts has no HuggingFace architecture", "Mixtral")


def test_a_mixtral_preset_trains_as_its_preset_and_exports_to_transformers(tmp_path, shakespeare):
    """--model mixtral-tiny with no --moe-* flag is the preset's mixture (4 experts, top 2: its
    figures in metrics.jsonl), and `export --format hf` writes a folder transformers loads as
    MixtralForCausalLM with the run's weights."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: `make test` installs it")
    run, hf = tmp_path / "mix", tmp_path / "hf"
    braidtrain("train", "--model", "mixtral-tiny", "--n-layer", "2", "--n-embd", "64", "-t", "64", "-b", "2", "-x", 2,
               "--val-every", "0", "--sample-tokens", "0", "--no-progress", "-i", shakespeare, "--out", run)
    assert len(metrics(run)[-1]["moe_load"]) == 4
    braidtrain("export", run, "--format", "hf", "--out", hf)
    model = transformers.MixtralForCausalLM.from_pretrained(str(hf))
    assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2
    ours, _ = load_model(latest(run))
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x)[..., :256], model.eval()(x).logits, atol=1e-4, rtol=0)


BAD = [  # (flags, words the one line must hold)
    (["--moe-top-k", "5"], ["--moe-top-k 5", "between 1 and --moe-experts 4"]),
    (["--moe-top-k", "0"], ["--moe-top-k 0"]),
    (["--moe-capacity", "-1"], ["--moe-capacity -1", "0 for dropless"]),
    (["--moe-every", "3"], ["--moe-every 3", "n_layer = 2"]),
    (["--ep", "3"], ["--ep 3", "--moe-experts 4", "{1,2,4}"]),
    (["--ep", "2"], ["--ep 2", "dp*cp = 1*1 = 1"]),
    (["--compile", "--exact"], ["--compile", "mixture of experts", "--ep 1 without --exact"]),
    (["--moe-router", "top1"], ["--moe-router", "softmax-topk"]),
    (["--moe-shared", "1"], ["--moe-shared", "not a setting of the gpt2 family"]),
]


@pytest.fixture(scope="module")
def refused(shakespeare):
    """Every BAD run at once, two at a time (each a process that fails before training)."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda c: braidtrain("train", *MOE, "-i", shakespeare, "-x", 1, *c[0], check=False), BAD))


@pytest.mark.parametrize("case", range(len(BAD)), ids=["top-k-above-E", "top-k-zero", "capacity-negative",
                                                       "every-above-n-layer", "ep-not-dividing-E", "ep-not-dividing-dp",
                                                       "compile-exact", "router", "shared-on-gpt2"])
def test_bad_moe_input_is_one_line(refused, case):
    assert_one_line_error(refused[case], *BAD[case][1])


def test_a_checkpoint_of_the_other_kind_is_refused_in_one_line(tmp_path, shakespeare):
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    kinds = ((MOE, moe), ([*SMALL, "-d", 256], dense))
    with ThreadPoolExecutor(2) as pool:  # two runs at a time: each mostly imports
        list(pool.map(lambda k: braidtrain("train", *k[0], "-i", shakespeare, "-x", 1, "--out", k[1]), kinds))
        into = [(kinds[1][0], moe), (kinds[0][0], dense)]  # each kind resumed from the other's checkpoint
        moe_into_dense, dense_into_moe = pool.map(
            lambda k: braidtrain("train", *k[0], "-i", shakespeare, "-x", 2, "--out", k[1], "--resume", "auto",
                                 check=False), into)
    assert_one_line_error(moe_into_dense, "holds an MoE model", "builds a dense one", "--moe-experts 4")
    assert_one_line_error(dense_into_moe, "holds a dense model", "builds an MoE one", "--moe-experts 0")
    assert_one_line_error(braidtrain("export", moe, "--out", tmp_path / "hf", check=False), "mixture of experts")


def test_validation_forwards_do_not_count_in_the_step_metrics(tmp_path, shakespeare):
    """moe_aux and the load are the training forwards': a run that validates every step logs the
    same figures as one that does not."""
    runs = [tmp_path / "quiet", tmp_path / "validating"]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: braidtrain("train", *MOE, "-i", shakespeare, "-x", 2, "--val-every", r[1],
                                           "--moe-capacity", "1.0", "--out", r[0]), zip(runs, (0, 1))))
    a, b = ([{k: r[k] for k in ("loss", "moe_aux", "moe_dropped", "moe_load")} for r in metrics(run) if "moe_aux" in r]
            for run in runs)
    assert a == b and len(a) == 2


def test_the_grouped_gemm_is_taken_only_where_it_runs():
    """(In bf16: with rows, whole 16-byte rows of both widths, outside exact mode -- a grouped GEMM
    of no rows, or of an odd width, raises on the H200; in fp32 on the CPU, eager only; the loop
    otherwise.)"""
    from types import SimpleNamespace

    from braidtrain.model.moe import Dispatch

    rows = lambda n, c=64: SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(n, c))
    d, moe = Dispatch(), SimpleNamespace(width=128)
    assert d._grouped(rows(5), moe) == hasattr(torch, "_grouped_mm")
    assert not d._grouped(rows(0), moe) and not d._grouped(rows(5, 100), moe)
    assert not d._grouped(rows(5), SimpleNamespace(width=100))
    assert d._grouped(SimpleNamespace(is_cuda=False, dtype=torch.bfloat16, shape=(5, 64)), moe)
    cpu32 = SimpleNamespace(is_cuda=False, dtype=torch.float32, shape=(5, 64))
    assert d._grouped(cpu32, moe) and not d._grouped(SimpleNamespace(is_cuda=True, dtype=torch.float32, shape=(5, 64)), moe)
    assert not torch.compile(lambda: d._grouped(cpu32, moe), fullgraph=True)()
    d.exact = True
    assert not d._grouped(rows(5), moe)


def test_the_planner_counts_each_familys_experts():
    """An MoE layer's bytes beyond the dense MLP (model/counts.py), from the experts themselves: per
    routed row, in bf16, GPT-2's expert keeps its input, hidden and GELU (C + 2H) and SwiGLU's its
    input, gate-and-up, SiLU and product (C + 4H), each plus the output row the routing weights
    multiply; per token, the router's fp32 probabilities less the dense MLP's input and hidden
    (GPT-2: C + 2 * 4C; Llama: C + 4 * its width, split over tp)."""
    from braidtrain.model.counts import moe_activations

    gpt = model_config("tiny", 256, moe_experts=4, moe_top_k=2, moe_every=1, moe_hidden=96)
    C, H, E = gpt.n_embd, 96, 4
    assert moe_activations(gpt, 1, False, True) == (2 * (C + 2 * H) + 2 * C, 4 * E - 2 * (C + 8 * C))
    mix = model_config("mixtral-tiny", 256, moe_shared=1)
    C, H, F_, E = mix.n_embd, mix.moe_width, mix.mlp_width, mix.moe_experts
    shared = 2 * (C + 4 * H)
    assert moe_activations(mix, 1, False, True) == (2 * (C + 4 * H) + 2 * C, 4 * E + shared - 2 * (C + 4 * F_))
    assert moe_activations(mix, 2, False, True)[1] == 4 * E + 2 * (C + 4 * H / 2) - 2 * (C + 4 * F_ / 2)
    assert moe_activations(mix, 1, False, False)[0] == 2 * moe_activations(mix, 1, False, True)[0]  # fp32 on the CPU
