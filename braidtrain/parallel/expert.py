"""Expert parallelism: the E experts of each MoE layer (model/moe.py) sharded over the ep ranks,
tokens sent to them and back by all-to-all.

The ep group is carved from the dp*cp replicas of one (pp, tp) slot (mesh.py): ep rank r holds
experts [r E/ep, (r+1) E/ep). One MoE forward on each rank:

    1. its kept assignments sorted expert-major, token order within an expert (each token meets
       an expert at most once): rows = x[token of each], counts per expert (E,)
    2. counts exchanged by all-to-all: how many rows each source sends each of my experts
    3. rows by all-to-all with per-rank splits (comm.all_to_all_v); what arrives is ordered
       (source, my expert, token) and is reordered to (my expert, source, token) -- for each
       expert its rows in global token order (sources in the ep group's order)
    4. each expert over its rows: on CUDA in bf16 one grouped GEMM for all of them
       (torch._grouped_mm), elsewhere a loop; in exact mode one call per (expert, source), the
       shapes and rows that source would have computed alone at ep 1
    5. reordered back, returned by the reverse all-to-all, and put in place per (token, slot) by
       index -- no atomics, each place written once; the router's weights combine them (moe.py)

The all-to-alls are autograd functions whose backward is the reverse exchange, so the gradients
of rows travel back the same way. At ep = 1 steps 2, 3 and 5's exchanges are skipped.

Gradients: an expert's parameters are reduced over the dp*cp/ep ranks that hold the same experts
(mesh group "expert"), dense ones over the dp*cp replicas, each in its own buckets
(placement.py); the gradient norm counts each expert once (its ep rank's).
"""

from __future__ import annotations

import torch

from braidtrain.model.moe import Dispatch as LocalDispatch, compute, grouped, move_bias


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        group.comm.all_to_all_v(out, x.contiguous(), out_splits, in_splits, group).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.group.comm.all_to_all_v(back, grad.contiguous(), in_splits, out_splits, ctx.group).wait()
        return back, None, None, None


class Dispatch(LocalDispatch):
    """How one rank's tokens reach the experts sharded over the ep group (`group`); the sorting,
    the local compute and the putting back are model/moe.py's Dispatch."""

    def __init__(self, group, exact: bool = False):
        super().__init__(exact)
        self.group, self.n = group, group.size

    def _run(self, rows, counts, moe):
        n, El = self.n, moe.E // self.n
        got = torch.empty_like(counts)
        self.group.comm.all_to_all(got, counts, self.group).wait()
        sent, recv = counts.view(n, El).tolist(), got.view(n, El).tolist()  # [source][my expert]
        send_splits, recv_splits = [sum(r) for r in sent], [sum(r) for r in recv]
        arrived = _AllToAll.apply(rows, recv_splits, send_splits, self.group)
        start, pos = [], 0  # where (source s, my expert e) begins in what arrived
        for s in range(n):
            start.append([])
            for e in range(El):
                start[s].append(pos)
                pos += recv[s][e]
        perm = [i for e in range(El) for s in range(n) for i in range(start[s][e], start[s][e] + recv[s][e])]
        perm = torch.tensor(perm, dtype=torch.long, device=rows.device)
        mine = [sum(recv[s][e] for s in range(n)) for e in range(El)]
        if self._grouped(arrived, moe):
            out = grouped(arrived[perm], torch.tensor(mine, device=rows.device), moe.experts)
        else:
            tap = (lambda w, s: Tap.apply(w, self.sink, s)) if self.sink is not None else None
            out = compute(arrived[perm], mine, moe.experts, [[recv[s][e] for s in range(n)] for e in range(El)],
                          self.exact, tap)
        back = torch.empty_like(out).index_copy(0, perm, out) if perm.numel() else out
        return _AllToAll.apply(back, send_splits, recv_splits, self.group)


class Tap(torch.autograd.Function):
    """A stacked expert parameter as one source's expert calls use it: forward the identity;
    backward hands the gradient (of every expert's slice, from that source's rows) to
    `sink(param, source, grad)` and gives autograd none (as model/protocol.TiedHead)."""

    @staticmethod
    def forward(ctx, w, sink, source: int):
        ctx.w, ctx.sink, ctx.source = w, sink, source
        return w.detach()  # (an alias autograd does not track as a view of the parameter)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.w, ctx.source, grad)
        return None, None, None


class Sourced:
    """Exact mode at ep > 1: an expert's gradient summed along the tree it has at ep 1. There,
    rank g's gradient of micro-batch j is leaf (g, j) of one tree over the replicas (in their exact
    order) and micro-batches (exact.py). Here the expert's rank computes source s's part of
    micro-batch j by itself (Dispatch: one call per source) and its taps bring each part's
    gradients here: leaf s * m + j of the bucket's tree, so the ep sources' subtrees are added in
    order, then over the expert group -- the same tree, since an ep group is a run of consecutive
    replicas in that order (mesh.py)."""

    def __init__(self, engine):
        self.e = engine
        self.buckets = [b for b in engine.buckets if b.group.axis == "expert"]
        for b in self.buckets:
            b.sourced = True
        self.place = {p: (b, i) for b in self.buckets for i, (_, p) in enumerate(b.params)}
        self.leaves, self.pending, self.done = {}, {}, {}
        order = engine.ep.tree or tuple(range(engine.ep.size))
        self.position = {s: order.index(s) for s in range(engine.ep.size)}  # a source's place in the exact order

    def add(self, p, source: int, grad) -> None:
        e = self.e
        b, i = self.place[p]
        key = (b, source)
        if key not in self.leaves:
            self.leaves[key] = leaf = e.grads.take(b.padded)
            leaf.zero_()
            self.pending[key] = len(b.params)
        b.view(self.leaves[key], i).copy_(grad)
        self.pending[key] -= 1
        if self.pending[key]:
            return
        e.trees[b].add(self.position[source] * e.n_micro + e.micro, self.leaves.pop(key))
        self.done[b] = self.done.get(b, 0) + 1
        if self.done[b] < e.ep.size:
            return
        self.done[b] = 0
        if e.last:
            b.grad = e.trees[b].total(e.ep.size * e.n_micro)
            b.handle = e.exact_reduce(b, b.grad, *e.owned_grad(b), e.scratch.get(b))
        if e.zero_hooks is not None:
            e.zero_hooks.gradients_done(b)

    def clear(self) -> None:
        self.leaves.clear(), self.pending.clear(), self.done.clear()


def step_figures(parts, comm, world, mcfg, balance, move: bool = True) -> dict:
    """A step's mixture-of-experts figures over every rank and MoE layer (model/moe.py's stats): the
    mean balance loss, the share of assignments dropped at capacity, and the experts' load -- tokens
    kept per expert, summed over layers, as max / mean and each expert's share. One all-reduce of a
    (layers, figures) table, each rank its own layers' rows (tp's copies weigh every layer alike).
    With --moe-balance bias (and `move`) the table's loads move every layer's biases, `balance`
    (layers, E), the same on every rank (moe.move_bias)."""
    E = mcfg.moe_experts
    table = torch.zeros(mcfg.n_layer, 4 + 2 * E, device=balance.device)
    for part in parts:
        for i, m in part.moe_by_block().items():
            table[i] = m.stats
            m.stats.zero_()
    comm.all_reduce(table, world).wait()
    total = table.sum(0)
    n, assigned, aux, dropped = total[:4].tolist()
    load = total[4 + E:]
    if mcfg.moe_balance == "bias" and move:
        move_bias(balance, table[:, 4:4 + E], mcfg.moe_bias_rate)
    return {"moe_aux": aux / max(n, 1), "moe_dropped": dropped / max(assigned, 1),
            "moe_load_max": (load.max() / load.mean().clamp_min(1e-9)).item(),
            "moe_load": (load / load.sum().clamp_min(1e-9)).tolist()}
