"""Default mode's one-kernel update on a GPU (optim.AdamW.one_pass: exact_kernels.adamw -- the decay on
the 2-D weights' ranges, AdamW, and a lean bucket's bf16 compute weights, one pass a shard) against
the torch path it replaces on CUDA: `_foreach_mul_` decay, `torch._fused_adamw_`, publish()'s bf16
copy_. Several steps through AdamW.update on buckets of odd lengths whose decayed ranges fall off the
kernel's blocks, with grad_scale None and set, skip None, 0 and 1 (NaN and inf in that step's
gradient), lean buckets and an fp32 one (its own master).

Compared: within 1e-6 of the torch path (relative, to the size of the terms the last operation
added: a sum that cancels carries its operands' rounding) on p, m and v, and the bf16 weights equal
or 1 ulp apart -- the kernel rounds each operation once where torch's CPU kernel contracts into
multiply-adds and interpolates (lerp); and bit for bit against exact mode's torch path (the decay,
optim.exact_adamw, copy_): the kernel's operations are exact_adamw's, the bf16 rounding torch's --
which is why exact mode takes the kernel on a GPU too (its optimizer, run through it, bit for bit).

The kernel runs on CPU through Triton's interpreter (tests/test_exact_kernels.py says how and why in a
subprocess); there AdamW.one_pass is forced on for CPU tensors.
"""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import ROOT, run_interpreted

# (length, decayed ranges, lean): ends off the kernel's 1,024-element blocks, a range of one element
BUCKETS = ((4097, [(0, 1500), (1530, 4000)], True), (2050, [(7, 8), (9, 2049)], True), (1000, [(100, 900)], False))
STEPS = ((None, None), (2.7, None), (0.31, 0.0), (1.7, 1.0), (None, 1.0), (None, 0.0), (1.3, None))  # (scale, skip)


class Engine:
    """The optimizer's view of an engine: buckets with an fp32 master, bf16 compute weights where lean."""

    def __init__(self, exact: bool):
        self.device, self.exact, self.buckets = torch.device("cpu"), exact, []
        gen = torch.Generator().manual_seed(0)
        for n, decay, lean in BUCKETS:
            p = torch.randn(n, generator=gen)
            b = SimpleNamespace(master=p, grad=torch.zeros(n), decay=decay, apart=lean,
                                data=p.to(torch.bfloat16) if lean else p)
            b.compute_shard = lambda b=b: b.data
            self.buckets.append(b)

    def owned(self):
        return ((b, b.master, b.grad) for b in self.buckets)

    def decay_segments(self, b):
        return b.decay

    def publish(self, buckets):
        from braidtrain.parallel import master

        master.publish(buckets)


def states(engine, opt) -> list:
    """Copies of each bucket's (p, m, v, compute weights)."""
    return [[t.clone() for t in (b.master, m, v, b.data)] for b, (m, v, _) in zip(engine.buckets, opt.groups)]


def run() -> dict:
    """The steps on four engines in lockstep: default mode's torch path, exact mode's, the one kernel
    on its own (interpreted), and the one kernel started at each step from the torch path's state
    ("step": its one-step error, none carried over from a sum that cancelled steps before)."""
    from braidtrain import optim

    kinds = ("torch", "exact", "kernel", "step", "exact-kernel")
    engines = {kind: Engine(exact=kind.startswith("exact")) for kind in kinds}
    opts = {kind: optim.AdamW(e, weight_decay=0.1) for kind, e in engines.items()}
    for kind in ("kernel", "step", "exact-kernel"):  # on CPU tensors: the interpreter
        opts[kind].one_pass = lambda t: True
    gen, out = torch.Generator().manual_seed(1), {kind: [] for kind in engines}
    for k, (scale, skip) in enumerate(STEPS):
        grads = [torch.randn(n, generator=gen) * 10 ** (torch.rand(1, generator=gen) * 4 - 2) for n, _, _ in BUCKETS]
        if skip:
            for g in grads:
                g[::5], g[1::7] = float("nan"), float("inf")
        start = states(engines["torch"], opts["torch"])
        for kind, engine in engines.items():
            if kind == "step":
                for b, group, was in zip(engine.buckets, opts[kind].groups, start):
                    for t, x in zip((b.master, *group[:2], b.data), was):
                        t.copy_(x)
            for b, g in zip(engine.buckets, grads):
                b.grad.copy_(g)  # (torch's fused kernel writes g / grad_scale back)
            opts[kind].prepare(1e-2 / (k + 1))
            opts[kind].update(None if scale is None else torch.tensor(scale), None if skip is None else torch.tensor(skip))
            out[kind].append(states(engine, opts[kind]))
        out["start"] = out.get("start", []) + [start]
    return out


def compare(runs: dict) -> dict:
    """name -> what differs: the largest error of p, m, v relative to the size of the last
    operation's terms (the larger of the value before and after the step: m' = b1 m + (1 - b1) g
    cancels only where b1 |m| is about |g| / 10) and the bf16 weights' largest distance in ulps, of
    the one-step kernel from the torch path; elements of the kernel's run that differ from exact
    mode's bits at all."""
    found = {}
    kinds = ("step", "torch", "start", "kernel", "exact", "exact-kernel")
    for s, (mine, ref, start, alone, ex, exk) in enumerate(zip(*(runs[k] for k in kinds))):
        for i, (a, b, was, c, e, ek) in enumerate(zip(mine, ref, start, alone, ex, exk)):
            at = f"step{s}.bucket{i}"
            for name, x, y, w in zip("pmv", a, b, was):
                found[f"{at}.{name}.rel"] = float(((x - y).abs() / torch.maximum(y.abs(), w.abs())).nan_to_num(0.0).max())
            for name, x, z in zip(("p", "m", "v", "bf16"), c, e):
                found[f"{at}.{name}.bits"] = int((x.view(torch.int16) != z.view(torch.int16)).sum())
            for name, x, z in zip(("p", "m", "v", "bf16"), ek, e):  # exact mode's update on a GPU: this kernel
                found[f"{at}.{name}.exact-bits"] = int((x.view(torch.int16) != z.view(torch.int16)).sum())
            ulps = (a[3].float().view(torch.int32) >> 16) - (b[3].float().view(torch.int32) >> 16)
            found[f"{at}.bf16.ulps"] = int(ulps.abs().max())
    return found


@pytest.fixture(scope="module")
def measured():
    return run_interpreted(__file__)


def test_within_tolerance_of_torchs_fused_adamw(measured):
    """p, m, v within 1e-6 (relative) of the torch path at every step; bf16 weights at most 1 ulp apart."""
    rel = {k: v for k, v in measured.items() if k.endswith(".rel")}
    ulps = {k: v for k, v in measured.items() if k.endswith(".ulps")}
    assert len(rel) == 3 * len(STEPS) * len(BUCKETS) and len(ulps) == len(STEPS) * len(BUCKETS)
    assert max(rel.values()) <= 1e-6, {k: v for k, v in rel.items() if v > 1e-6}
    assert max(ulps.values()) <= 1, {k: v for k, v in ulps.items() if v > 1}
    assert measured["moved"] == [skip != 1.0 for _, skip in STEPS[1:]], measured["moved"]  # skipped: nothing


def test_bitwise_as_exact_modes_torch_path(measured):
    """The decay, exact_adamw's operations and torch's bf16 rounding: the same bits at every step
    (the kernel's own run, from the first step on)."""
    bits = {k: v for k, v in measured.items() if k.endswith(".bits")}
    assert len(bits) == 4 * len(STEPS) * len(BUCKETS)
    assert not any(bits.values()), {k: v for k, v in bits.items() if v}


def test_exact_mode_on_a_gpu_keeps_its_bits(measured):
    """Exact mode's optimizer takes the kernel on a GPU (AdamW.one_pass): every step's p, m, v and
    bf16 weights bit for bit those of its torch path (the host's update under --offload)."""
    bits = {k: v for k, v in measured.items() if k.endswith(".exact-bits")}
    assert len(bits) == 4 * len(STEPS) * len(BUCKETS)
    assert not any(bits.values()), {k: v for k, v in bits.items() if v}


def test_decay_table_gives_each_block_the_ranges_it_meets():
    """Per block, the ranges the table lists cover exactly the block's decayed elements: ranges
    inside one block, across several, ending or starting on a block's edge, none at all."""
    from braidtrain.parallel import exact_kernels

    B = exact_kernels.BLOCK
    cases = [(3 * B + 5, [(3, 9), (11, B), (B + 1, 3 * B)]), (2 * B, []), (5 * B + 64, [(B - 1, 4 * B + 7)]),
             (4097, [(0, 1500), (1530, 4000)]), (B, [(0, B)])]
    for n, decay in cases:
        bounds, ranges = (t.tolist() for t in exact_kernels.decay_table(decay, n, "cpu"))
        want = torch.zeros(n, dtype=torch.bool)
        for a, e in decay:
            want[a:e] = True
        got = torch.zeros(n, dtype=torch.bool)
        assert len(bounds) == 2 * -(-n // B)
        for k in range(len(bounds) // 2):
            for j in range(bounds[2 * k], bounds[2 * k + 1]):
                a, e = max(ranges[2 * j], k * B), min(ranges[2 * j + 1], (k + 1) * B, n)
                assert a < e or (ranges[2 * j], ranges[2 * j + 1]) == (n, n), (n, decay, k, j)  # it meets the block
                got[a:e] = True
        assert torch.equal(got, want), (n, decay)


def _measure() -> dict:
    runs = run()
    found = compare(runs)
    found["moved"] = [not all(torch.equal(x, y) for a, b in zip(now, before) for x, y in zip(a, b))
                      for now, before in zip(runs["kernel"][1:], runs["kernel"])]  # any p, m, v, bf16 weight
    return found

if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by tests/test_one_pass_adamw.py with TRITON_INTERPRET=1"
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_measure()))
