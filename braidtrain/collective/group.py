"""A process group as braidtrain uses it (`Group`), and the names flight records give groups.

Every collective of the project runs over a Group through comm.Comm; the mesh (mesh.py) makes them,
one per line of each axis, and live recovery (live/join.py) makes them again for a rebuilt world.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

def group_name(axis: str, ranks, world: int) -> str:
    """What flight records call a group: its axis alone when it is every rank of the run (replica
    under data parallelism alone, world), else the axis and its members, e.g. tp[2,3] -- the
    same on every member, and telling apart the several groups of one axis."""
    ranks = list(ranks)
    if len(ranks) == world:
        return axis
    if len(ranks) > 8 and len({b - a for a, b in zip(ranks, ranks[1:])}) == 1:  # a strided line of the mesh
        return f"{axis}[{ranks[0]}:{ranks[-1] + 1}:{ranks[1] - ranks[0]}]"
    return f"{axis}[{','.join(map(str, ranks))}]"


@dataclass(eq=False)
class Group:
    """One process group as braidtrain uses it: the mesh axis it runs along, its members (global
    ranks, in group order), this rank's index among them, torch's group (None for a group of one
    rank: nothing to exchange) and the Comm that records every operation on it. The size and
    index are plain numbers: asking torch's get_world_size at every collective cost ZeRO-3 a
    noticeable share of its host time a step (docs/performance-history.md)."""

    axis: str
    ranks: tuple[int, ...]
    index: int
    pg: object
    comm: object = field(repr=False)  # the comm.Comm that records its operations (comm.py imports this module)
    name: str = ""
    tree: tuple = ()  # the order exact sums add the members' parts in (default: group order)
    pg_ranks: tuple = ()  # the members' ranks in torch's default group, where not `ranks` (live recovery)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        """Member `index`'s rank in torch's default process group (what torch's ops name peers by):
        its rank in the job, except in a world live recovery rebuilt, which numbers its members 0..n-1."""
        return (self.pg_ranks or self.ranks)[index]


def _pg(group: Group):
    ref = group._pg
    if ref is None:
        return None
    pg = ref()
    if pg is None:
        raise RuntimeError(f"process group {group.name} was used after destroy_process_group (Runtime.close)")
    return pg


def _set_pg(group: Group, pg) -> None:
    group._pg = None if pg is None else weakref.ref(pg)


# torch's registry holds each process group, a Group only refers to it: destroy_process_group
# (Runtime.close) then frees it, and its gloo worker threads are joined while Python still runs --
# at interpreter teardown, a worker finishing a collective of ours aborts the process ("terminate
# called without an active exception", issue #55). (A property set here: the dataclass's init stays.)
Group.pg = property(_pg, _set_pg)
