"""Run under torchrun by test_layers.py with N = tp ranks (gloo, CPU): every tensor-parallel layer, the
vocab-parallel cross-entropy and the whole GPT against their dense, single-rank counterparts built
from the same full weights (with N = 4, the GPT also on a dp=2 x tp=2 mesh). Writes {check: relative
error or flag} to OUT/rank<r>.json (a file per rank: concurrent ranks would interleave stdout)."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from braidtrain.collective.comm import Comm
from braidtrain.errors import UserError
from braidtrain.collective.mesh import build_mesh
from braidtrain.model.gpt2 import GPT
from braidtrain.parallel.placement import init_weights
from braidtrain.model.registry import model_config
from braidtrain.model.layers import (ColumnParallelLinear, RowParallelLinear, ShardSpec, VocabParallelEmbedding,
                                     shard_of, unshard, vocab_parallel_cross_entropy)
from braidtrain.parallel import placement

B, T, IN, OUT = 2, 8, 12, 16


def rel(got, want):
    """Relative error in the norm: |got - want| / |want|."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def gather(t, group, tp):
    pieces = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(pieces, t.contiguous(), group=group.pg)  # the test's own collective, beside the code's
    return pieces


def seq_chunk(t, rank, tp):
    return t.chunk(tp, 1)[rank]


def check_layers(res, group, rank, tp):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, IN, generator=g)
    w, b = torch.randn(OUT, IN, generator=g), torch.randn(OUT, generator=g)
    r = torch.randn(B, T, OUT, generator=g)  # the loss is sum(y * r): a gradient that is not all ones
    x0 = x.clone().requires_grad_()
    w0, b0 = w.clone().requires_grad_(), b.clone().requires_grad_()
    y0 = F.linear(x0, w0, b0)
    (y0 * r).sum().backward()
    col, row = ShardSpec(0, "contiguous"), ShardSpec(1, "contiguous")
    for sp in (False, True):
        tag = "sp" if sp else "tp"
        # column-parallel: this rank's output features; input whole (tp) or its rows of T (sp)
        for gather_out in ((False, True) if not sp else (False,)):
            lin = ColumnParallelLinear(IN, OUT, group, sp=sp, gather_output=gather_out)
            with torch.no_grad():
                lin.weight.copy_(shard_of(w, col, rank, tp)), lin.bias.copy_(shard_of(b, col, rank, tp))
            xi = (seq_chunk(x, rank, tp) if sp else x).clone().requires_grad_()
            y = lin(xi)
            name = f"col.{tag}{'.gather' if gather_out else ''}"
            want = y0 if gather_out else y0.chunk(tp, -1)[rank]
            res[f"{name}.out"] = rel(y, want)
            # each rank's share of the loss: its own output features (all of them once gathered: the
            # gathered output is one replicated tensor, so every rank backpropagates its whole loss)
            (y * (r if gather_out else r.chunk(tp, -1)[rank])).sum().backward()
            res[f"{name}.dx"] = rel(xi.grad, seq_chunk(x0.grad, rank, tp) if sp else x0.grad)
            res[f"{name}.dw"] = rel(lin.weight.grad, shard_of(w0.grad, col, rank, tp))
            res[f"{name}.db"] = rel(lin.bias.grad, shard_of(b0.grad, col, rank, tp))
        # row-parallel: this rank's input features; output whole (tp) or its rows of T (sp)
        lin = RowParallelLinear(IN, OUT, group, sp=sp)
        with torch.no_grad():
            lin.weight.copy_(shard_of(w, row, rank, tp)), lin.bias.copy_(b)
        xi = x.chunk(tp, -1)[rank].clone().requires_grad_()
        y = lin(xi)
        res[f"row.{tag}.out"] = rel(y, seq_chunk(y0, rank, tp) if sp else y0)
        (y * (seq_chunk(r, rank, tp) if sp else r)).sum().backward()
        res[f"row.{tag}.dx"] = rel(xi.grad, x0.grad.chunk(tp, -1)[rank])
        res[f"row.{tag}.dw"] = rel(lin.weight.grad, shard_of(w0.grad, row, rank, tp))
        db = lin.bias.grad.clone()
        if sp:  # the bias saw this rank's rows only: a partial gradient, complete once summed over tp
            res["row.sp.db_partial"] = rel(db, b0.grad)
            dist.all_reduce(db, group=group.pg)
        res[f"row.{tag}.db"] = rel(db, b0.grad)
        # vocab-parallel embedding: rows [rank V/tp, (rank+1) V/tp)
        V = 64
        table = torch.randn(V, IN, generator=g)
        idx = torch.randint(0, V, (B, T), generator=g)
        rr = torch.randn(B, T, IN, generator=g)
        t0 = table.clone().requires_grad_()
        e0 = F.embedding(idx, t0)
        (e0 * rr).sum().backward()
        emb = VocabParallelEmbedding(V, IN, group, sp=sp)
        with torch.no_grad():
            emb.weight.copy_(shard_of(table, col, rank, tp))
        e = emb(idx)
        res[f"emb.{tag}.out"] = rel(e, seq_chunk(e0, rank, tp) if sp else e0)
        (e * (seq_chunk(rr, rank, tp) if sp else rr)).sum().backward()
        res[f"emb.{tag}.dw"] = rel(emb.weight.grad, shard_of(t0.grad, col, rank, tp))


def check_cross_entropy(res, group, rank, tp):
    g = torch.Generator().manual_seed(12)
    N = 24
    for V in (300, 512):  # 300: padded to a multiple of 128*tp (for tp=4, rank 3 holds only padding)
        Vp = -(-V // (128 * tp)) * 128 * tp
        full = 3 * torch.randn(N, Vp, generator=g)
        full[:, V:] = 100.0  # padding columns would dominate, were they ever predicted
        target = torch.randint(0, V, (N,), generator=g)
        firsts = [c for c in range(0, V, Vp // tp)]  # a target on the first column of every rank that
        target[: len(firsts)] = torch.tensor(firsts)   # holds real tokens...
        target[-1] = V - 1  # ...and the last real token
        weight = torch.randn(N, generator=g)
        f0 = full.clone().requires_grad_()
        l0 = F.cross_entropy(f0[:, :V], target, reduction="none")
        (l0 * weight).sum().backward()
        local = full.chunk(tp, 1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, rank * (Vp // tp), V, group)
        (loss * weight).sum().backward()
        res[f"ce.{V}.loss"] = rel(loss, l0)
        res[f"ce.{V}.grad"] = rel(local.grad, f0.grad.chunk(tp, 1)[rank])
        pad = local.grad[:, max(0, V - rank * (Vp // tp)):]  # the padding columns this rank holds
        res[f"ce.{V}.padding_grad_max"] = pad.abs().max().item() if pad.numel() else 0.0


def check_gpt(res, mesh, pre="gpt"):
    """`pre`: the key prefix ("gpt"; "dp2" for tp=2 groups inside a 4-rank dp=2 x tp=2 mesh)."""
    group, rank, tp = mesh.groups["tp"], mesh.coord("tp"), mesh.size("tp")
    cfg = model_config("tiny", 300, n_layer=2, n_embd=64, n_head=4, block_size=32)
    g = torch.Generator().manual_seed(13)
    idx, y = torch.randint(0, 300, (2, 16), generator=g), torch.randint(0, 300, (2, 16), generator=g)
    ref = GPT(cfg)
    init_weights(ref, seed=5)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with torch.no_grad():  # nudge LayerNorms and biases off their ones/zeros so that they matter
        for i, p in enumerate(ref.parameters()):
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    ref_params = dict(ref.named_parameters())
    ref_loss = ref(idx, y)
    ref_loss.backward()
    ref_logits = ref(idx).detach()

    for sp in (False, True):
        tag = "sp" if sp else "tp"
        model = GPT(cfg, mesh, sp=sp)
        table = placement.build(model)  # wte is padded further under tp: zero rows beyond the tp=1 ones
        init_weights(model, seed=5)
        res[f"{pre}.{tag}.same_init"] = all(
            torch.equal(p.detach(), table[n].shard(initial[n], rank, tp)) for n, p in model.named_parameters())
        with torch.no_grad():  # then the nudged weights
            for n, p in model.named_parameters():
                p.copy_(table[n].shard(ref_params[n].detach(), rank, tp))
        for recompute in (False, True) if sp else (False,):
            model.zero_grad(set_to_none=True)
            model.recompute = recompute
            loss = model(idx, y)
            loss.backward()
            key = f"{pre}.{tag}{'.recompute' if recompute else ''}"
            res[f"{key}.loss"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
            losses = gather(loss.detach().reshape(1), group, tp)
            res[f"{key}.loss_same_on_tp_ranks"] = all(torch.equal(loss, losses[0]) for loss in losses)
            partial = table.sp_partial()
            worst, worst_name, replicated_equal = 0.0, "", True
            for n, p in model.named_parameters():
                grad = p.grad.clone()
                if n in partial:
                    dist.all_reduce(grad, group=group.pg)  # what the engine does for sp's partial grads
                pieces = gather(grad, group, tp)
                if table[n].replicated:
                    replicated_equal &= all(torch.equal(q, pieces[0]) for q in pieces)
                full = unshard(pieces, table[n].split)
                want = ref_params[n].grad
                if n == "wte.weight":
                    pad = full[len(want):]  # rows beyond the tp=1 padding
                    res[f"{key}.wte_padding_grad_max"] = pad.abs().max().item() if pad.numel() else 0.0
                    full = full[: len(want)]
                e = rel(full, want)
                if e >= worst:
                    worst, worst_name = e, n
            res[f"{key}.grad"] = worst
            res[f"{key}.grad_worst_param"] = worst_name
            res[f"{key}.replicated_grads_equal"] = replicated_equal
        res[f"{pre}.{tag}.partial"] = sorted(table.sp_partial())
        if sp:  # a sequence that does not split over the tp ranks: a one-line error, before any collective
            try:
                model(idx[:, : 2 * tp + 1], y[:, : 2 * tp + 1])
                res[f"{pre}.sp.bad_T_error"] = None
            except UserError as e:
                res[f"{pre}.sp.bad_T_error"] = str(e)
        with torch.no_grad():
            res[f"{pre}.{tag}.logits"] = rel(model(idx), ref_logits)


def main(out):
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    world = dist.get_world_size()
    torch.manual_seed(0)
    comm = Comm(torch.device("cpu"))
    mesh = build_mesh(dist.get_rank(), world, comm, tp=world)
    group, rank, tp = mesh.groups["tp"], mesh.coord("tp"), mesh.size("tp")
    res = {"tp": tp}
    check_layers(res, group, rank, tp)
    check_cross_entropy(res, group, rank, tp)
    check_gpt(res, mesh)
    if tp == 4:  # tp groups that are not the whole world: {0,1} and {2,3}, with dp = 2
        check_gpt(res, build_mesh(dist.get_rank(), world, comm, tp=2), pre="dp2")
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # no interpreter teardown after collectives: see braidtrain.cli.run
