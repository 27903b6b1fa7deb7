"""SwiGLU's operator (braidtrain/model/swiglu.py, `braidtrain::swiglu`) and its switch.

The Triton kernels run on the CPU through Triton's interpreter: TRITON_INTERPRET=1 must be set
before triton is first imported and pytest shares one process between files, so the checks that
need the operator run in one subprocess -- this file as a script, printing its findings as JSON
(tests/test_exact_kernels.py does the same). There: the kernels' forward and backward against the
torch reference (`reference`, `reference_backward`, the path off CUDA) and against float64 autograd
of the plain expression silu(gate) * up, in fp32 and bf16, at widths that are not multiples of the
kernels' block and several leading shapes; torch.library.opcheck of both operators, through the
kernels and through the reference; and a Llama with the switch on against one with it off (loss and
every gradient), through each path. Here: build.py turns the switch on only on CUDA, outside --exact
and --fp8. The one GPU-only test repeats the interpreter's comparison with compiled kernels on CUDA
tensors; the CPU runs the same comparison through the interpreter.
"""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import ROOT, interpreted_result, start_interpreted

SHAPES = (((5,), 5), ((2, 3), 1000), ((4, 1, 2), 1500), ((3,), 2053), ((0, 2), 7), ((2,), 0))  # (leading, F)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# fp32: a few roundings (and the cancellation in 1 + g (1 - s), under rel's floor). bf16: the rounding
# to bf16 of the store -- on a GPU to nearest (half an ulp: at most 2^-8 of the value), in Triton 3.6's
# interpreter toward zero (under an ulp: 2^-7), which the CPU checks allow
TOL = {"fp32": 1e-5, "bf16": 2.0**-7 + 1e-5}
GPU_TOL = {"fp32": 1e-5, "bf16": 2.0**-8 + 1e-5}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |a - ref| relative to |ref| element by element, with a floor of 1e-3 max |ref| (a value
    near 0 -- dgate where 1 + g (1 - sigmoid g) cancels -- is held to the tensor's scale)."""
    if ref.numel() == 0:
        return 0.0 if a.shape == ref.shape else float("inf")
    a, ref = a.double(), ref.double()
    floor = 1e-3 * ref.abs().max().item() + 1e-30
    return ((a - ref).abs() / (ref.abs() + floor)).max().item()


def norm_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def plain(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def compare(device) -> dict:
    """case -> relative error of the operator (forward h, backward d(gate_up)) against the torch
    reference and against float64 autograd of the plain expression."""
    from braidtrain.model import swiglu as S

    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        for lead, F in SHAPES:
            gu = (torch.randn(*lead, 2 * F, generator=gen) * 3).to(dtype).to(device)
            dh = torch.randn(*lead, F, generator=gen).to(dtype).to(device)
            x = gu.clone().requires_grad_()
            h = S.swiglu(x)
            (d,) = torch.autograd.grad(h, x, dh)
            g64 = gu.double().requires_grad_()
            h64 = plain(g64)
            (d64,) = torch.autograd.grad(h64, g64, dh.double())
            case = f"{name}.{'x'.join(map(str, lead))}.{F}"
            assert h.dtype == d.dtype == dtype and h.shape == (*lead, F) and d.shape == gu.shape, case
            out[f"ref.h.{case}"] = rel(h, S.reference(gu))
            out[f"ref.d.{case}"] = rel(d, S.reference_backward(gu, dh))
            out[f"f64.h.{case}"] = rel(h, h64)
            out[f"f64.d.{case}"] = rel(d, d64)
    return out


def opchecks() -> dict:
    """opcheck's verdict on each operator: "ok" or the first line of its complaint."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    for name, dtype in DTYPES.items():
        gu = torch.randn(3, 2, 2 * 37, generator=gen).to(dtype).requires_grad_()
        dh = torch.randn(3, 2, 37, generator=gen).to(dtype)
        for op, args in (("swiglu", (gu,)), ("swiglu_backward", (gu.detach(), dh))):
            try:
                torch.library.opcheck(getattr(torch.ops.braidtrain, op).default, args)
                out[f"opcheck.{op}.{name}"] = "ok"
            except Exception as e:  # noqa: BLE001  (reported, and the test names it)
                out[f"opcheck.{op}.{name}"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return out


def model_on_off() -> dict:
    """llama3-tiny's and mixtral-tiny's summed loss and every gradient with the switch on, against it
    off (fp32), and how many times the MLPs (the experts' grouped GEMM path) called the operator."""
    from braidtrain.model import llama, moe, registry
    from braidtrain.parallel.placement import init_weights

    calls = []
    counted = llama.swiglu

    def counting(x):
        calls.append(x.shape)
        return counted(x)

    llama.swiglu = moe.swiglu = counting
    out = {}
    for preset in ("llama3-tiny", "mixtral-tiny"):
        cfg = registry.model_config(preset, 300, n_layer=2)
        idx = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
        runs, calls[:] = [], []
        for on in (False, True):
            model = registry.build(cfg)
            init_weights(model, seed=4)
            for m in model.modules() if on else ():  # SwiGLU's switches (not the norms': test_rmsnorm's)
                if hasattr(type(m), "fused_swiglu"):
                    m.fused_swiglu = True
            loss = model(idx, idx.roll(-1, 1))
            loss.backward()
            runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (l0, g0), (l1, g1) = runs
        out.update({f"model.{preset}.loss": norm_rel(l1, l0), f"model.{preset}.grads": max(norm_rel(g1[n], g0[n]) for n in g0),
                    f"model.{preset}.names": sorted(g0) == sorted(g1), f"model.{preset}.calls": len(calls) - cfg.n_layer})
    llama.swiglu = moe.swiglu = counted
    return out


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
    """build.settle: a model set up for the CPU, for --exact or for --fp8 keeps the plain expression
    (exact mode's bits stay); on CUDA otherwise every MLP runs the operator. (settle only sets
    switches; the model stays on the CPU here.)"""
    from braidtrain import build
    from braidtrain.model import registry

    mcfg = registry.model_config("llama3-tiny", 300)
    cases = {("cpu", False, None): False, ("cuda", True, None): False, ("cuda", False, "tensorwise"): False,
             ("cuda", False, None): True}
    for (device, exact, fp8), on in cases.items():
        model = registry.build(mcfg)
        cfg = SimpleNamespace(recompute=False, exact=exact, compile=False, attention="sdpa")
        build.settle(model, cfg, SimpleNamespace(fp8=fp8), torch.device(device))
        switches = [m.fused_swiglu for m in model.modules() if hasattr(type(m), "fused_swiglu")]
        assert switches == [on] * mcfg.n_layer, (device, exact, fp8, switches)


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_operator_against_the_reference_and_float64_autograd(measured, path):
    """Forward and backward, fp32 and bf16, every shape: the kernels (interpreter) within a rounding
    or two of the torch reference and of float64 autograd of silu(gate) * up; the reference too."""
    assert measured[f"{path}.kernels_ran"] == (path == "kernels")
    found = measured[path]
    assert len(found) == 4 * len(DTYPES) * len(SHAPES), sorted(found)
    bad = {k: v for k, v in found.items() if not v <= TOL[k.split(".")[2]]}
    assert not bad, bad


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_opcheck(measured, path):
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) of both
    operators, fp32 and bf16."""
    found = {k: v for k, v in measured.items() if k.startswith(f"{path}.opcheck.")}
    assert len(found) == 2 * len(DTYPES) and all(v == "ok" for v in found.values()), found


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_a_model_with_the_switch_on_trains_as_with_it_off(measured, path):
    """llama3-tiny and mixtral-tiny in fp32: the same loss and gradients (every parameter's) to fp32
    rounding, the operator called once a layer (its MLP, or its experts' grouped GEMMs)."""
    for preset in ("llama3-tiny", "mixtral-tiny"):
        m = {k.rsplit(".", 1)[1]: v for k, v in measured.items() if k.startswith(f"{path}.model.{preset}.")}
        assert m["calls"] == 0 and m["names"], (preset, m)  # calls: the operator's, less one a layer
        assert m["loss"] < 1e-6 and m["grads"] < 1e-5, (preset, m)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the compiled kernels); the CPU runs them "
                    "through the interpreter: test_operator_against_the_reference_and_float64_autograd")
def test_compiled_kernels_on_gpu():
    found = compare("cuda")
    bad = {k: v for k, v in found.items() if not v <= GPU_TOL[k.split(".")[2]]}
    assert not bad, bad


def _measure() -> dict:
    from braidtrain.model import swiglu as S

    probe = torch.zeros(2)
    out = {"kernels.kernels_ran": S._kernels_run(probe), "kernels": compare("cpu")}
    out.update({f"kernels.{k}": v for k, v in {**opchecks(), **model_on_off()}.items()})
    S._kernels_run = lambda t: False  # the same operator through the torch reference (its path off CUDA)
    out.update({"torch.kernels_ran": S._kernels_run(probe), "torch": compare("cpu")})
    out.update({f"torch.{k}": v for k, v in {**opchecks(), **model_on_off()}.items()})
    return out


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_swiglu.py with TRITON_INTERPRET=1"
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    print(json.dumps(_measure()))
