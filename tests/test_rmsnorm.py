"""RMSNorm's operators (braidtrain/model/rmsnorm.py: `braidtrain::rmsnorm`, `braidtrain::add_rmsnorm`)
and their switch.

As tests/test_swiglu.py: the Triton kernels run on the CPU through Triton's interpreter, in one
subprocess -- this file as a script, printing its findings as JSON. There: both operators' forward
and backward (y, h, dx, dr, dw) against the torch reference (the path off CUDA) and against float64
autograd of the plain expression w * (x * rsqrt(mean(x^2) + eps)) (after h = x + r), in fp32, bf16
and the mixed dtypes a bf16 run gives them (an fp32 residual stream, a bf16 branch, fp32 weights,
the output in bf16), at widths that are not powers of two, several leading shapes, an all-zero row,
and the backward's programs each taking several rows (the last one part-full); torch.library.opcheck
of the four operators, through the kernels and through the reference; and llama3-tiny and
mixtral-tiny with the switch on against off (loss and every gradient, fp32; and under bf16 autocast,
where the dense blocks' norms write bf16 and a mixture's post-attention norm fp32), and a block
torch.compile'd against eager, through each path. Here: build.py turns the switch on only on CUDA,
outside --exact and --fp8. The one GPU-only test repeats the interpreter's comparison with compiled
kernels on CUDA tensors.
"""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import ROOT, interpreted_result, start_interpreted

SHAPES = (((5,), 7), ((2, 3), 1000), ((4, 1, 2), 300), ((3,), 2053), ((0, 2), 7), ((2,), 0))  # (leading, C)
f32, bf16 = torch.float32, torch.bfloat16
CASES = {"fp32": (f32, f32, f32, f32), "bf16": (bf16, bf16, bf16, bf16),  # x, r, w, y
         "mixed": (f32, bf16, f32, bf16)}  # a bf16 run's: fp32 stream and weight, bf16 branch and output
EPS = 1e-5
# fp32: a few roundings. bf16, mixed: the store's rounding to bf16 -- on a GPU to nearest (2^-8 of the
# value), in Triton 3.6's interpreter toward zero (under an ulp: 2^-7), which the CPU checks allow
TOL = {"fp32": 1e-5, "bf16": 2.0**-7 + 1e-5, "mixed": 2.0**-7 + 1e-5}
GPU_TOL = {"fp32": 1e-5, "bf16": 2.0**-8 + 1e-5, "mixed": 2.0**-8 + 1e-5}
PROGRAMS = 3  # the backward's programs at most, in the interpreter: 5 rows -> 2 a program, the last one part-full


def rel(a: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """Largest |a - ref| relative to |ref| element by element, with a floor of 1e-3 max |ref| (dx's
    cancellation near 0 is held to the tensor's scale); relative to `scale` instead where given: dw's,
    a sum over the rows whose terms may cancel, to the sum of their sizes (the bound of a float sum's
    error: a few roundings of that)."""
    if ref.numel() == 0:
        return 0.0 if a.shape == ref.shape else float("inf")
    a, ref = a.double(), ref.double()
    scale = ref.abs() if scale is None else scale.double()
    floor = 1e-3 * scale.max().item() + 1e-30
    return ((a - ref).abs() / (scale + floor)).max().item()


def dw_scale(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Per column, the sum over the rows of |dy x^| (float64)."""
    x, C = x.double(), x.shape[-1]
    xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return (dy.double() * xhat).abs().reshape(x.shape[:-1].numel(), C).sum(0)


def norm_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def compare(device) -> dict:
    """case -> relative error of each operator's outputs and gradients against the torch reference and
    against float64 autograd of the plain expression."""
    from braidtrain.model import rmsnorm as R

    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, (xt, rt, wt, yt) in CASES.items():
        for lead, C in SHAPES:
            case = f"{name}.{'x'.join(map(str, lead))}.{C}"
            x, r = torch.randn(*lead, C, generator=gen) * 3, torch.randn(*lead, C, generator=gen)
            if x.shape[:-1].numel() > 1 and C:  # an all-zero row (h's too)
                x.view(-1, C)[1], r.view(-1, C)[1] = 0, 0
            x, r = x.to(xt).to(device), r.to(rt).to(device)
            w = (1 + 0.5 * torch.randn(C, generator=gen)).to(wt).to(device)
            dy = torch.randn(*lead, C, generator=gen).to(yt).to(device)
            ht = torch.promote_types(xt, rt)
            dh = torch.randn(*lead, C, generator=gen).to(ht).to(device)

            # the plain operator
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = R.rmsnorm(xs, ws, EPS, yt)
            dx, dw = torch.autograd.grad(y, (xs, ws), dy)
            assert (y.dtype, dx.dtype, dw.dtype, y.shape) == (yt, xt, wt, x.shape), case
            x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
            y64 = plain(x64, w64)
            dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
            rdx, rdw = R.reference_backward(x, w, dy, EPS)
            out.update({f"ref.norm.y.{case}": rel(y, R.reference(x, w, EPS, yt)), f"ref.norm.dx.{case}": rel(dx, rdx),
                        f"ref.norm.dw.{case}": rel(dw, rdw, dw_scale(x, dy)), f"f64.norm.y.{case}": rel(y, y64),
                        f"f64.norm.dx.{case}": rel(dx, dx64), f"f64.norm.dw.{case}": rel(dw, dw64, dw_scale(x, dy))})

            # the residual add and the norm: the norm part held to h as the operator wrote it
            xs, rs, ws = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
            h, y = R.add_rmsnorm(xs, rs, ws, EPS, yt)
            dx, dr, dw = torch.autograd.grad((h, y), (xs, rs, ws), (dh, dy))
            assert (h.dtype, y.dtype, dx.dtype, dr.dtype, dw.dtype) == (ht, yt, xt, rt, wt), case
            assert dx.data_ptr() != dr.data_ptr() or dx.numel() == 0, case
            h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
            y64 = plain(h64, w64)
            dn64, dw64 = torch.autograd.grad(y64, (h64, w64), dy.double())
            rdx, rdr, rdw = R.add_reference_backward(h, w, dy, dh, EPS, xt, rt)
            out.update({f"ref.add.h.{case}": rel(h, x + r), f"ref.add.y.{case}": rel(y, R.reference(h, w, EPS, yt)),
                        f"ref.add.dx.{case}": rel(dx, rdx), f"ref.add.dr.{case}": rel(dr, rdr),
                        f"ref.add.dw.{case}": rel(dw, rdw, dw_scale(h, dy)),
                        f"f64.add.h.{case}": rel(h, x.double() + r.double()),
                        f"f64.add.y.{case}": rel(y, y64), f"f64.add.dx.{case}": rel(dx, dh.double() + dn64),
                        f"f64.add.dr.{case}": rel(dr, dh.double() + dn64),
                        f"f64.add.dw.{case}": rel(dw, dw64, dw_scale(h, dy))})
    return out


def opchecks() -> dict:
    """opcheck's verdict on each operator: "ok" or the first line of its complaint."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    for name, (xt, rt, wt, yt) in CASES.items():
        x = torch.randn(3, 2, 37, generator=gen).to(xt).requires_grad_()
        r = torch.randn(3, 2, 37, generator=gen).to(rt).requires_grad_()
        w = (1 + torch.randn(37, generator=gen)).to(wt).requires_grad_()
        dy = torch.randn(3, 2, 37, generator=gen).to(yt)
        ht = torch.promote_types(xt, rt)
        h, dh = torch.randn(3, 2, 37, generator=gen).to(ht), torch.randn(3, 2, 37, generator=gen).to(ht)
        for op, args in (("rmsnorm", (x, w, EPS, yt)), ("rmsnorm_backward", (x.detach(), w.detach(), dy, EPS)),
                         ("add_rmsnorm", (x, r, w, EPS, yt)),
                         ("add_rmsnorm_backward", (h, w.detach(), dy, dh, EPS, xt, rt))):
            try:
                torch.library.opcheck(getattr(torch.ops.braidtrain, op).default, args)
                out[f"opcheck.{op}.{name}"] = "ok"
            except Exception as e:  # noqa: BLE001  (reported, and the test names it)
                out[f"opcheck.{op}.{name}"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return out


def model_on_off() -> dict:
    """llama3-tiny's and mixtral-tiny's summed loss and every gradient with the switch on, against it
    off, in fp32 and under bf16 autocast; which operator the norms called, and the dtype asked for."""
    from braidtrain.model import llama, registry
    from braidtrain.parallel.placement import init_weights

    calls = []
    counted = llama.rmsnorm, llama.add_rmsnorm

    def counting(i, name):
        def op(*args):
            calls.append((name, str(args[-1]).removeprefix("torch.")))
            return counted[i](*args)
        return op

    llama.rmsnorm, llama.add_rmsnorm = counting(0, "norm"), counting(1, "add")
    out = {}
    for preset in ("llama3-tiny", "mixtral-tiny"):
        cfg = registry.model_config(preset, 300, n_layer=2)
        idx = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
        for cast in (False, True):
            runs, calls[:] = [], []
            key = f"model.{preset}.{'bf16' if cast else 'fp32'}"
            for on in (False, True):
                model = registry.build(cfg)
                init_weights(model, seed=4)
                for m in model.modules() if on else ():  # the norms' switches (not SwiGLU's: its own test)
                    if hasattr(type(m), "fused_norm"):
                        m.fused_norm = True
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                    loss = model(idx, idx.roll(-1, 1))
                loss.backward()
                runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
            (l0, g0), (l1, g1) = runs
            grads = max(norm_rel(g1[n], g0[n]) for n in g0 if n in g1)
            out.update({f"{key}.loss": norm_rel(l1, l0), f"{key}.grads": grads,
                        f"{key}.names": sorted(g0) == sorted(g1), f"{key}.calls": calls[:]})
    llama.rmsnorm, llama.add_rmsnorm = counted
    return out


def compiled_block() -> dict:
    """A llama3-tiny block with the norms' switches on, under bf16 autocast, torch.compile'd whole
    (fullgraph: the operators and the wrapper's autocast query trace without a break; aot_eager: no C++
    compiler) against the same block eager: its output and the gradient of its input."""
    from braidtrain.model import registry
    from braidtrain.parallel.placement import init_weights

    cfg = registry.model_config("llama3-tiny", 300, n_layer=1)
    model = registry.build(cfg)
    init_weights(model, seed=4)
    model.layers[0].fused_norm = True
    body, extra = model.layers[0].body, model.block_inputs(torch.arange(8))
    x = torch.randn(2, 8, cfg.n_embd, generator=torch.Generator().manual_seed(3), requires_grad=True)
    runs = []
    try:
        for fn in (body, torch.compile(body, backend="aot_eager", fullgraph=True)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fn(x, *extra)
            runs.append((out.detach(), torch.autograd.grad(out.sum(), x)[0]))
    except Exception as e:  # noqa: BLE001  (reported, and the test names it)
        return {"compiled.out": f"{type(e).__name__}: {str(e).splitlines()[0]}", "compiled.dx": None}
    finally:
        torch._dynamo.reset()
    (o0, g0), (o1, g1) = runs
    return {"compiled.out": norm_rel(o1, o0), "compiled.dx": norm_rel(g1, g0)}


@pytest.fixture(scope="module", autouse=True)
def started():
    """The interpreted checks, started before this file's first test (which runs meanwhile)."""
    p = start_interpreted(__file__)
    yield p
    if p is not None and p.poll() is None:
        p.kill()


@pytest.fixture(scope="module")
def measured(started):
    return interpreted_result(started)


def test_build_turns_it_on_only_on_cuda_outside_exact_and_fp8():
    """build.settle: a model set up for the CPU, for --exact or for --fp8 keeps layers.RMSNorm's
    computation (exact mode's bits stay); on CUDA otherwise every block's norms and the final norm
    run the operators. (settle only sets switches; the model stays on the CPU here.)"""
    from braidtrain import build
    from braidtrain.model import registry

    mcfg = registry.model_config("llama3-tiny", 300)
    cases = {("cpu", False, None): False, ("cuda", True, None): False, ("cuda", False, "tensorwise"): False,
             ("cuda", False, None): True}
    for (device, exact, fp8), on in cases.items():
        model = registry.build(mcfg)
        cfg = SimpleNamespace(recompute=False, exact=exact, compile=False, attention="sdpa")
        build.settle(model, cfg, SimpleNamespace(fp8=fp8), torch.device(device))
        switches = [m.fused_norm for m in model.modules() if hasattr(type(m), "fused_norm")]
        assert switches == [on] * (mcfg.n_layer + 1), (device, exact, fp8, switches)


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_operators_against_the_reference_and_float64_autograd(measured, path):
    """Forward and backward of both operators (y, h, dx, dr, dw), every case and shape: the kernels
    (interpreter) within a rounding of the torch reference and of float64 autograd; the reference too."""
    assert measured[f"{path}.kernels_ran"] == (path == "kernels")
    found = measured[path]
    assert len(found) == 16 * len(CASES) * len(SHAPES), sorted(found)
    bad = {k: v for k, v in found.items() if not v <= TOL[k.split(".")[3]]}
    assert not bad, bad


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_opcheck(measured, path):
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) of the four
    operators, in each case's dtypes."""
    found = {k: v for k, v in measured.items() if k.startswith(f"{path}.opcheck.")}
    assert len(found) == 4 * len(CASES) and all(v == "ok" for v in found.values()), found


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_a_model_with_the_switch_on_trains_as_with_it_off(measured, path):
    """llama3-tiny and mixtral-tiny, the norms' switches on against off: in fp32 the same loss and
    gradients (every parameter's) to fp32 rounding; under bf16 autocast too through the reference
    (its bf16 output rounded to nearest, as autocast's cast of layers.RMSNorm's fp32 output is), and
    to bf16's rounding through the interpreter (which rounds toward zero). A layer calls the plain
    operator (input_layernorm) and add_rmsnorm once, and the final norm the plain one: in bf16 where
    matmuls alone read the output, fp32 (x's and w's) where a mixture does."""
    for preset, mixture in (("llama3-tiny", False), ("mixtral-tiny", True)):
        bf16_tol = (2e-3, 3e-2) if path == "kernels" else (1e-6, 1e-5)
        for dt, tol in (("fp32", (1e-6, 1e-5)), ("bf16", bf16_tol)):
            m = {k.rsplit(".", 1)[1]: v for k, v in measured.items() if k.startswith(f"{path}.model.{preset}.{dt}.")}
            assert m["names"] and m["loss"] < tol[0] and m["grads"] < tol[1], (preset, dt, m)
            y = "bfloat16" if dt == "bf16" else "float32"
            layer = [["norm", y], ["add", "None" if mixture else y]]
            assert m["calls"] == layer * 2 + [["norm", y]], (preset, dt, m["calls"])


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_a_compiled_block_runs_the_operators(measured, path):
    """torch.compile of a block with the switch on (fullgraph, under bf16 autocast): the eager block's
    output and input gradient, to fp32 rounding."""
    out, dx = measured[f"{path}.compiled.out"], measured[f"{path}.compiled.dx"]
    assert isinstance(out, float) and out < 1e-6 and dx < 1e-6, (out, dx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the compiled kernels); the CPU runs them "
                    "through the interpreter: test_operators_against_the_reference_and_float64_autograd")
def test_compiled_kernels_on_gpu():
    found = compare("cuda")
    bad = {k: v for k, v in found.items() if not v <= GPU_TOL[k.split(".")[3]]}
    assert not bad, bad


def _measure() -> dict:
    from braidtrain.model import rmsnorm as R

    probe = torch.zeros(2)
    programs, R.PROGRAMS = R.PROGRAMS, PROGRAMS
    out = {"kernels.kernels_ran": R._kernels_run(probe, 2), "kernels": compare("cpu")}
    R.PROGRAMS = programs
    out.update({f"kernels.{k}": v for k, v in {**opchecks(), **model_on_off(), **compiled_block()}.items()})
    R._kernels_run = lambda t, C: False  # the same operators through the torch reference (their path off CUDA)
    out.update({"torch.kernels_ran": R._kernels_run(probe, 2), "torch": compare("cpu")})
    out.update({f"torch.{k}": v for k, v in {**opchecks(), **model_on_off(), **compiled_block()}.items()})
    return out


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_rmsnorm.py with TRITON_INTERPRET=1"
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    print(json.dumps(_measure()))
