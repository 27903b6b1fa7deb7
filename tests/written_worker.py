"""A lean bucket's (and ZeRO-0/1's step buffer's) first gradient of a step is written, not added
(parallel/grads.py): run by test_written.py in its own process, and as 2 ranks under torchrun
(`python tests/written_worker.py OUT`: every case, OUT/rank<r>.json).

A case: a GPT of odd widths (gaps between the parameters in each bucket) with parameters no
backward reaches (unuse(): their hooks never run), trained two steps of `micro` micro-steps
by the engine at ZeRO `zero`, in fp32 or under CPU bf16 autocast (a lean state where the stage
shards). Uninitialised memory is NaN (torch's deterministic mode fills torch.empty), so a position
nobody wrote shows. Each step, the gradient the optimizer reads -- every owned position, gaps and
padding included -- must be bitwise the reference's: plain autograd's per micro-batch gradients of
the same weights (fp32 copies of the compute weights: autocast rounds them to the same bf16), summed
in fp32 in the order the engine's zero-then-add path sums them (a rank's micro-steps, then the ranks
at ZeRO-0/1; the ranks, then the micro-steps at ZeRO-2/3), zeros where no parameter is or no
gradient came. The optimizer, the norm and the gathers downstream are the same code either way."""

import copy
import json
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.model.gpt2 import GPT
from braidtrain.model.registry import model_config
from braidtrain.optim import AdamW
from braidtrain.parallel.engine import Engine
from braidtrain.parallel.placement import init_weights

CASES = [(zero, micro, mode) for zero in range(4) for micro in (1, 3) for mode in ("fp32", "bf16")]
UNUSED = ("h.1.ln_2.bias", "h.1.attn.c_proj.weight", "h.1.attn.c_proj.bias")


def batch(step, seq, vocab=256, t=16):
    g = torch.Generator().manual_seed(1000 * step + seq)
    x = torch.randint(0, vocab, (2, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def unuse(model):
    """Parameters no backward reaches (UNUSED): block 1's ln_2 without its bias (an fp32 bucket's),
    its attention's output projection skipped (a matrix: a lean bucket's in bf16)."""
    ln = model.h[1].ln_2
    ln.forward = lambda x: F.layer_norm(x, ln.normalized_shape, ln.weight, None, ln.eps)
    model.h[1].attn.c_proj.forward = lambda y: y


def case(rank, world, mesh, comm, zero, micro, mode, steps=2) -> list[str]:
    """The mismatches of one case (empty: bitwise the reference at every step)."""
    torch.manual_seed(0)
    cfg = model_config("tiny", 256, n_layer=3, n_embd=40, n_head=2, block_size=16)
    model = GPT(cfg)
    init_weights(model, seed=7)
    ref = copy.deepcopy(model)
    unuse(model), unuse(ref)
    bf16 = mode == "bf16"
    engine = Engine(model, mesh, comm, zero=zero, exact=False, bucket_mb=0.005, device=torch.device("cpu"),
                    dtype=torch.bfloat16 if bf16 else torch.float32)
    opt = AdamW(engine)
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=False)) if bf16 else nullcontext
    seqs, bad = world * micro, []
    named = dict(ref.named_parameters())
    for step in range(steps):
        with engine.gathered(), torch.no_grad():  # the reference computes with the same weights
            for name, p in model.named_parameters():
                named[name].copy_(p.float())
        engine.begin_step(micro)
        for m in range(micro):
            x, y = batch(step, rank * micro + m)
            with engine.forward(m), autocast():
                loss = model(x, y) / (seqs * x.numel())
            engine.backward(m, loss, last=m == micro - 1)
        engine.finish_step()
        grads = {}  # (rank, micro) -> {name: gradient}
        for r in range(world):
            for m in range(micro):
                x, y = batch(step, r * micro + m)
                ref.zero_grad(set_to_none=True)
                with autocast():
                    (ref(x, y) / (seqs * x.numel())).backward()
                grads[r, m] = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in named.items()}
        for b, _, got in engine.owned():
            if b.zero <= 1:  # a rank's micro-steps summed in its buffer, then the ranks
                total = lambda n: _sum(_sum(grads[r, m][n] for m in range(micro)) for r in range(world))
            else:  # each backward reduce-scattered, then added into the shard
                total = lambda n: _sum(_sum(grads[r, m][n] for r in range(world)) for m in range(micro))
            want = torch.zeros(b.padded)
            for (name, _), (_, view) in zip(b.params, b.views(want)):
                view.copy_(total(name))
            lo, hi = b.owned_range()
            if not torch.equal(want[lo:hi], got):
                diff = (want[lo:hi] - got).abs().nan_to_num(float("inf"))
                where = [n for (n, _), off, k in zip(b.params, b.offsets, b.spans)
                         if diff[max(off - lo, 0) : max(off + k - lo, 0)].any()]
                bad.append(f"step {step} bucket {b.index}: {where} differ (max |diff| {diff.max().item():.3g})")
        assert all(named[n].grad is None for n in UNUSED)
        if zero >= 2:  # no view into a scratch handed to the reduce-scatter outlives the backward
            held = [n for n, p in model.named_parameters() if p.grad is not None or getattr(p, "main_grad", None) is not None]
            if held:
                bad.append(f"step {step}: views held after the backward: {held}")
        opt.step(1e-2)
        engine.gather_params()
    return bad


def _sum(ts):
    out = None
    for t in ts:
        out = t.clone() if out is None else out + t
    return out


def main(out):
    from braidtrain.collective.runtime import init_runtime

    rt = init_runtime("env")
    torch.use_deterministic_algorithms(True)  # (and torch.empty filled with NaN)
    comm = Comm(rt.device)
    mesh = build_mesh(rt.rank, rt.world_size, comm)
    got = {f"z{z}-m{m}-{mode}": case(rt.rank, rt.world_size, mesh, comm, z, m, mode) for z, m, mode in CASES}
    with open(f"{out}/rank{rt.rank}.json", "w") as f:
        f.write(json.dumps(got))
    rt.close()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # no interpreter teardown after collectives: see braidtrain.cli.run
