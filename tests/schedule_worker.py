"""Run under torchrun by test_schedule.py: one step's micro-batches driven through the engine by the
executor in four orders -- sequential (F0 B0 F1 B1 ...), 1F1B (F0 F1 B0 F2 B1 ...), every
backward in reverse (F0 F1 F2 F3 B3 B2 B1 B0) and a scrambled one -- at ZeRO 0-3, default and exact, and writes to
OUT/rank<r>.json, for each case against the sequential order of the same case: the loss and
gradient norm, how far the reduced gradient this rank owns moved, and the live activations."""

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
from braidtrain.parallel.engine import Engine
from braidtrain.parallel.actions import Action, check
from braidtrain.parallel.schedule import Executor
from braidtrain.collective.runtime import init_runtime

M = 4  # micro-batches per rank
ORDERS = {
    "sequential": "F0 B0 F1 B1 F2 B2 F3 B3",
    "1f1b": "F0 F1 B0 F2 B1 F3 B2 B3",
    "reverse": "F0 F1 F2 F3 B3 B2 B1 B0",
    # a complete binary tree mirrored is the same sums (IEEE addition commutes): only an order that
    # is no mirror of the tree tells a tree by micro-batch number from one by arrival
    "scrambled": "F0 F1 F2 B2 F3 B0 B3 B1",
}


def actions(text):
    return [Action(a[0], 0, int(a[1:])) for a in text.split()]


def run(rt, zero, exact, order, bf16):
    torch.manual_seed(0)
    cfg = model_config("tiny", 256, n_layer=3, n_embd=64, n_head=2, block_size=32)
    model = GPT(cfg)
    init_weights(model, seed=11)
    comm = Comm(rt.device)
    engine = Engine(model, build_mesh(rt.rank, rt.world_size, comm), comm, zero=zero, exact=exact, bucket_mb=0.02,
                    device=rt.device)
    g = torch.Generator().manual_seed(100 + rt.rank)
    data = [torch.randint(0, 256, (2, 33), generator=g) for _ in range(M)]
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=False)) if bf16 else nullcontext

    def forward(_stage, micro, _inp):
        with autocast():
            return model(data[micro][:, :-1], data[micro][:, 1:])

    executor = Executor(engine, forward, divisor=rt.world_size * M * 2 * 32)
    plan = actions(ORDERS[order])
    check([plan], M)
    losses = executor.run(plan, M)
    engine.finish_step()
    norm = engine.grad_norm().item()
    grads = torch.cat([g.clone() for _, _, g in engine.owned()])
    return {"loss": sum(loss.item() for loss in losses), "norm": norm, "grads": grads, "max_live": executor.max_live}


def main(out):
    rt = init_runtime("env")
    torch.set_num_threads(1)  # as exact mode runs on the CPU, for every case alike
    res = {}
    for zero in (0, 1, 2, 3):
        for exact in (False, True):
            for bf16 in (False, True) if zero == 3 else (False,):
                case = f"z{zero}-{'exact' if exact else 'default'}" + ("-bf16" if bf16 else "")
                base = run(rt, zero, exact, "sequential", bf16)
                for order in ORDERS:
                    r = run(rt, zero, exact, order, bf16) if order != "sequential" else base
                    res[f"{case}.{order}"] = {
                        "loss": r["loss"], "norm": r["norm"], "max_live": r["max_live"],
                        "loss_rel": abs(r["loss"] - base["loss"]) / abs(base["loss"]),
                        "norm_rel": abs(r["norm"] - base["norm"]) / base["norm"],
                        "grad_max_abs": (r["grads"] - base["grads"]).abs().max().item(),
                        "grad_scale": base["grads"].abs().max().item(),
                        "grads_equal": torch.equal(r["grads"], base["grads"]),
                        "norm_equal": r["norm"] == base["norm"],
                    }
    with open(f"{out}/rank{rt.rank}.json", "w") as f:
        json.dump(res, f)
    rt.close()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # no interpreter teardown after collectives: see braidtrain.cli.run
