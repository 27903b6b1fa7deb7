"""Buddy copies: where a lost rank's ZeRO shard survives (live recovery at ZeRO 1-3, braidtrain/live/).

Under ZeRO 1-3 each rank alone holds its shard of Adam's moments (and at ZeRO-3 of the weights).
With --live-recovery each member also keeps a copy of the next member's shard:

    members (group order)        0      1      2      3
    its own shard of a bucket    s0     s1     s2     s3
    its copy of                  s1     s2     s3     s0     (member i holds member i+1's; its buddy is i-1)

Under context parallelism the replica group is the dp*cp ranks (d, c) in rank order, and the copy
of a shard skips the rest of its replica (stride cp: member i holds member i+cp's, the same cp rank
of the next replica): a lost replica -- all of its cp ranks -- then takes no shard with its copy.

The copy is not sent again every step. Each step, once the gradients are reduced, each member
sends its reduced gradient shards to its buddy and receives the next member's (exchange: one
message each way, all buckets packed), and applies to its copy the update the next member applies
to the original: the same fused AdamW kernels with the same step scalars, on a shard of the same
length and alignment (a multiple of Q) -- elementwise, so the copy stays bitwise equal to the
original (optim.AdamW.apply). ZeRO-1/2 keep the whole parameters on every rank: the copy is m and
v, and its update writes the next member's range of the parameters, which the all-gather then
writes again with the same bits. ZeRO-3, and a lean state's bf16 buckets (whose fp32 master is
sharded: parallel/buckets.py): the copy also holds the neighbour's fp32 master shard.
Memory: 2 (ZeRO-1/2) or 3 (ZeRO-3) shards more and the received gradient shard; the planner counts
them (plan/memory.py model_state_bytes, live=True).

When the members change, every shard of the old layout still has a holder -- its owner, or if the
owner was lost, its buddy (a rank lost together with its buddy leaves a shard nobody holds: the
restart path). reshard then lays every bucket out afresh over the new members, as a run started on
them would (Bucket.relayout), one bucket at a time:

    old layout, 4 members, rank 2 lost          new layout, 3 members
    [ s0 | s1 | s2 | s3 ]  holders 0 1 1 3  ──►  [ s0' | s1' | s2' ]
      each old shard broadcast by its holder: (params, m, v) of the bucket whole on every member
      for a moment; each member keeps its new shard and its new neighbour's copy

The state is layout-independent (elementwise optimizer, shards at multiples of Q), so the result
is what a run on the new members would hold. Every member hashes what it assembled (sha256); the
hashes must agree, or the joiner leaves / the members fall back to the restart path.
"""

from __future__ import annotations

import hashlib
import math

import torch

from braidtrain.parallel.buckets import Q


class Mirror:
    """This rank's copy of the next member's shards (module docstring). `init`: each bucket's (params,
    m, v) of that shard, as reshard assembled them; without it, zeros until fill()."""

    def __init__(self, engine, opt, group, init: list | None = None, stride: int = 1):
        self.e, self.opt, self.group, self.stride = engine, opt, group, stride
        n, i = group.size, group.index
        self.next, self.prev = (i + stride) % n, (i - stride) % n  # (stride: cp, below)
        self.copies = []  # per bucket: (params, m, v, decay ranges) of the next member's shard
        dev, sizes = engine.device, [b.shard_size for b in engine.buckets]
        self.grads = torch.zeros(sum(sizes), device=dev)  # the next member's reduced gradient shards
        self.g = list(self.grads.split(sizes))
        for k, b in enumerate(engine.buckets):
            lo, hi = self.next * b.shard_size, (self.next + 1) * b.shard_size
            p, m, v = init[k] if init else (None, torch.zeros(hi - lo, device=dev), torch.zeros(hi - lo, device=dev))
            if b.zero <= 2 and not b.apart:  # the whole fp32 parameters are here: the copy's are a view of them
                p = b.data[lo:hi]
            elif p is None:
                p = torch.zeros(hi - lo, device=dev)
            self.copies.append((p, m, v, engine.decay_segments(b, (lo, hi))))

    def own(self, k: int, b) -> tuple:
        """(fp32 master, m, v) of this rank's own shard of bucket k."""
        m, v, _ = self.opt.groups[k]
        return b.master, m, v

    def fill(self) -> None:
        """Take the next member's shards from it, once (the job's start, a resume): afterwards the
        copy follows by updates alone."""
        mine = torch.cat([t for k, b in enumerate(self.e.buckets) for t in self.own(k, b)])
        got = torch.empty_like(mine)
        self._to_buddy(mine, got)
        pos = 0
        for p, m, v, _ in self.copies:
            for t in (p, m, v):
                t.copy_(got[pos : pos + t.numel()])
                pos += t.numel()

    def exchange(self) -> None:
        """After the step's reductions: this rank's reduced gradient shards to its buddy, the next
        member's into the copy's gradient (one send/receive)."""
        self._to_buddy(torch.cat([g for _, _, g in self.e.owned()]), self.grads)

    def _to_buddy(self, mine, got) -> None:
        """`mine` to the member before, `got` from the one after: an all-to-all in which only those
        two parts are not empty (a point-to-point send and receive that live recovery can abandon:
        gloo's own, waited for with a timeout, close the connection -- torch 2.13)."""
        send, recv = [0] * self.group.size, [0] * self.group.size
        send[self.prev], recv[self.next] = mine.numel(), got.numel()
        self.e.comm.all_to_all_v(got, mine, recv, send, self.group).wait()

    def update(self, grad_scale=None, skip=None) -> None:
        """The update the next member applies to its shards (AdamW.apply: the same kernels, the same bits)."""
        self.opt.apply([c[0] for c in self.copies], self.g, [c[1:] for c in self.copies], grad_scale, skip)

    def bytes(self) -> int:
        """What the copy adds to this rank: m, v, the received gradient (and ZeRO-3's parameters)."""
        own = sum(t.numel() for p, m, v, _ in self.copies for t in (m, v))
        params = sum(p.numel() for (p, *_), b in zip(self.copies, self.e.buckets) if b.zero == 3 or b.apart)
        return 4 * (own + params + self.grads.numel())

    def holdings(self) -> dict[int, list[tuple]]:
        """Old group index -> each bucket's (params, m, v) of that shard here: this rank's own and its copy."""
        own = [self.own(k, b) for k, b in enumerate(self.e.buckets)]
        return {self.group.index: own, self.next: [c[:3] for c in self.copies]}


def holders(old: list[int], new: list[int], stride: int = 1) -> dict[int, int] | str:
    """Old group index -> the new group index of the member that holds its shard (its owner, else
    its buddy); or the line that says why some shard has none."""
    out = {}
    for j, r in enumerate(old):
        buddy = old[(j - stride) % len(old)]
        if r in new:
            out[j] = new.index(r)
        elif buddy in new and buddy != r:
            out[j] = new.index(buddy)
        else:
            return (f"rank {r}'s shard of the sharded optimizer state had its one copy on rank {buddy}, lost with it"
                    if buddy != r else f"rank {r} held the only copy of its shard")
    return out


def reshard(engine, opt, comm, group, old_n: int, held: dict, holder: dict, stride: int = 1) -> tuple[Mirror, str]:
    """Every bucket laid out over `group` (module docstring): old shard j broadcast by the member
    `holder[j]` (this rank's holdings `held`), the bucket's (params, m, v) assembled whole, this
    rank's new shard and its new neighbour's copy kept; the engine's buffers sized again. Returns
    the new Mirror and the sha256 of everything assembled (the same on every member, or a copy went bad)."""
    h = hashlib.sha256()
    me, n = group.index, group.size
    nxt = (me + stride) % n
    init = []
    for k, b in enumerate(engine.buckets):
        S = math.ceil(b.numel / (old_n * Q)) * Q  # the old layout's shard
        padded = math.ceil(b.numel / (n * Q)) * n * Q  # the new layout's bucket
        whole = torch.zeros(3, max(old_n * S, padded), device=engine.device)  # params, m, v
        piece = torch.empty(3, S, device=engine.device)
        for j in range(old_n):
            if holder[j] == me:
                for row, t in zip(piece, held[j][k]):
                    row.copy_(t)
            comm.broadcast(piece, group, holder[j]).wait()
            h.update(piece.cpu().numpy().tobytes())
            whole[:, j * S : (j + 1) * S] = piece
        b.relayout(group, whole[0])
        lo, hi, S2 = b.lo, b.hi, b.shard_size
        opt.groups[k] = (whole[1, lo:hi].clone(), whole[2, lo:hi].clone(), engine.decay_segments(b))
        p, m, v = (whole[r, nxt * S2 : (nxt + 1) * S2].clone() if r or b.zero == 3 or b.apart else None
                   for r in range(3))
        init.append((p, m, v))
    engine.laid_out_again()
    return Mirror(engine, opt, group, init, stride), h.hexdigest()
