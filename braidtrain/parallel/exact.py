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


class Then:
    """A handle whose wait() also runs a follow-up step."""

    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def wait(self):
        self.inner.wait()
        self.fn()
