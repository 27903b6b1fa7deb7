"""Replicas: what a lost rank takes out when the layout has pp, tp or cp > 1, and the world rebuilt
over the ranks left (live recovery, trainer.py).

The mesh numbers rank = ((p*D + d)*cp + c)*tp + t (collective/mesh.py: pp, dp, cp, tp, outer to inner).
A replica is a dp index d: its pp*cp*tp ranks hold one copy of the model between them and read the
same sequences. A tp, pp or cp rank's part of it -- its shard, stage or chunk of the sequence -- is
nowhere else in its replica, so losing it retires the whole replica:

      dp 2 x tp 2                            rank 3 lost: replica 1 retired
      replica 0: ranks 0 1  (a tp group)       rank 2 leaves in one line (exit 0: EXIT_RETIRED)
      replica 1: ranks 2 3                     ranks 0 1 go on as dp 1 x tp 2, in the same processes,
      dp groups: {0,2} {1,3}                   replica 1's micro-batches divided among the replicas left

Every data-parallel group -- the replica group of each (pp, tp) coordinate, its dp*cp ranks --
loses its members of the same replicas, so each runs a lost dp rank's logic at once: the orphaned
slots' micro-batches shared out by replica (redo.py), the sums by global number, and at ZeRO 1-3
the buddy copies, which live within each group (under cp a shard's copy is in the next replica,
not the next cp rank: parallel/mirror.py's stride). The tp, pp and cp groups of the replicas left
keep their members; they are made again as process groups over the new world (rebuild), and the
tp and cp Group objects that the model's layers hold are refilled in place.

Not recovered live (the restart path, one line): a loss in replica 0 (rank 0 would have to leave,
and its process hosts the store); expert parallelism, refused up front (trainer.check_config).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from braidtrain.build import ring
from braidtrain.collective.fault import say
from braidtrain.collective.mesh import build_mesh
from braidtrain.live.members import ranks
from braidtrain.parallel import mirror
from braidtrain.parallel.buckets import Q

EXIT_RETIRED = 0  # a rank of a retired replica: it did its part, the job goes on (docs/fault-tolerance.md)
_leaked = []  # the process groups given up: never destroyed (their threads may wait on a dead peer)


@dataclass(frozen=True)
class Grid:
    """The job's first grid: a rank's replica and coordinates, whatever the world is now."""

    pp: int
    dp: int
    cp: int
    tp: int

    @property
    def alone(self) -> bool:
        """Data parallelism alone: a rank is its replica."""
        return self.pp == self.cp == self.tp == 1

    def replica(self, r: int) -> int:
        return r // (self.cp * self.tp) % self.dp

    def cp_rank(self, r: int) -> int:
        return r // self.tp % self.cp

    def slot(self, r: int) -> tuple[int, int]:
        """(pp, tp) coordinates: the ranks of one slot are a replica group (the dp*cp ranks)."""
        return r // (self.dp * self.cp * self.tp), r % self.tp

    def counts_loss(self, r: int) -> bool:
        """Whether r's loss sums count: the last stage's, at tp 0 (passes.reduce_loss's)."""
        return self.slot(r) == (self.pp - 1, 0)

    def group(self, ids: list[int], r: int) -> list[int]:
        """r's replica group among the ranks ids."""
        return [x for x in ids if self.slot(x) == self.slot(r)]


class Replicas:
    """LiveTrainer's side of replicas (a mixin: it reads the trainer's grid, ids, replicas, mesh,
    engine, mirror and layout)."""

    def unrecoverable(self, old: list[int], ids: list[int], lost: dict) -> str | None:
        """Why the job cannot go on over `ids` (old: the members before, lost: the ranks lost), or None."""
        g, left = self.grid, {self.grid.replica(r) for r in ids}
        if not g.alone and g.replica(0) not in left:
            return (f"{'it retires' if len(lost) == 1 else 'they retire'} replica 0, and its rank 0, which hosts "
                    f"the rendezvous store, cannot leave")
        if self.mirror is None:
            return None
        if len(left) < 2:
            one = "one rank" if g.alone else "one replica"
            return (f"{one} would be left, and ZeRO-{self.cfg.zero} on {one} is ZeRO-0's layout, which live "
                    f"recovery does not switch to")
        me = self.rt.rank
        held = mirror.holders(g.group(old, me), g.group(ids, me), g.cp)
        return held if isinstance(held, str) else None

    def promoted(self, old: list[int], lost: dict) -> str:
        """ZeRO 1-3: whose copies took the lost shards' place (for the membership log)."""
        if self.mirror is None:
            return ""
        g, z = self.grid, self.cfg.zero
        if g.alone:
            copies = ", ".join(f"rank {old[(old.index(r) - 1) % len(old)]}'s copy of rank {r}'s" for r in sorted(lost))
            return f"{copies} ZeRO-{z} shard promoted and the state re-sharded over {len(self.ids)} ranks, "
        was = sorted({g.replica(r) for r in old})
        gone = sorted({g.replica(r) for r in lost})
        copies = ", ".join(f"replica {was[was.index(d) - 1]}'s copies of replica {d}'s" for d in gone)
        return f"{copies} ZeRO-{z} shards promoted and the state re-sharded over {len(self.replicas)} replicas, "

    def retired(self, lost: dict, leaving: list[int]) -> str:
        """The retired replicas, for the membership log: 'replica 1 retired (rank 2 leaves)'."""
        g = self.grid
        return "; ".join(f"replica {d} retired" + (f" ({ranks(go)} leave{'s' if len(go) == 1 else ''})" if go else "")
                         for d in sorted({g.replica(r) for r in lost})
                         for go in [[r for r in leaving if g.replica(r) == d]])

    def leave(self, lost: dict, ids: list[int]) -> None:
        """This rank's replica was retired: one line, a clean goodbye to the heartbeat, exit."""
        me, g = self.rt.rank, self.grid
        d = g.replica(me)
        why = [r for r in lost if g.replica(r) == d]
        say(f"braidtrain: rank {me}: its replica (data-parallel index {d}) was retired because {ranks(why)} "
            f"{'was' if len(why) == 1 else 'were'} lost; ranks {','.join(map(str, ids))} go on without it; exiting")
        sys.stdout.flush()
        self.guard.close(clean=True)  # (hb/RANK = done: its peers stop watching it)
        os._exit(EXIT_RETIRED)

    def rebuild(self, epoch: int, ids: list[int]) -> None:
        """The process group, mesh and engine's groups over `ids`, and the step's work divided
        among them; what the abandoned step left behind is dropped. (ZeRO 1-3: reshard then lays
        the buckets out over them.)"""
        rt, me, n, lay = self.rt, self.rt.rank, len(ids), self.layout
        # the old groups' worker threads may still wait on the lost peer: never destroyed
        _leaked.extend([dist.group.WORLD, *(g.pg for g in [*self.mesh.groups.values(), *self.mesh.p2p.values()])])
        dist.destroy_process_group()
        dist.init_process_group(rt.backend, store=dist.PrefixStore(f"live/{epoch}/pg", rt.store), rank=ids.index(me),
                                world_size=n, timeout=timedelta(seconds=self.cfg.timeout))
        comm = self.comm
        comm.records.clear(), comm.gseq.clear(), comm.members.clear()  # (the old world's are in its flight logs)
        comm.step_handles = []
        mesh = build_mesh(me, n, comm, pp=lay.pp, cp=lay.cp, tp=lay.tp, ep=lay.ep, new_group=rt.new_group,
                          ring=ring(lay, True), members=ids)
        for axis in ("tp", "cp"):  # the model's layers (and cp's Context) hold these very objects
            held = self.mesh.groups[axis]
            vars(held).update(vars(mesh.groups[axis]))
            mesh.groups[axis] = held
        self.mesh = self.built.mesh = self.passes.mesh = mesh
        e = self.engine
        e.tp, e.pp, e.world, e.ep, e.p2p = (*(mesh.groups[a] for a in ("tp", "pp", "world", "ep")), mesh.p2p)
        for b in e.buckets:
            b.group, b.handle = mesh.groups[b.group.axis], None
            if b.zero == 0:  # the checkpoint's pieces of each rank; the gradient buffer afresh
                b.shard_size = -(-b.padded // (b.group.size * Q)) * Q
                at = b.group.index * b.shard_size
                b.lo, b.hi = min(b.padded, at), min(b.padded, at + b.shard_size)
                b.grad = None if e.exact else torch.zeros(b.padded, device=e.device)
        e.pending = []
        e.grads.reset()  # buffers the old group's threads may still write into are not reused
        e.tied.handle = e.tied.head_sum = e.tied.head_out = None
        rt.world_size = n
        self.layout = self.built.layout = dataclasses.replace(lay, dp=n // (lay.pp * lay.cp * lay.tp))
        with self.lock:
            self.ids, self.epoch, self.joined = ids, epoch, {}
            self.replicas = sorted({self.grid.replica(r) for r in ids})
            self.comm.abort.clear()
            self.noticed, self.recovering, self.cause = None, False, None
        self.guard.watch(ids)
        self.redivide()
