"""A fresh gradient buffer's first gradients are written, not added to zeros (parallel/grads.py,
"Written, not added"): ZeRO-0/1's step buffer and a lean bucket's ZeRO-2/3 scratch, in default mode.
Against plain autograd's gradients summed in the engine's order, bitwise, at ZeRO 0-3, one and three
micro-steps, fp32 and bf16 (a lean state), with parameters no backward reaches, on one process and
on two ranks (tests/written_worker.py); and which gradients are written: each parameter's first of
the step (ZeRO-0/1) or of each backward (a lean ZeRO-2/3 bucket), never in exact mode (its pinned
bits: test_parity, test_tp, test_lean, test_fold)."""

import json

import pytest
import torch

from helpers import ROOT, launch
from written_worker import CASES, UNUSED, batch, case, unuse
from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.model.gpt2 import GPT
from braidtrain.model.registry import model_config
from braidtrain.parallel import buckets
from braidtrain.parallel.engine import Engine


@pytest.fixture
def as_if_sharded(monkeypatch):
    """ZeRO 1-3's mechanics (and so a lean state in bf16) on one process: a reduce group of one rank
    would run ZeRO-0's (buckets.zero_stage)."""
    monkeypatch.setattr(buckets, "zero_stage", lambda zero, group: zero)


@pytest.fixture
def nan_empty():
    """torch.empty fills with NaN (torch's deterministic mode): a position nobody writes shows."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.usefixtures("as_if_sharded", "nan_empty")
@pytest.mark.parametrize("zero,micro,mode", CASES, ids=[f"z{z}-m{m}-{mode}" for z, m, mode in CASES])
def test_one_process_bitwise_the_zero_then_add_sum(zero, micro, mode):
    comm = Comm(torch.device("cpu"))
    assert case(0, 1, build_mesh(0, 1, comm), comm, zero, micro, mode) == []


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("written")
    p = launch(ROOT / "tests" / "written_worker.py", out, nproc=2, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_bitwise_the_zero_then_add_sum(two_ranks):
    for rank in two_ranks:
        assert len(rank) == len(CASES)
        assert {name: bad for name, bad in rank.items() if bad} == {}


@pytest.mark.usefixtures("as_if_sharded")
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
@pytest.mark.parametrize("zero,mode", [(0, "fp32"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_which_gradients_are_written(zero, mode, exact):
    """Seen from a hook that runs before the engine's: is the gradient arriving to be written into
    its view? Default mode: at ZeRO-0/1 each parameter's first of the step, at ZeRO-2/3 a lean
    bucket's first of each backward (its scratch is fresh each time) and never an fp32 bucket's
    (autograd adds into the zeroed scratch in place); exact mode: never. The unused parameters'
    hooks never run. A written fp32 gradient is the tensor autograd made (no clone before the copy)."""
    cfg = model_config("tiny", 256, n_layer=2, n_embd=40, n_head=2, block_size=16)
    model = GPT(cfg)
    unuse(model)
    seen = []  # (micro, parameter name, to be written, .grad is the tensor autograd's backward made)
    names = {p: n for n, p in model.named_parameters()}
    made = {}  # parameter -> where autograd's gradient of it is (a tensor hook: before its accumulation)
    for p in model.parameters():  # runs before the engine's own hook, which writes or adds the gradient
        p.register_hook(lambda g, p=p: made.__setitem__(p, g.data_ptr()))
        p.register_post_accumulate_grad_hook(
            lambda p: seen.append((engine.micro, names[p], p in (engine.bucket_of[p].unwritten or {}),
                                   p.grad.data_ptr() == made[p])))
    comm = Comm(torch.device("cpu"))
    engine = Engine(model, build_mesh(0, 1, comm), comm, zero=zero, exact=exact, bucket_mb=0.005,
                    device=torch.device("cpu"), dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    autocast = torch.autocast("cpu", torch.bfloat16, cache_enabled=False, enabled=mode == "bf16")
    for _ in range(2):  # two steps: the second opens its buffers afresh again
        engine.begin_step(2)
        for m in range(2):
            x, y = batch(0, m)
            with engine.forward(m), autocast:
                loss = model(x, y)
            engine.backward(m, loss, last=m == 1)
        engine.finish_step()
        engine.gather_params()
    used = [n for n in names.values() if n not in UNUSED]
    assert sorted(n for _, n, _, _ in seen) == sorted(used * 4)
    for micro, name, written, own in seen:
        b = next(b for b in engine.buckets if name in dict(b.params))
        want = not exact and (micro == 0 if b.zero <= 1 else b.lean)
        assert written == want, (micro, name, b.zero, b.lean)
        # a written fp32 gradient is autograd's own tensor, handed over (not cloned): one copy into
        # the bucket; an added one was accumulated into the bucket's view in place
        assert own == (written or b.lean), (micro, name, b.zero, b.lean)
