"""flash-attn-4's attention as braidtrain's operators (braidtrain/model/flash4.py) and its switch.

The package's kernels run on Hopper and Blackwell GPUs only. On the CPU its two functions are stood
in for by a plain attention written here (the forward with its log-sum-exp, the backward by the
textbook formulas, fp32 inside), in the package's layout (B, T, H, D), so that what braidtrain adds
is tested: the operators' layouts, grouped keys and values, the autograd registration (each
gradient to its input), the fake kernels that torch.compile traces, attend's switch and a Llama's
attention module through it, held to torch's SDPA; and build.settle's choice of kernel. The one
GPU-only test holds the package's own kernels to SDPA in fp32.
"""

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from braidtrain.model import flash4
from braidtrain.model.layers import attend


def _expand(t, H):  # (B, T, H_kv, D) -> (B, T, H, D): each key/value head serves H/H_kv query heads
    return t.repeat_interleave(H // t.shape[2], dim=2)


def _scores(q, k):
    """Scaled causal scores (B, H, T, T) in fp32, q and k (B, T, H, D) (k expanded)."""
    s = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) / q.shape[-1] ** 0.5
    T = s.shape[-1]
    return s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), float("-inf"))


def stand_in_forward(q, k, v, causal, return_lse, out, lse):
    """The package's forward, writing into the given out (B, T, H, D) and lse (B, H, T)."""
    assert causal and return_lse
    H = q.shape[2]
    s = _scores(q, _expand(k, H))
    lse.copy_(torch.logsumexp(s, dim=-1))
    out.copy_(torch.einsum("bhts,bshd->bthd", torch.exp(s - lse[..., None]), _expand(v, H).float()))
    return out, lse, None, None, None


def stand_in_backward(q, k, v, o, do, lse, causal, deterministic, dq, dk, dv):
    """dV = Pᵀ dO, dP = dO Vᵀ, dS = P (dP - rowsum(dO O)), dQ = dS K / √D, dK = dSᵀ Q / √D; the
    expanded heads' dK and dV summed back onto their key/value head. P from the forward's lse."""
    assert causal
    H, Hk, D = q.shape[2], k.shape[2], q.shape[3]
    ke, ve = _expand(k, H).float(), _expand(v, H).float()
    p = torch.exp(_scores(q, ke) - lse[..., None])
    dof = do.float()
    dp = torch.einsum("bthd,bshd->bhts", dof, ve)
    ds = p * (dp - torch.einsum("bthd,bthd->bht", dof, o.float())[..., None])

    def fold(t):
        return t.unflatten(2, (Hk, H // Hk)).sum(3)
    dq.copy_(torch.einsum("bhts,bshd->bthd", ds, ke) / D**0.5)
    dk.copy_(fold(torch.einsum("bhts,bthd->bshd", ds, q.float()) / D**0.5))
    dv.copy_(fold(torch.einsum("bhts,bthd->bshd", p, dof)))
    return dq, dk, dv


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(flash4, "_kernels", (stand_in_forward, stand_in_backward))


def _inputs(B=2, H=4, Hk=2, T=13, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g).to(torch.bfloat16).requires_grad_() for h in (H, Hk, Hk)]


def _rel(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def _against_sdpa(fn, q, k, v):
    """fn's output and q, k, v's gradients against fp32 SDPA's from the same bf16 inputs."""
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, torch.bfloat16)
    out = fn(q, k, v)
    got = [out, *torch.autograd.grad(out, (q, k, v), do)]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    want = [ref, *torch.autograd.grad(ref, (q32, k32, v32), do.float())]
    assert [t.shape for t in got] == [t.shape for t in want]
    return [_rel(a, b) for a, b in zip(got, want)]


def test_deterministic_reaches_the_backward(stand_in, monkeypatch):
    """attention(deterministic=...) is what the package's backward is asked for, both ways."""
    seen = []

    def backward(*args, deterministic, **kw):
        seen.append(deterministic)
        return stand_in_backward(*args, deterministic=deterministic, **kw)
    monkeypatch.setattr(flash4, "_kernels", (stand_in_forward, backward))
    q, k, v = _inputs()
    for det in (True, False):
        flash4.attention(q, k, v, det).sum().backward()
    assert seen == [True, False]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_attend_through_the_operators_is_sdpa(stand_in, heads):
    """attend(kernel="flash4"): the output and each of q's, k's and v's gradients within bf16's
    rounding of fp32 SDPA, with as many key/value heads as query heads, half and one."""
    q, k, v = _inputs(H=heads[0], Hk=heads[1])
    errs = _against_sdpa(lambda *t: attend(*t, kernel="flash4"), q, k, v)
    assert max(errs) < 2e-2, errs
    # the operators were called (not SDPA): a wrong stand-in shows
    with pytest.MonkeyPatch.context() as m:
        m.setattr(flash4, "_kernels", (lambda q, k, v, **kw: stand_in_forward(q, k, v * 0, **kw), None))
        assert attend(q, k, v, kernel="flash4").abs().max() == 0


def test_other_dtypes_take_sdpa(stand_in):
    """fp32 (a model without autocast) goes to SDPA: the package's kernels take bf16 and fp16 only."""
    q, k, v = (t.detach().float() for t in _inputs())
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(attend(q, k, v, kernel="flash4"), want)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        flash4.attention(q, k, v)


def test_opcheck_and_compiled(stand_in):
    """torch.library.opcheck of both operators (schema, fake kernels, autograd registration); and
    attend under torch.compile with fullgraph=True, forward and backward (no graph break: the
    operators are traced through their fake kernels), equal to the eager result."""
    q, k, v = _inputs()
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.braidtrain.flash4, (qt, kt, vt, False))
    o, lse = torch.ops.braidtrain.flash4(qt, kt, vt, False)
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.braidtrain.flash4_backward, (*(t.detach() for t in (qt, kt, vt, o, lse, do)), True))

    def fn(q, k, v):
        return attend(q, k, v, kernel="flash4")
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    eager, got = fn(q, k, v), compiled(q, k, v)
    assert torch.equal(got, eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (q, k, v), do.transpose(1, 2)),
                                                  torch.autograd.grad(eager, (q, k, v), do.transpose(1, 2))))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_llama_with_flash4_trains_as_with_sdpa(stand_in, monkeypatch, qk_norm):
    """llama3-tiny (4 query heads, 2 key/value heads) under bf16 autocast, and with Qwen3's q and k
    norms (whose fp32 outputs autocast casts for SDPA): the operators run in every block, and the
    loss and every parameter's gradient are within bf16 rounding of SDPA's."""
    from braidtrain.model import registry
    from braidtrain.parallel.placement import init_weights

    calls = []
    monkeypatch.setattr(flash4, "_kernels", (lambda *a, **kw: calls.append(1) or stand_in_forward(*a, **kw),
                                             stand_in_backward))
    mcfg = dataclasses.replace(registry.model_config("llama3-tiny", 300), qk_norm=qk_norm)
    x = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    results = {}
    for kernel in ("sdpa", "flash4"):
        model = registry.build(mcfg)
        init_weights(model, seed=0)
        model.use_attention(kernel)
        assert {b.attention().kernel for b in model.blocks()} == {kernel}
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(x, x.roll(-1, 1))
        loss.backward()
        results[kernel] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert len(calls) == mcfg.n_layer  # (the flash4 run's blocks, none of the SDPA run's)
    (la, ga), (lb, gb) = results["sdpa"], results["flash4"]
    assert abs(la - lb) < 1e-2 * abs(la), (la, lb)
    errs = {n: _rel(gb[n], ga[n]) for n in ga}
    assert max(errs.values()) < 5e-2, sorted(errs.items(), key=lambda e: -e[1])[:3]


def test_build_chooses_the_kernel(monkeypatch):
    """build.settle: exact mode on CUDA takes the deterministic kernels; elsewhere on CUDA flash4 where
    it is available (--attention auto or flash4), else SDPA, and SDPA for --attention sdpa; the CPU
    SDPA (flash4 is never available there). layout.check_attention refuses --attention flash4 where
    it is not available (test_inputs: the one-line error) or the head size is not one its kernels take,
    where auto takes SDPA."""
    from braidtrain import build, layout
    from braidtrain.errors import UserError
    from braidtrain.model import registry

    assert not flash4.available("cpu")
    tiny = registry.model_config("llama3-tiny", 300)  # head size 32; and 30, which the kernels do not take
    for mcfg, dtype, there in itertools.product((tiny, dataclasses.replace(tiny, n_embd=120)), ("auto", "fp32"),
                                                (True, False)):
        monkeypatch.setattr(flash4, "available",
                            lambda device, there=there: there and torch.device(device).type == "cuda")
        for device, exact, attention in itertools.product(("cpu", "cuda"), (False, True), ("auto", "sdpa", "flash4")):
            if attention == "flash4" and (exact or dtype == "fp32"):
                continue  # refused by config.validate (test_inputs)
            fits = mcfg.head_dim == 32
            if attention == "flash4" and not (there and device == "cuda" and fits):
                with pytest.raises(UserError, match="--attention flash4 needs the flash-attn-4 package" if not
                                   (there and device == "cuda") else "--attention flash4 takes a head size"):
                    layout.check_attention(attention, exact, device, mcfg.head_dim)
                continue
            layout.check_attention(attention, exact, device, mcfg.head_dim)
            want = ("exact" if exact and device == "cuda" else "flash4" if there and device == "cuda" and fits
                    and attention != "sdpa" and dtype == "auto" else "sdpa")
            model = registry.build(mcfg)
            cfg = SimpleNamespace(recompute=False, exact=exact, compile=False, attention=attention, dtype=dtype)
            build.settle(model, cfg, SimpleNamespace(fp8=None), torch.device(device))
            assert {b.attention().kernel for b in model.blocks()} == {want}, (there, device, exact, attention)


@pytest.mark.skipif(not flash4.available("cuda"), reason="needs flash-attn-4 on a Hopper or Blackwell GPU; the "
                    "CPU tests hold the operators' wiring to SDPA with a plain attention standing in")
def test_the_package_kernels_on_gpu():
    """The package's kernels through braidtrain's operators against fp32 SDPA, at Llama-3.2-1B's head
    shape (D 64, 4 query heads a key/value head) and D 128, T not a multiple of the tiles."""
    for H, Hk, T, D in ((32, 8, 2048, 64), (8, 8, 1000, 128)):
        q, k, v = (t.detach().cuda().requires_grad_() for t in _inputs(B=2, H=H, Hk=Hk, T=T, D=D))
        errs = _against_sdpa(lambda *t: attend(*t, kernel="flash4"), q, k, v)
        assert max(errs) < 2e-2, (H, Hk, T, D, errs)


def test_the_run_names_its_kernel():
    """What the run's first line and summary.json say: the blocks' kernel, "cp" under context
    parallelism (its ring attends), "-" for a part without blocks."""
    from braidtrain.model import registry
    from braidtrain.model.stage import attention_kernel

    model = registry.build(registry.model_config("llama3-tiny", 300))
    for kernel in ("sdpa", "flash4", "exact"):
        model.use_attention(kernel)
        assert attention_kernel([model], 1) == kernel
    assert attention_kernel([model], 2) == "cp"
