"""Run under torchrun (2 ranks, gloo) by test_fold.py: exact mode's tree with its first level folded
into the backward (parallel/exact.py) against the same run with it off (Engine(fold=False)), on
one small GPT (its head tied: the head's own tree, tied.py) and a tied Llama in bf16 (lean buckets
at ZeRO 1-3), over micro-step counts 1-5 at dp 1, 1/2/4 at dp 2 (exact mode refuses others
there), ZeRO 0-3, pipelines (every schedule), ep 2 (sourced expert leaves: no fold), and one
stage's backwards in other orders (reversed: no odd one finds its sibling complete). Each run: 2
steps of the engine, the schedule's executor and AdamW as the trainer drives them; per step a
sha256 of the reduced gradient each rank owns, and how many additions the trees did and how many
they left to the backward; at the end the weights' sha256. Rank 0 writes OUT/fold.json."""

import hashlib
import json
import os
import sys
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.distributed as dist

from layouts_worker import CFG, LLAMA_TIED, MOE, T, batch, lines
from braidtrain.build import make_parts
from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.io.checkpoint import weights_sha256
from braidtrain.layout import make_layout
from braidtrain.optim import AdamW, clip_scale, lr_at
from braidtrain.parallel.actions import Action
from braidtrain.parallel.engine import Engine
from braidtrain.parallel.placement import init_weights
from braidtrain.passes import Passes

MODELS = {"gpt": replace(CFG, n_layer=4), "llama": LLAMA_TIED, "moe": replace(MOE, n_layer=2)}
STEPS = 2


def cases():
    """(name, model, micro-steps a rank, layout keywords, order): order a one-stage order of the
    backwards ("reverse", "scrambled") in place of the schedule's, or None."""
    out = [(f"dp1-z{z}-m{m}", "gpt", m, dict(zero=z), None) for z in (0, 3) for m in (1, 2, 3, 4, 5)]
    out += [(f"dp2-z{z}-m{m}", "gpt", m, dict(dp=2, zero=z), None) for z in range(4) for m in (1, 2, 4)]
    out += [(f"dp2-z{z}-m4-bf16", "llama", 4, dict(dp=2, zero=z, bf16=True), None) for z in (1, 3)]
    out += [("dp1-m5-bf16", "llama", 5, dict(bf16=True), None)]
    out += [(f"pp2-{s}-m4", "gpt", 4, dict(pp=2, schedule=s), None) for s in ("gpipe", "1f1b", "interleaved", "zb")]
    out += [("ep2-dp2-m2", "moe", 2, dict(dp=2, ep=2), None)]
    out += [(f"dp1-m{m}-{o}", "gpt", m, dict(), o) for m in (4, 5) for o in ("reverse", "scrambled")]
    return out


def order(name, m):
    """A one-stage order of m micro-batches: every forward, then the backwards reversed; or scrambled
    (F0 F1 F2 B2 F3 B0 B3 B1 ...: B3 finds B2 complete, B1 B0)."""
    if name == "reverse":
        backs = list(range(m - 1, -1, -1))
    else:
        backs = [2, 0, 3, 1] + list(range(4, m))
    return [Action("F", 0, j) for j in range(m)] + [Action("B", 0, j) for j in backs]


def expected_folds(actions, stage):
    """Odd micro-batches of `stage` whose weights' backward (W where the schedule splits it, else B)
    comes after their even sibling's: the ones that should fold."""
    split = any(a.op == "W" for a in actions if a.stage == stage)
    seen, folds = set(), 0
    for a in actions:
        if a.stage == stage and a.op == ("W" if split else "B"):
            folds += a.micro & 1 and (a.micro ^ 1) in seen
            seen.add(a.micro)
    return folds


def run(rank, model, m, kw, fold, backs=None):
    kw = dict(kw)
    dp, bf16 = kw.pop("dp", 1), kw.pop("bf16", False)
    cfg, pp = MODELS[model], kw.get("pp", 1)
    n = pp * dp
    lay = make_layout(n, cfg, seq_len=T, batch_size=1, total_batch=m * dp * T, exact=True, **kw)
    comm = Comm(torch.device("cpu"))
    mesh = build_mesh(rank, n, comm, pp=pp, ep=lay.ep, ring=lay.virtual > 1, members=range(n), new_group=lines())
    if mesh is None:
        return None
    parts = make_parts(cfg, mesh, lay, lay.sp)
    for part in parts:
        init_weights(part, 5)
    engine = Engine(
        parts,
        mesh,
        comm,
        zero=lay.zero,
        exact=True,
        bucket_mb=0.01,
        device=torch.device("cpu"),
        dtype=torch.bfloat16 if bf16 else torch.float32,
        fold=fold,
    )
    opt = AdamW(engine)
    rows = lay.batch.seqs_per_rank
    tokens = torch.zeros(2, rows, T, dtype=torch.long)
    built = SimpleNamespace(
        layout=lay, mesh=mesh, comm=comm, cfg=SimpleNamespace(batch_size=1, seq_len=T), parts=parts, mcfg=cfg, engine=engine, fault=None
    )
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=False)) if bf16 else nullcontext
    passes = Passes(built, autocast, tokens)
    if backs is not None:
        passes.actions = order(backs, m)
    for part in parts:
        part.use_expert_biases(torch.zeros(cfg.n_layer, max(1, cfg.moe_experts)))
    grads, trees = [], []
    for step in range(STEPS):
        tokens.copy_(batch(step, mesh.coord("dp") * rows, rows))
        opt.prepare(lr_at(step, lr=3e-3, warmup=1, max_steps=STEPS, final_frac=0.1))
        passes.train_step()
        engine.finish_step()
        owned = torch.cat([g.reshape(-1) for _, _, g in engine.owned() if g is not None])
        grads.append(hashlib.sha256(owned.numpy().tobytes()).hexdigest())
        mine = [(b.stage, "sourced" if b.sourced else "bucket", t) for b, t in engine.trees.items()]
        if engine.tied.head is not None:
            mine.append((engine.parts[-1].stage, "head", engine.tied.head))
        # per tree: (stage, whose: a bucket's, ep's sourced experts', the tied head's; additions by
        # the tree itself; micro-batches folded into the backward)
        trees.append([(s, whose, t.adds, len(t.folded)) for s, whose, t in mine])
        opt.update(grad_scale=clip_scale(engine.grad_norm(), 1.0))
        engine.gather_params()
    expect = {p.stage: expected_folds(passes.actions, p.stage) for p in parts}
    every = comm.all_gather_object({"grads": grads, "trees": trees, "expect": expect, "pp": mesh.coord("pp")}, mesh.groups["world"])
    return {"sha": weights_sha256(engine), "ranks": every, "m": lay.batch.micro_steps}


def main(out):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    results = {}
    for name, model, m, kw, backs in cases():
        for fold in (False, True):
            r = run(rank, model, m, kw, fold, backs)
            if rank == 0:
                results[f"{name}.{'fold' if fold else 'off'}"] = r
            dist.barrier()
    if rank == 0:
        with open(f"{out}/fold.json", "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # no interpreter teardown after collectives: see braidtrain.cli.run
