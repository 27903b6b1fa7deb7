"""The global gradient norm that clipping reads: each parameter counted once (a tp-replicated one
on tp rank 0, a pipeline's tied copy on one stage: placement's Table.counted_here), over every
group that holds a part of the gradient -- the reduce groups' shards, the ep ranks' experts, the
pipeline's stages, the tp ranks' shards.

Norm, the default: each bucket read once (torch.linalg.vector_norm, fp32), the squares summed over
the groups by all-reduce. ExactNorm, exact mode's: summed in float64 over each parameter's
Q-element chunks with pairwise trees, so it depends neither on where shard boundaries fall nor on
which bucket -- or, with a pipeline, which stage -- holds a parameter. A GPU sums the chunks in one
Triton pass with the same bits (exact_kernels.chunk_squares; chunk_squares here is its reference).
"""

from __future__ import annotations

import torch

from braidtrain.collective.comm import pairwise_sum
from braidtrain.parallel import exact_kernels, placement
from braidtrain.parallel.buckets import Q, stride


def chunk_squares(g: torch.Tensor) -> torch.Tensor:
    """Each Q-element chunk of a flat fp32 gradient shard: its squares summed in float64 by a pairwise
    tree. The reference of exact_kernels.chunk_squares, which a GPU runs in its place (one pass)."""
    return pairwise_sum(g.double().pow(2).view(-1, Q).T)


def squares(g: torch.Tensor) -> torch.Tensor:
    """chunk_squares(g), by the kernel where it runs."""
    return exact_kernels.chunk_squares(g, Q) if exact_kernels.usable(g) else chunk_squares(g)


class Norm:
    def __init__(self, engine):
        self.e = engine

    def view(self, b, g):
        """The gradient g of bucket b as the norm sees it: each parameter once (Table.counted_here)."""
        e = self.e
        drop = e.segments(b, lambda x: not e.table.counted_here(x))
        if not drop:
            return g
        g = g.clone()
        for a, z in drop:
            g[a:z] = 0
        return g

    def __call__(self) -> torch.Tensor:
        """A 0-dim fp32 tensor on the device (reading it is the caller's host synchronisation)."""
        e = self.e
        total = torch.zeros((), dtype=torch.float32, device=e.device)
        owned = list(e.owned())
        for group in dict.fromkeys(b.group for b in e.buckets):  # each reduce group's shards, summed over it
            sq = torch.zeros((), dtype=torch.float32, device=e.device)
            for b, _, g in owned:
                if b.group is group:  # one read of the bucket, no squared copy
                    sq += torch.linalg.vector_norm(self.view(b, g), dtype=torch.float32).square()
            if e.zero >= 1 and group.size > 1:
                e.comm.all_reduce(sq, group).wait()
            if group.axis == "expert" and e.ep.size > 1:  # the other ep ranks' experts
                e.comm.all_reduce(sq, e.ep).wait()
            total += sq
        for group in (e.pp, e.tp):  # the other stages' parameters, the other shards
            if group.size > 1:
                e.comm.all_reduce(total, group).wait()
        return total.sqrt()


class ExactNorm(Norm):
    """The exact global gradient norm, the same bits in every layout of a tp degree: each Q-element
    chunk of a parameter (parameters start at multiples of Q in their buckets, and shards split
    buckets at multiples of Q, so a chunk is the same elements whatever the dp size, ZeRO stage or
    bucket) is summed in float64 by a pairwise tree; a parameter's chunks by a pairwise tree (its
    chunk count padded with zero chunks: adding zero changes no bit); the parameters, in the
    model's canonical order, by a pairwise tree; tp ranks' totals in tp-rank order. A parameter
    counts once: a tp-replicated one on tp rank 0 only, a pipeline's copy of wte on the first
    stage (Norm.view); each stage fills its parameters' places in the whole model's list,
    and the stages' lists are added -- each place non-zero on one stage only, so adding is
    picking; an expert's place likewise on the ep rank that holds it. A stack of experts is one
    place per expert (placement.per_expert: the list and order of the model with a parameter per
    expert; each slice its own Q-aligned run of the bucket), so no ep degree moves a bit."""

    def __init__(self, engine):
        super().__init__(engine)
        whole = placement.per_expert(placement.for_config(engine.model.cfg))
        self.slot = {(e.name, i): k for k, (e, i) in enumerate(whole)}
        self.expert = torch.tensor([e.expert for e, _ in whole], device=engine.device)
        self.rows = {}  # bucket -> (index into its chunk vector, with one zero appended; canonical slots)
        for b in engine.buckets:
            n_chunks = b.padded // Q
            spans, slots = [], []
            for i, (name, p) in enumerate(b.params):  # each slice (expert) of each parameter
                k, placed = b.slices[i], engine.table[name]
                size, step = p.numel() // k, stride(p.numel(), k)
                for j in range(k):
                    a = b.offsets[i] + j * step
                    spans.append((a // Q, -(-(a + size) // Q)))
                    slots.append(self.slot[name, engine.table.held(placed)[j] if placed.expert else None])
            width = 1 << max(0, (max(e - a for a, e in spans) - 1).bit_length())
            index = torch.full((len(spans), width), n_chunks, dtype=torch.long)  # n_chunks: the zero
            for i, (a, e) in enumerate(spans):
                index[i, : e - a] = torch.arange(a, e)
            self.rows[b] = (index.to(engine.device), torch.tensor(slots).to(engine.device))

    def __call__(self) -> torch.Tensor:
        e = self.e
        per_param = torch.zeros(len(self.slot), dtype=torch.float64, device=e.device)
        chunks = {b: squares(self.view(b, g)) for b, _, g in e.owned()}
        for group in dict.fromkeys(b.group for b in e.buckets):  # each reduce group's shards, gathered
            mine = [b for b in e.buckets if b.group is group]
            local = torch.cat([chunks[b] for b in mine])
            gathered = e.comm.gather_rows(local, group) if mine[0].zero >= 1 else local[None]
            col = 0
            for b in mine:
                k = (b.shard_size if b.zero >= 1 else b.padded) // Q
                # the bucket's chunks
                whole = torch.cat([gathered[:, col : col + k].reshape(-1), gathered.new_zeros(1)])
                index, slots = self.rows[b]
                per_param[slots] = pairwise_sum(whole[index].T)
                col += k
        if e.pp.size > 1:
            per_param = pairwise_sum(e.comm.gather_rows(per_param, e.pp))
        if e.ep.size > 1:  # an expert's place is filled on its ep rank only: adding is picking again
            per_param = torch.where(self.expert, e.comm.gather_rows(per_param, e.ep).sum(0), per_param)
        total = pairwise_sum(per_param)[None]
        if e.tp.size > 1:
            total = pairwise_sum(e.comm.gather_rows(total, e.tp))  # tp-rank order
        return total[0].sqrt()


def sum_partials_over_tp(engine) -> None:
    """Add the sp-partial gradients over the tp ranks, packed into one message. A gather and
    a pairwise sum in tp-rank order rather than an all-reduce: the same bits on every rank.
    The tp ranks of a replica own the same places of their buckets (the replicated parameters
    sit alike in each), so a ZeRO shard holding none of them holds none on any: nothing to add."""
    owned = [(g, engine.segments(b, lambda x: x.name in engine.partial)) for b, _, g in engine.owned()]
    pieces = [g[a:e] for g, segs in owned for a, e in segs]
    if not pieces:
        return
    flat = torch.cat(pieces)
    rows = engine.comm.gather_rows(flat, engine.tp)
    total, pos = pairwise_sum(rows), 0
    for g, segs in owned:
        for a, e in segs:
            g[a:e].copy_(total[pos : pos + e - a])
            pos += e - a
