"""Run under torchrun by test_engine.py: one data-parallel step with many small buckets, then
write what the test checks to OUT/rank<r>.json. A third argument, `bf16` or `bf16-recompute`: the
step (and the reference) under CPU bf16 autocast, the latter with whole blocks recomputed."""

import json
import os
import sys
from contextlib import nullcontext

import torch

from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.model.gpt2 import GPT
from braidtrain.parallel.placement import init_weights
from braidtrain.model.registry import model_config
from braidtrain.optim import AdamW
from braidtrain.parallel.engine import Engine
from braidtrain.collective.runtime import init_runtime


def batch(step, seq, vocab=256, t=32):
    g = torch.Generator().manual_seed(1000 * step + seq)
    x = torch.randint(0, vocab, (1, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def main(zero, out, mode="fp32"):
    rt = init_runtime("env")
    torch.manual_seed(0)
    cfg = model_config("tiny", 256, n_layer=3, n_embd=64, n_head=2, block_size=32)
    model = GPT(cfg)
    init_weights(model, seed=7)
    reference = GPT(cfg)
    reference.load_state_dict(model.state_dict())
    comm = Comm(rt.device)
    engine = Engine(model, build_mesh(rt.rank, rt.world_size, comm), comm, zero=zero, exact=False, bucket_mb=0.02, device=rt.device)
    opt = AdamW(engine)
    n, micro = rt.world_size, 2
    seqs = n * micro
    model.recompute = mode == "bf16-recompute"
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=False)) if mode != "fp32" else nullcontext
    launched_early, gathers_in_backward, gathers_in_forward = [], 0, []
    engine.begin_step(micro)
    for m in range(micro):
        before = len(comm.records)
        x, y = batch(0, rt.rank * micro + m)
        with engine.forward(m), autocast():
            loss = model(x, y) / (seqs * 32)
        gathers_in_forward.append(sum(r.op == "all_gather" for r in list(comm.records)[before:]))
        before = len(comm.records)
        engine.backward(m, loss, last=m == micro - 1)
        gathers_in_backward += sum(r.op == "all_gather" for r in list(comm.records)[before:])
        launched_early.append(len(comm.records))
    last_grad = engine.last_grad_time
    engine.finish_step()
    first_launch = min(r.t_start for r in comm.records)
    norm = engine.grad_norm().item()
    state_bytes = engine.model_state_bytes()
    # the single-process reference: the whole global batch, plain autograd
    for s in range(seqs):
        x, y = batch(0, s)
        with autocast():
            loss = reference(x, y) / (seqs * 32)
        loss.backward()
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in reference.parameters())).item()
    P = sum(p.numel() for p in model.parameters())
    with open(f"{out}/rank{rt.rank}.json", "w") as f:
        f.write(json.dumps({
        "rank": rt.rank, "n": n, "buckets": len(engine.buckets), "P": P, "state": opt.state_numel(), "state_bytes": state_bytes,
        "records_after_first_micro": launched_early[0], "first_launch": first_launch, "last_grad": last_grad,
        "norm": norm, "ref_norm": ref_norm, "gathers_in_backward": gathers_in_backward,
        "gathers_in_forward": gathers_in_forward,
        "block_buckets": sum(1 for b in engine.buckets if b.modules),
    }))
    rt.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
    os._exit(0)  # no interpreter teardown after collectives: see braidtrain.cli.run
