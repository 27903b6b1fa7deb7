"""Exact mode's one-pass kernels (braidtrain/parallel/exact_kernels.py) against their references, bit for bit:
the AdamW update against optim.exact_adamw, on random shards of odd lengths with and without
grad_scale and the skip flag, with the moments' edge cases (v = 0, subnormal v, huge and tiny g, a
non-finite gradient under skip); the gradient norm's chunk sums against parallel/norm.py's
chunk_squares (float64 pairwise trees over Q-element chunks), on gradients whose sums round
differently in any other order; and that the module imports and declines without triton.

The kernel runs on CPU through Triton's interpreter (NumPy's float32 operations, each correctly
rounded: this checks the kernel's operations and their order); TRITON_INTERPRET=1 must be set
before triton is first imported, and pytest shares one process between test files, so the checks
run in one subprocess -- this file as a script, printing its findings as JSON. On a machine with a
GPU the same comparison runs on CUDA tensors too, compiled: there it also checks what the
interpreter cannot -- no multiply-add contraction, correctly rounded division and square root
(benchmarks/kernels/exact_adamw_gpu.py runs it at 100M elements on the H200: docs/performance.md).
"""

import json
import os
import sys

import pytest
import torch

from helpers import ROOT, run_interpreted

LENGTHS = (1, 63, 1000, 4097, 300_001)
CHUNKS = (1, 31, 33, 200, 4099)  # the norm's chunks a gradient (programs take exact_kernels.CHUNKS each)


def shards(n: int, seed: int, device):
    """p, g, m, v of n elements: g and v over many binades (v down to the subnormals and 0)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 50 - 25)
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 10 ** (-torch.rand(n, generator=gen) * 46)  # to 1e-46: subnormal, 0
    v[::7], g[::11] = 0.0, 0.0
    return [t.to(device) for t in (p, g, m, v)]


def differences(device) -> dict:
    """name -> elements of p, m, v that differ between the kernel and exact_adamw."""
    from braidtrain import optim
    from braidtrain.parallel import exact_kernels

    out = {}
    c1 = torch.tensor(3e-4 / (1 - 0.9**7), device=device)
    c2 = torch.tensor(1 / (1 - 0.95**7) ** 0.5, device=device)
    cases = {"plain": (None, None), "scaled": (2.7, None), "scaled_kept": (0.31, 0.0), "skipped": (1.7, 1.0)}
    for k, n in enumerate(LENGTHS):
        for name, (scale, skip) in cases.items():
            ref = shards(n, k, device)
            if skip:  # the step a non-finite gradient skips
                ref[1][::5] = float("nan")
                ref[1][1::5] = float("inf")
            new = [t.clone() for t in ref]
            scale = None if scale is None else torch.tensor(scale, device=device)
            skip = None if skip is None else torch.tensor(skip, device=device)
            optim.exact_adamw(*ref, 0.9, 0.95, 1e-8, c1, c2, scale, skip)
            exact_kernels.exact_adamw(*new, 0.9, 0.95, 1e-8, c1, c2, scale, skip)
            out[f"{name}.{n}"] = sum(int((a.view(torch.int32) != b.view(torch.int32)).sum())
                                     for a, b in zip((ref[0], ref[2], ref[3]), (new[0], new[2], new[3])))
    return out


def gradients(chunks: int, seed: int, device):
    """Named flat fp32 gradients of `chunks` Q-element chunks: unit normals (every chunk's sum
    rounds, and another tree would round it otherwise), values over 80 binades (fp32's largest among
    them, whose squares swamp the rest of a chunk), tiny ones alone (below 1e-37, mostly fp32
    subnormals: a conversion that flushed them would change every chunk's sum), and inf / NaN / +-0
    sprinkled in."""
    from braidtrain.parallel.buckets import Q

    gen = torch.Generator().manual_seed(seed)
    n = chunks * Q
    unit = torch.randn(n, generator=gen)
    wide = unit * 10 ** (torch.rand(n, generator=gen) * 80 - 42)
    wide[::13], wide[1::17], wide[2::19] = 3.4e38, -1e-45, -0.0
    odd = unit.clone()
    odd[5::97], odd[7::131], odd[::3] = float("inf"), float("nan"), 0.0
    tiny = unit * 10 ** (torch.rand(n, generator=gen) * 8 - 45)
    return {k: t.to(device) for k, t in {"unit": unit, "wide": wide, "tiny": tiny, "nonfinite": odd}.items()}


def norm_differences(device) -> dict:
    """name -> chunk sums that differ between the kernel and norm.chunk_squares (NaN = NaN)."""
    from braidtrain.parallel import exact_kernels
    from braidtrain.parallel import norm
    from braidtrain.parallel.buckets import Q

    out = {}
    for k, chunks in enumerate(CHUNKS):
        for name, g in gradients(chunks, k, device).items():
            a, b = exact_kernels.chunk_squares(g, Q), norm.chunk_squares(g)
            same = (a.view(torch.int64) == b.view(torch.int64)) | (a.isnan() & b.isnan())
            out[f"norm.{name}.{chunks}"] = int((~same).sum()) + abs(a.numel() - chunks)
    return out


@pytest.fixture(scope="module")
def measured():
    return run_interpreted(__file__)


def test_bitwise_as_exact_adamw(measured):
    """Every case and length: no element of p, m or v differs from the reference's."""
    cases = {k: v for k, v in measured.items() if "." in k and not k.startswith("norm.")}
    assert len(cases) == 4 * len(LENGTHS), sorted(cases)
    assert not any(cases.values()), {k: v for k, v in cases.items() if v}


def test_norm_chunks_bitwise(measured):
    """Every gradient and length: each chunk's float64 sum the reference's bits."""
    cases = {k: v for k, v in measured.items() if k.startswith("norm.")}
    assert len(cases) == 4 * len(CHUNKS), sorted(cases)
    assert not any(cases.values()), {k: v for k, v in cases.items() if v}


def test_without_triton(measured):
    """Without triton the module imports and says it cannot run (optim keeps exact_adamw)."""
    assert measured["no_triton"] == "ImportError", measured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the compiled kernel)")
def test_bitwise_on_gpu():
    """The compiled kernels on CUDA tensors, bit for bit the references' torch kernels there."""
    found = {**differences("cuda"), **norm_differences("cuda")}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def _measure() -> dict:
    sys.modules["triton"] = None  # `import triton` raises ImportError: the CPU-only install
    from braidtrain.parallel import exact_kernels

    try:
        exact_kernels._load()
        out = {"no_triton": "loaded"}
    except ImportError:
        out = {"no_triton": "ImportError"}
    del sys.modules["triton"]
    return {**out, **differences("cpu"), **norm_differences("cpu")}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_exact_kernels.py with TRITON_INTERPRET=1"
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_measure()))
