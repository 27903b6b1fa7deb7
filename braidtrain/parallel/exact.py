"""Exact mode's sums (docs/design-notes.md, "Exact mode"): one fixed tree, whatever the layout and order.

Micro-batches. Each micro-batch's gradient lands in a fresh full-size buffer, a leaf of a binary
tree indexed by the micro-batch's number on this rank (not by when its backward ran):

      level 2             (0 1 2 3)
      level 1       (0 1)           (2 3)          node (l, i) = node (l-1, 2i) + node (l-1, 2i+1)
      level 0     0      1        2      3

Two siblings are added as soon as both exist, so backwards in order hold log2(m) + 1 buffers (a
binary counter), and any order gives the same tree: IEEE addition is commutative, so only the
tree's shape fixes the bits. A subtree with no leaves (m not a power of two, possible at dp = 1
only) is absent, not zero: its sibling passes up unchanged. The all-to-all + pairwise-sum
reduce-scatter (comm.exact_reduce_scatter) then adds the ranks' subtrees along the same tree:
any power-of-two dp gives the one tree over all micro-batches, hence the same bits -- at every
ZeRO stage, which in exact mode therefore also holds the local tree.

The gradient norm is summed in float64 over each parameter's Q-element chunks with pairwise trees
(ExactNorm), so it depends neither on where shard boundaries fall nor on which bucket -- or, with
a pipeline, which stage -- holds a parameter.
"""

from __future__ import annotations

import torch

from braidtrain.dist.comm import pairwise_sum
from braidtrain.parallel import placement
from braidtrain.parallel.buckets import Q, stride


class TreeSum:
    """The micro-batch tree of one bucket. `recycle(buf)` takes back a buffer added into another."""

    def __init__(self, recycle):
        self.nodes: dict[tuple[int, int], torch.Tensor] = {}  # (level, index) -> partial sum
        self.recycle = recycle
        self.leaves = 0

    def add(self, micro: int, leaf: torch.Tensor) -> None:
        self.leaves += 1
        level, i, node = 0, micro, leaf
        while (level, i ^ 1) in self.nodes:
            other = self.nodes.pop((level, i ^ 1))
            left, right = (other, node) if i & 1 else (node, other)
            left.add_(right)
            self.recycle(right)
            level, i, node = level + 1, i >> 1, left
        self.nodes[(level, i)] = node

    def total(self, n: int) -> torch.Tensor:
        """The root over micro-batches 0..n-1 (all added), folding the absent subtrees away."""
        def node(level, i):
            if (level, i) in self.nodes:
                return self.nodes.pop((level, i))
            if level == 0 or i << level >= n:  # no leaf below: absent
                return None
            left, right = node(level - 1, 2 * i), node(level - 1, 2 * i + 1)
            if right is None:
                return left
            left.add_(right)
            self.recycle(right)
            return left

        assert self.leaves == n, f"{self.leaves} of {n} micro-batch gradients in the tree"
        root = node(max(0, (n - 1).bit_length()), 0)
        self.leaves = 0
        return root

    def clear(self) -> None:
        """Drop partial sums a step that failed part-way left behind."""
        self.nodes.clear()
        self.leaves = 0


class ExactNorm:
    """The exact global gradient norm, the same bits in every layout of a tp degree: each Q-element
    chunk of a parameter (parameters start at multiples of Q in their buckets, and shards split
    buckets at multiples of Q, so a chunk is the same elements whatever the dp size, ZeRO stage or
    bucket) is summed in float64 by a pairwise tree; a parameter's chunks by a pairwise tree (its
    chunk count padded with zero chunks: adding zero changes no bit); the parameters, in the
    model's canonical order, by a pairwise tree; tp ranks' totals in tp-rank order. A parameter
    counts once: a tp-replicated one on tp rank 0 only, a pipeline's copy of wte on the first
    stage (Engine.norm_view); each stage fills its parameters' places in the whole model's list,
    and the stages' lists are added -- each place non-zero on one stage only, so adding is
    picking; an expert's place likewise on the ep rank that holds it. A stack of experts is one
    place per expert (placement.per_expert: the list and order of the model with a parameter per
    expert; each slice its own Q-aligned run of the bucket), so no ep degree moves a bit."""

    def __init__(self, engine):
        self.e = engine
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
        chunks = {b: pairwise_sum(e.norm_view(b, g).double().pow(2).view(-1, Q).T) for b, _, g in e.owned()}
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
