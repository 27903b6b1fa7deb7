"""A step's micro-batches by global number, over whichever ranks are left (live recovery, live/redo.py).

A run that began with D data ranks numbers a step's micro-batches g = slot * m + j (slot r: the
ones rank r reads). When ranks are missing, the others share the orphaned slots' micro-batches
(shares) and the step's sums must come out as the uninterrupted run's: exact mode's one tree over
the micro-batches (parallel/exact.py), and the loss's pairwise tree in global order. Each rank sums
the complete subtrees of what it ran (LiveTree), the ranks' subtrees meet by slices (reduce_forests):

      rank 0: slot 0 (0 1 2 3) + (12 13)      rank 2: slot 2 (8 9 10 11) + (15)
      rank 1: slot 1 (4 5 6 7) + (14)         (slot 3 lost: its 12..15 shared out)
      subtrees: (0-3) (12-13) | (4-7) (14) | (8-11) (15)  --fold-->  ((0-3 4-7) (8-11 (12-13 (14 15))))

IEEE addition is commutative, so a node's bits depend only on the tree's shape, never on which
rank added it.
"""

from __future__ import annotations

import torch

from braidtrain.collective.comm import pairwise_sum


def shares(ids: list[int], slots: int, m: int) -> dict[int, list[int]]:
    """rank -> the global micro-batches it runs: its own slot's, then a contiguous share of the
    slots nobody holds (ids: the members, their slot their rank)."""
    orphans = [g for s in range(slots) if s not in ids for g in range(s * m, (s + 1) * m)]
    q, r = divmod(len(orphans), len(ids))
    cuts = [k * q + min(k, r) for k in range(len(ids) + 1)]
    return {i: list(range(i * m, (i + 1) * m)) + orphans[cuts[k] : cuts[k + 1]] for k, i in enumerate(ids)}


def forest(micros) -> list[tuple[int, int]]:
    """The complete subtrees (level, index) that a rank holding these leaves sums locally: what
    LiveTree leaves behind, sorted."""
    nodes = set()
    for g in micros:
        level, i = 0, g
        while (level, i ^ 1) in nodes:
            nodes.remove((level, i ^ 1))
            level, i = level + 1, i >> 1
        nodes.add((level, i))
    return sorted(nodes)


def fold(pieces: dict, n_leaves: int):
    """The root of the tree over n_leaves leaves from disjoint complete subtrees (level, index) ->
    tensor, added in place as parallel/exact.py's TreeSum adds: node = left + right."""
    def node(level, i):
        if (level, i) in pieces:
            return pieces.pop((level, i))
        if level == 0 or i << level >= n_leaves:
            return None
        left, right = node(level - 1, 2 * i), node(level - 1, 2 * i + 1)
        if right is None:
            return left
        return left.add_(right)

    return node(max(0, (n_leaves - 1).bit_length()), 0)


class LiveTree:
    """A bucket's micro-batch tree whose leaves are the rank's global micro-batch numbers (`micros`,
    by local number): siblings add as soon as both are here, as in TreeSum; total() leaves the
    complete subtrees (forest(micros)) for the reduction to fold with the other ranks'."""

    def __init__(self, pool, micros: list[int], pending: dict):  # (pool: the engine's grads.Grads)
        self.e, self.micros, self.pending = pool, micros, pending
        self.nodes: dict[tuple[int, int], torch.Tensor] = {}
        self.leaves = 0

    def sibling(self, micro: int) -> None:
        """A live tree does not fold its first level into the backward (exact.py): no sibling."""
        return None

    def add(self, micro: int, leaf: torch.Tensor) -> None:
        if micro >= len(self.micros):  # a pass run only to keep the collectives in step (live/redo.py)
            self.e.recycle(leaf)
            return
        self.leaves += 1
        level, i, node = 0, self.micros[micro], leaf
        while (level, i ^ 1) in self.nodes:
            other = self.nodes.pop((level, i ^ 1))
            left, right = (other, node) if i & 1 else (node, other)
            left.add_(right)
            self.e.recycle(right)
            level, i, node = level + 1, i >> 1, left
        self.nodes[(level, i)] = node

    def total(self, n: int) -> torch.Tensor:
        """A buffer the reduction fills with the whole step's sum; the subtrees wait in `pending`."""
        assert self.leaves == len(self.micros) <= n, (self.leaves, n, len(self.micros))
        root = self.e.take(next(iter(self.nodes.values())).numel())
        self.pending[id(root)] = self.nodes
        self.nodes, self.leaves = {}, 0
        return root

    def clear(self) -> None:
        self.nodes.clear()
        self.leaves = 0


def sum_by_number(comm, group, ids: list[int], values: list[torch.Tensor], plan: dict, total: int) -> float:
    """Numbered scalars (this rank's `values`, in its plan's order) from every member of `group`
    (ids, in group order), summed by a pairwise tree in global order -- passes.reduce_loss's sum
    when each rank holds one slot."""
    k = max(len(g) for g in plan.values())
    mine = torch.zeros(k, dtype=torch.float64, device=comm.device)
    if values:
        mine[: len(values)] = torch.stack(values).double()
    rows = comm.gather_rows(mine, group)
    whole = torch.zeros(total, dtype=torch.float64, device=comm.device)
    for r, i in enumerate(ids):
        whole[plan[i]] = rows[r, : len(plan[i])]
    return pairwise_sum(whole).item()


def reduce_forests(comm, group, ids: list[int], keys: dict, me: int, nodes: dict, n_leaves: int, out,
                   whole: bool = True) -> None:
    """Every member's complete subtrees (keys[rank]: (level, index), this rank's tensors in
    `nodes`) summed along the one tree over n_leaves leaves: each subtree sliced by rank (one
    all-to-all: rank j receives slice j of all of them), each slice folded; into `out` the slices
    all-gathered (whole), or this rank's slice alone -- its shard, when the size is a multiple of
    the members (ZeRO 1-3: the bucket laid out over them)."""
    n = group.size
    mine = [nodes[k] for k in keys[me]]
    P = mine[0].numel()
    S = -(-P // n)
    send = torch.zeros(n, len(mine), S, device=out.device)
    for j in range(n):
        lo, hi = j * S, min(P, (j + 1) * S)
        for c, t in enumerate(mine):
            send[j, c, : max(0, hi - lo)] = t[lo:hi]
    counts = [len(keys[i]) for i in ids]
    recv = torch.empty(sum(counts), S, device=out.device)
    comm.all_to_all_v(recv, send.view(n * len(mine), S), counts, [len(mine)] * n, group).wait()
    row, pieces = 0, {}
    for i in ids:
        for k in keys[i]:
            pieces[k], row = recv[row], row + 1
    part = fold(pieces, n_leaves)
    if not whole:
        out.copy_(part)
        return
    gathered = torch.empty(n * S, device=out.device)
    comm.all_gather(gathered, part.contiguous(), group).wait()
    out.copy_(gathered[:P])
