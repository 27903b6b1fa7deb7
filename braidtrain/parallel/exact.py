"""Exact mode's sums (docs/design-notes.md, "Exact mode"): one fixed tree, whatever the layout and order.

Micro-batches. Each micro-batch's gradient lands in a fresh full-size buffer, a leaf of a binary
tree indexed by the micro-batch's number on this rank (not by when its backward ran):

      level 2             (0 1 2 3)
      level 1       (0 1)           (2 3)          node (l, i) = node (l-1, 2i) + node (l-1, 2i+1)
      level 0     0      1        2      3

Two siblings are added as soon as both exist, so backwards in order hold log2(m) + 1 buffers (a
binary counter; log2(m) with the first level folded, below), and any order gives the same tree:
IEEE addition is commutative, so only the tree's shape fixes the bits. A subtree with no leaves
(m not a power of two, possible at dp = 1 only) is absent, not zero: its sibling passes up
unchanged. The all-to-all + pairwise-sum reduce-scatter (comm.exact_reduce_scatter) then adds the
ranks' subtrees along the same tree: any power-of-two dp gives the one tree over all
micro-batches, hence the same bits -- at every ZeRO stage, which in exact mode therefore also
holds the local tree.

The first level, folded into the backward. An odd micro-batch 2k+1 whose backward starts with its
even sibling's leaf complete (backwards in order: the loop at pp 1 and each chunk of every pipeline
schedule; not a reversed or scrambled order) gets no buffer of its own: `sibling(2k+1)` hands it
leaf 2k, and autograd's accumulation adds the gradient into it (AccumulateGrad's `grad += new`; a
lean bucket's hook, tied.py's head sink: the same add) -- leaf 2k + gradient 2k+1, the addition the
tree would do, operands in its order. The bits are the tree's: the separate leaf 2k+1 would be +0 +
gradient (zeroed, then accumulated), which differs from the gradient only where it is -0, and a leaf
that began as +0 + gradient is never -0, so adding either gives the same sum. The pair's node then
enters the tree at level 1, one buffer and one pass over it fewer a pair. Where the sibling is not
complete (an odd backward before its even one) the leaf is a buffer of its own, as before; live
recovery's LiveTree and ep > 1's sourced experts (expert.py) never fold. Engine(fold=False) turns it
off for one engine (tests/test_fold.py compares the two).

Exact mode's gradient norm is parallel/norm.py's ExactNorm.
"""

from __future__ import annotations

import torch


class TreeSum:
    """The micro-batch tree of one bucket. `recycle(buf)` takes back a buffer added into another."""

    def __init__(self, recycle):
        self.nodes: dict[tuple[int, int], torch.Tensor] = {}  # (level, index) -> partial sum
        self.recycle = recycle
        self.leaves = 0
        self.folded: set[int] = set()  # this step's odd micro-batches added into their sibling's leaf
        self.lent: dict[int, torch.Tensor] = {}  # those whose backward is under way: the leaf it adds into
        self.adds = 0  # this step's additions by the tree itself (the folded ones not counted)

    def sibling(self, micro: int) -> torch.Tensor | None:
        """Odd `micro`'s complete even sibling leaf, taken out of the tree for the backward to add
        into (module docstring: the first level folded), or None: it needs a buffer of its own.
        (Asked again before add(), a buffer opened twice in one backward: the same leaf.)"""
        if micro in self.lent:
            return self.lent[micro]
        if not micro & 1 or (0, micro ^ 1) not in self.nodes:
            return None
        self.folded.add(micro)
        self.lent[micro] = self.nodes.pop((0, micro ^ 1))
        return self.lent[micro]

    def add(self, micro: int, leaf: torch.Tensor) -> None:
        """Micro-batch `micro`'s complete gradient: a leaf, or (folded) its pair's level-1 node."""
        self.leaves += 1
        level = 1 if self.lent.pop(micro, None) is not None else 0
        i, node = micro >> level, leaf
        while (level, i ^ 1) in self.nodes:
            other = self.nodes.pop((level, i ^ 1))
            left, right = (other, node) if i & 1 else (node, other)
            left.add_(right)
            self.adds += 1
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
            self.adds += 1
            self.recycle(right)
            return left

        assert self.leaves == n, f"{self.leaves} of {n} micro-batch gradients in the tree"
        root = node(max(0, (n - 1).bit_length()), 0)
        self.leaves = 0
        return root

    def clear(self) -> None:
        """A new step: drop partial sums a step that failed part-way left behind, and the counts."""
        self.nodes.clear()
        self.folded.clear()
        self.lent.clear()
        self.leaves = self.adds = 0


class Then:
    """A handle whose wait() also runs a follow-up step."""

    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def wait(self):
        self.inner.wait()
        self.fn()
