"""The data-parallel engine in 2 and 4 real processes: overlap, ZeRO-1 state, global norm."""

import copy
import json
import math

import pytest
import torch

from helpers import ROOT, launch
from braidtrain.collective.comm import Comm
from braidtrain.collective.group import Group
from braidtrain.collective.mesh import build_mesh
from braidtrain.model.gpt2 import GPT
from braidtrain.parallel.placement import init_weights
from braidtrain.model.registry import model_config
from braidtrain.optim import AdamW
from braidtrain.parallel import buckets
from braidtrain.parallel.buckets import Q
from braidtrain.parallel.engine import Engine


def solo(axis, comm):
    """A group of this rank alone: its collectives are recorded, nothing is sent."""
    return Group(axis, (0,), 0, None, comm, axis)


def solo_engine(model, zero, exact=False):
    """The engine of one CPU process (no process group: every group is this rank alone)."""
    cpu, comm = torch.device("cpu"), Comm(torch.device("cpu"))
    return Engine(model, build_mesh(0, 1, comm), comm, zero=zero, exact=exact, bucket_mb=0.02, device=cpu)


@pytest.fixture
def as_if_sharded(monkeypatch):
    """ZeRO-2/3's hooks and buffers on one process: a reduce group of one rank would run ZeRO-0's
    (buckets.zero_stage)."""
    monkeypatch.setattr(buckets, "zero_stage", lambda zero, group: zero)


def run_worker(nproc, zero, out, *extra):
    p = launch(ROOT / "tests" / "engine_worker.py", zero, out, *extra, nproc=nproc, timeout=180)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module", params=[(2, 0), (2, 1), (4, 1), (2, 2), (4, 3)], ids=lambda p: f"n{p[0]}-zero{p[1]}")
def ranks(request, tmp_path_factory):
    nproc, zero = request.param
    return zero, run_worker(nproc, zero, tmp_path_factory.mktemp("engine"))


def test_reduction_overlaps_backward(ranks):
    zero, rows = ranks
    for r in rows:
        assert r["buckets"] >= 3
        if zero <= 1:
            assert r["records_after_first_micro"] == 0, "earlier micro-steps must not communicate"
        else:  # ZeRO-2/3 reduce-scatter every micro-step (and ZeRO-3 gathers parameters)
            assert r["records_after_first_micro"] >= r["buckets"]
        assert r["first_launch"] < r["last_grad"], "the first bucket must be launched before the backward ends"


def test_optimizer_state_is_one_shard(ranks):
    zero, rows = ranks
    for r in rows:
        share = math.ceil(r["P"] / r["n"])
        if zero >= 1:
            # ceil(P/N), plus the padding that makes each bucket split into Q-aligned shards
            assert share <= r["state"] <= share + Q * r["buckets"], r
        else:
            assert r["P"] <= r["state"] <= r["P"] + r["n"] * Q * r["buckets"], r


def test_model_state_bytes_follow_the_zero_accounting(ranks):
    """fp32 parameters and gradients held, per rank: ZeRO-0/1 4P + 4P, ZeRO-2 4P + 4P/N,
    ZeRO-3 4P/N + 4P/N (between steps nothing is gathered); within the bucket padding."""
    zero, rows = ranks
    for r in rows:
        P, n = r["P"], r["n"]
        want = {0: 8 * P, 1: 8 * P, 2: 4 * P + 4 * P / n, 3: 8 * P / n}[zero]
        assert want <= r["state_bytes"] <= want + 8 * n * Q * r["buckets"], (want, r)


def test_global_norm_counts_each_parameter_once(ranks):
    _, rows = ranks
    for r in rows:
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"], r


@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16-recompute"])
def test_zero3_gathers_again_only_what_the_backward_reads(tmp_path, mode):
    """ZeRO-3 releases a block's parameters after its forward. In fp32 the backward reads the
    weights themselves, so each released block is gathered again (all but the last, which is
    kept); under bf16 autocast it reads the bf16 copies the forward saved and copies of the
    LayerNorm weights, so nothing is gathered again -- unless the blocks are recomputed (and the
    checkpoint's own saved-tensor hooks must still work: without recomputation there would be no
    gather) -- but the first block, for the next micro-step's forward. The embedding group and the
    first block stay gathered from one micro-step into the next: the first micro-step's forward
    gathers every bucket, a later one all but those two. The gradient is the single process's."""
    micro = 2
    for r in run_worker(2, 3, tmp_path, mode):
        blocks = r["block_buckets"]
        assert r["gathers_in_backward"] == (micro - 1 if mode == "bf16" else micro * (blocks - 1)), r
        assert r["gathers_in_forward"] == [blocks + 1] + [blocks - 1] * (micro - 1), r
        assert abs(r["norm"] - r["ref_norm"]) <= 1e-5 * r["ref_norm"], r


@pytest.mark.usefixtures("as_if_sharded")
def test_zero3_forward_that_raises_leaves_no_saved_tensor_hook():
    """ZeRO-3 watches a block's forward with a saved-tensor hook; a forward that raises must not
    leave it on autograd's stack, where it would see every later autograd computation."""
    model = GPT(model_config("tiny", 256, n_layer=2, n_embd=64, n_head=2, block_size=32))
    init_weights(model, seed=7)
    engine = solo_engine(model, zero=3)
    x = torch.randint(0, 256, (1, 32))
    autocast = lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=False)
    boom = model.h[1].mlp.register_forward_pre_hook(lambda *_: 1 / 0)
    engine.begin_step(1)
    with pytest.raises(ZeroDivisionError), engine.forward(0), autocast():
        model(x, x)
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    boom.remove()
    engine.begin_step(1)  # and training goes on
    with engine.forward(0), autocast():
        loss = model(x, x)
    engine.backward(0, loss, last=True)
    engine.finish_step()
    assert torch.isfinite(engine.grad_norm()) and engine.grad_norm() > 0


@pytest.mark.usefixtures("as_if_sharded")
def test_zero3_release_of_a_gather_in_flight_leaves_no_stale_parameters():
    """A bucket released while its gather is still in flight must not come back, at the next
    gather, with what that earlier gather carried: the optimizer may have changed the shard since."""
    model = GPT(model_config("tiny", 256, n_layer=2, n_embd=64, n_head=2, block_size=32))
    engine = solo_engine(model, zero=3)
    b, zero = engine.buckets[0], engine.zero_hooks
    zero._gather(b, wait=False)  # a prefetch, not yet waited for
    zero._release(b)
    b.data.add_(1.0)  # an optimizer step
    zero._gather(b)
    assert torch.equal(b.full[b.lo : b.hi], b.data)
    zero._release(b)
    assert b.full.untyped_storage().nbytes() == 0


@pytest.mark.usefixtures("as_if_sharded")
@pytest.mark.parametrize("failed_before", [False, True], ids=["", "after-a-failed-step"])
@pytest.mark.parametrize("mode", ["plain", "exact", "recompute"])
@pytest.mark.parametrize("zero", [2, 3])
def test_zero2_3_gradients_accumulate_in_place_into_the_bucket(zero, mode, failed_before):
    """ZeRO-2/3 hold no gradient buffer between micro-steps, but within one a bucket's buffer is
    opened as the backward reaches it, so that autograd adds each parameter's gradient into it in
    place (no copy a parameter) -- also in exact mode (a buffer a micro-step, summed as a tree) and
    under --recompute (the blocks run forward again inside the backward); over two micro-steps the
    result is plain autograd's. Also after a step whose second backward (of three) raised part-way,
    leaving buffers open and, in exact mode, partial sums behind and a buffer already back in the
    pool: none of it may leak into the next step."""
    model = GPT(model_config("tiny", 256, n_layer=3, n_embd=64, n_head=2, block_size=32))
    init_weights(model, seed=7)
    ref = copy.deepcopy(model)
    model.recompute = mode == "recompute"
    in_place = []
    for p in model.parameters():  # runs before the engine's own hook, which lets go of p.grad
        p.register_post_accumulate_grad_hook(
            lambda p: in_place.append(p.grad.untyped_storage().data_ptr() == engine.bucket_of[p].grad.untyped_storage().data_ptr()))
    engine = solo_engine(model, zero, exact=mode == "exact")
    assert sum(1 for b in engine.buckets if b.modules) == 3
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2)]
    if failed_before:
        bad = torch.randint(0, 256, (2, 32), generator=gen)
        engine.begin_step(3)
        with engine.forward(0):
            loss = model(bad, bad)
        engine.backward(0, loss)

        def fail_in_backward(_mod, _args, out):
            out.register_hook(lambda _g: 1 / 0)

        hook = model.h[0].register_forward_hook(fail_in_backward)
        with engine.forward(1):
            loss = model(bad, bad)
        with pytest.raises(ZeroDivisionError):  # in block 0's backward: the others' are done
            engine.backward(1, loss)
        hook.remove()
        in_place.clear()
    engine.begin_step(len(xs))
    for micro, x in enumerate(xs):
        with engine.forward(micro):
            loss = model(x, x)
        engine.backward(micro, loss, last=micro == len(xs) - 1)
        ref(x, x).backward()
    engine.finish_step()
    assert len(in_place) == 2 * len(list(model.parameters())) and all(in_place)
    want = dict(ref.named_parameters())
    for b, _, g in engine.owned():
        for (name, _), (_, view) in zip(b.params, b.views(g)):
            torch.testing.assert_close(view, want[name].grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.usefixtures("as_if_sharded")
def test_zero2_gradient_into_an_unopened_bucket_is_an_error_not_a_loss():
    """ZeRO-2/3 drop autograd's .grad once it is in the bucket's buffer: a gradient that arrives
    before its buffer was opened (here: the block hooks skipped, as they are inside a backward)
    would be dropped unsummed. It is an error instead."""
    model = GPT(model_config("tiny", 256, n_layer=2, n_embd=64, n_head=2, block_size=32))
    engine = solo_engine(model, zero=2)
    x = torch.randint(0, 256, (1, 32))
    engine.begin_step(1)
    engine.backward_phase = True  # the forward hooks take this forward for a recomputation
    loss = model(x, x)
    with pytest.raises(RuntimeError, match="before its buffer was opened"):
        engine.backward(0, loss, last=True)


def test_one_rank_has_nothing_to_shard_so_every_stage_runs_zero0s():
    """On one rank every ZeRO stage runs ZeRO-0's mechanics: its buffers (no shard copies, no
    gathered buffer, no gradient scratch), its collectives, its optimizer state and -- in exact mode
    -- its bits; the stage asked for is still the run's. (Peak memory on a GPU: issue #25.)"""
    cfg = model_config("tiny", 256, n_layer=2, n_embd=64, n_head=2, block_size=32)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(4)]
    seen = {}
    for zero in (0, 1, 2, 3):
        for exact in (False, True):
            model = GPT(cfg)
            init_weights(model, seed=7)
            engine = solo_engine(model, zero, exact)
            opt = AdamW(engine)
            for step in range(2):
                engine.begin_step(2)
                for micro in range(2):
                    x = xs[2 * step + micro]
                    with engine.forward(micro):
                        loss = model(x, x)
                    engine.backward(micro, loss, last=micro == 1)
                engine.finish_step()
                opt.step(1e-2, grad_scale=engine.grad_norm().float())
                engine.gather_params()
            assert engine.zero == zero and engine.zero_hooks is None
            assert all(b.zero == 0 and b.full is b.data and b.shard_grad is None for b in engine.buckets)
            with engine.gathered():
                weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            seen[zero, exact] = ([r.op for r in engine.comm.records], engine.model_state_bytes(), opt.state_numel(),
                                 weights)
    for (zero, exact), (ops, state, optim, weights) in seen.items():
        want = seen[0, exact]
        assert ops == want[0] and state == want[1] and optim == want[2], (zero, exact)
        if exact:
            assert torch.equal(weights, want[3]), zero


class _Shards:
    """The optimizer's view of an engine: flat shards and where their 2-D weights lie."""

    def __init__(self, p, g, cuts, decay):
        self.device, self.exact = p.device, False
        self.parts = [(p[a:e], g[a:e], [(max(s, a) - a, min(t, e) - a) for s, t in decay if max(s, a) < min(t, e)])
                      for a, e in zip(cuts, cuts[1:])]

    def owned(self):
        return ((i, p, g) for i, (p, g, _) in enumerate(self.parts))

    def decay_segments(self, i):
        return self.parts[i][2]

    def publish(self, buckets):  # (the shards are the weights: no compute copy to write)
        pass


def test_adamw_bits_do_not_depend_on_shard_or_parameter_boundaries():
    """The same elements updated as one shard or as two 64-aligned shards, with 2-D weights at
    odd offsets: the same bits (torch's CPU kernel rounds a tensor's SIMD tail differently, so the
    optimizer must not cut its tensors at parameter boundaries)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as exact mode runs on the CPU
    n, decay = 640, [(0, 37), (101, 400), (413, 627)]
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    results = []
    for cuts in ([0, n], [0, 320, n], [0, 64, 448, n]):
        p, g = init.clone(), torch.zeros(n)
        opt = AdamW(_Shards(p, g, cuts, decay), weight_decay=0.1)
        for s, grad in enumerate(grads):
            g.copy_(grad)
            opt.step(1e-2, grad_scale=torch.tensor(1.7) if s == 1 else None)
        results.append((p, torch.cat([m for m, _, _ in opt.groups]), torch.cat([v for _, v, _ in opt.groups])))
    torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_timing_events_are_recorded_again_once_read_but_a_captured_graphs_never():
    """On CUDA a new pair of timing events cost the host ~33 us a collective and a reused pair ~7
    us: step_comm() hands each pair it has read back for a later collective -- except the pairs of
    collectives captured in a CUDA graph, which every replay of the graph records again."""
    from braidtrain.collective.flight import Handle

    class Event:  # what step_comm reads of a finished CUDA timing event pair
        def elapsed_time(self, _end):
            return 1.0

    comm = Comm(torch.device("cpu"))
    replica, world = solo("replica", comm), solo("world", comm)

    def collective(reuse):
        h = Handle(comm, comm._record("all_gather", replica, (8,), "float32", 32), None, events=(Event(), Event()))
        h.bus_bytes, h.reuse = 32, reuse
        return h

    captured = [collective(reuse=False)]
    for _ in range(3):
        eager = collective(reuse=True)
        comm.step_handles.append(eager)
        comm.replayed(captured, world)
        assert comm.step_comm() == (0.002, 64)
        assert comm.spare[-1] is eager.events and all(pair is not captured[0].events for pair in comm.spare)
    assert len(comm.spare) == 3


def test_collectives_never_ask_torch_for_the_group_size(monkeypatch):
    """cProfile charged torch's get_world_size 0.39 ms a call on the GPU machine: asked at every
    collective, ~80 ms of ZeRO-3's host time a step. A group.Group knows its size and this rank's
    index as plain numbers, from the mesh."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm, asked = Comm(torch.device("cpu")), []
        group = Group("replica", (0,), 0, dist.new_group([0]), comm, "replica")
        real = dist.get_world_size
        monkeypatch.setattr(dist, "get_world_size", lambda g=None: asked.append(g) or real(g))
        t = torch.ones(4)
        for _ in range(5):
            comm.all_reduce(t, group).wait()
            comm.all_gather(t, t, group).wait()
        assert t.tolist() == [1.0] * 4 and asked == []
    finally:
        dist.destroy_process_group()


def test_each_flight_record_names_its_group_and_its_number_in_it(tmp_path):
    """A record carries its group's name and the group's own count, next to this rank's count: the
    numbers doctor lines up, group by group. The flight log's header lists every group's members."""
    import json

    from braidtrain.collective.group import group_name

    comm = Comm(torch.device("cpu"))
    tp = Group("tp", (2, 3), 0, None, comm, group_name("tp", (2, 3), 8))
    world = Group("world", tuple(range(8)), 2, None, comm, group_name("world", range(8), 8))
    t = torch.ones(4)
    for _ in range(3):
        comm.all_reduce(t, tp, inline=True)
    comm.barrier(world)
    comm.all_gather(t, t, tp).wait()
    assert [(r.op, r.group, r.gseq, r.seq) for r in comm.records] == [
        ("all_reduce", "tp[2,3]", 0, 0), ("all_reduce", "tp[2,3]", 1, 1), ("all_reduce", "tp[2,3]", 2, 2),
        ("barrier", "world", 0, 3), ("all_gather", "tp[2,3]", 3, 4)]
    assert all(r.t_end is not None for r in comm.records)
    comm.dump(str(tmp_path / "log.jsonl"), {"rank": 2})
    head = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert head["groups"] == {"tp[2,3]": [2, 3], "world": list(range(8))}
    assert group_name("dp", range(0, 64, 8), 64) == "dp[0,8,16,24,32,40,48,56]"
    assert group_name("dp", range(0, 128, 8), 128) == "dp[0:121:8]"
