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
import torch.nn.functional as F


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


class Dispatch:
    """How one rank's tokens reach the experts: `group` the ep group (None: every expert here);
    `sink` (exact mode at ep > 1, set by the engine: Sourced.add) takes each source's gradients."""

    def __init__(self, group=None, exact: bool = False):
        self.group, self.exact, self.sink = group, exact, None
        self.grouped = True  # on CUDA in bf16: one grouped GEMM (False: a loop, for benchmarks/moe_gpu.py)
        self.n = group.size if group is not None else 1

    def experts_of(self, E: int, r: int) -> range:
        return range(r * E // self.n, (r + 1) * E // self.n)

    def __call__(self, xs, idx, keep, moe):
        """The expert outputs (N, k, C) of tokens xs (N, C) routed to experts idx (N, k); `keep`
        (N, k) marks the assignments within capacity, zero output elsewhere (None: dropless)."""
        N, k = idx.shape
        expert = idx.reshape(-1)  # assignment a = token * k + slot
        if keep is not None:
            kept = keep.reshape(-1).nonzero().squeeze(1)
            order = kept[torch.sort(expert[kept], stable=True).indices]  # expert-major, token order
        else:  # dropless: every assignment (and no wait for the GPU)
            order = torch.sort(expert, stable=True).indices
        rows = xs[order // k]
        if torch.is_autocast_enabled(xs.device.type):  # travel and compute in the autocast dtype
            rows = rows.to(torch.get_autocast_dtype(xs.device.type))
        counts = torch.zeros(moe.E, dtype=torch.long, device=xs.device).scatter_add_(0, expert[order], torch.ones_like(order))
        out = self._run(rows, counts, moe)
        y = out.new_zeros(N * k, out.shape[-1]).index_copy(0, order, out)
        return y.view(N, k, -1)

    def _run(self, rows, counts, moe):
        local = [moe.experts[str(e)] for e in sorted(int(i) for i in moe.experts)]
        if self.n == 1:
            if self._grouped(rows, moe):  # (the counts stay on the GPU)
                return grouped(rows, counts, local)
            c = counts.tolist()
            return compute(rows, c, local, [[x] for x in c], self.exact)
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
            out = grouped(arrived[perm], torch.tensor(mine, device=rows.device), local)
        else:
            out = compute(arrived[perm], mine, local, [[recv[s][e] for s in range(n)] for e in range(El)], self.exact, self.sink)
        back = torch.empty_like(out).index_copy(0, perm, out) if perm.numel() else out
        return _AllToAll.apply(back, send_splits, recv_splits, self.group)

    def _grouped(self, rows, moe) -> bool:
        """On CUDA in bf16, outside exact mode, with rows to compute (a grouped GEMM of none raises;
        the loop keeps the experts in the graph), widths of whole 16-byte rows: one grouped GEMM."""
        return (self.grouped and not self.exact and rows.is_cuda and rows.dtype == torch.bfloat16 and rows.shape[0] > 0
                and hasattr(torch, "_grouped_mm") and rows.shape[-1] % 8 == 0 and moe.width % 8 == 0)


def compute(rows, counts: list[int], experts, parts: list[list[int]], exact: bool, sink=None):
    """The experts over their runs of rows (counts[e] rows each, in order), one call each. In
    exact mode each expert's run in `parts` pieces (one per source rank, empty ones too), each its
    own call, its parameters' gradients handed to `sink` per source (Tap)."""
    outs = []
    for ex, piece, sizes in zip(experts, rows.split(counts), parts):
        for s, p in enumerate(piece.split(sizes if exact else [piece.shape[0]])):
            outs.append(ex(p, [Tap.apply(w, sink, s) for w in ex.weights()] if sink is not None else None))
    return torch.cat(outs) if outs else rows.new_zeros(0, rows.shape[-1])


class Tap(torch.autograd.Function):
    """A parameter as one source's expert call uses it: forward the identity; backward hands the
    gradient to `sink(param, source, grad)` and gives autograd none (as model/gpt.TiedHead)."""

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
            self.leaves[key] = leaf = e._take(b.padded)
            leaf.zero_()
            self.pending[key] = len(b.params)
        off = b.offsets[i]
        self.leaves[key][off : off + p.numel()].view_as(p).copy_(grad)
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
            b.handle = e._exact_reduce(b, b.grad, *e.owned_grad(b), e.scratch.get(b))
        if e.zero_hooks is not None:
            e.zero_hooks.gradients_done(b)

    def clear(self) -> None:
        self.leaves.clear(), self.pending.clear(), self.done.clear()


def grouped(rows, counts, experts):
    """All experts in two grouped GEMMs (torch._grouped_mm: one launch, each expert its run of
    rows; counts a device tensor). Each row's bias is its expert's, picked by a matmul with the
    rows' one-hot expert matrix, so that its gradient is one too (a gather's would be an
    index_put that adds with atomics: 20 of 31 ms of a layer's step on the H200, measured)."""
    dt, E = rows.dtype, len(experts)
    offs = counts.cumsum(0).to(torch.int32)
    which = torch.repeat_interleave(torch.arange(E, device=rows.device), counts, output_size=rows.shape[0])
    onehot = (which[:, None] == torch.arange(E, device=rows.device)).to(dt)  # (rows, E)
    w1, b1, w2, b2 = (torch.stack(ws).to(dt) for ws in zip(*(e.weights() for e in experts)))  # (E, H, C) ...
    h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs) + onehot @ b1
    return torch._grouped_mm(F.gelu(h, approximate="tanh"), w2.transpose(-2, -1), offs=offs) + onehot @ b2
