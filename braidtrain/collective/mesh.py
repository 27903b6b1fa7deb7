"""The n-D device mesh: axes pp, dp, cp, tp (outer to inner), one process group per axis.

The rank grid is an explicit tensor, arange(world).reshape(pp, dp, cp, tp). tp is innermost, so a
tensor-parallel group is a run of consecutive ranks -- consecutive local GPUs, the fastest links.
A rank's coordinate on an axis is its index along that dim of the grid; its group on an axis is the
line through it along that dim.

      world = 8, pp=1 dp=2 cp=1 tp=4          dp groups: {0,4} {1,5} {2,6} {3,7}
      dp=0:  [0 1 2 3]  <- one tp group       tp groups: {0,1,2,3} {4,5,6,7}
      dp=1:  [4 5 6 7]

The *replica* group of a parameter -- the ranks that sum its gradient and share its ZeRO
shards -- is the dp*cp ranks with the same (pp, tp) coordinates, in rank order (torch orders a
group's members so). Exact mode adds their gradients along one tree in cp-major order instead
(the group's `tree`): with cp outermost, one cp rank's replicas over dp are a subtree, as one
rank's micro-batches are at dp 1, so the bits do not depend on dp at a fixed cp.

Expert parallelism carves its ep groups from the replicas: consecutive runs of ep members in that
tree order (at cp 1, ep consecutive dp ranks), whose all-to-all carries the tokens
(parallel/expert.py); ep rank k of each run holds the same experts, and those dp*cp/ep ranks are
the *expert* group that reduces their gradients (in run order, a subtree of the replicas' tree
per run). At ep 1 the expert group is the replica group. `world` is every rank (barriers, the run's small agreements).

Pipeline transfers run between neighbouring ranks of a pp line, each direction on a process
group of its own (`p2p[(from, to)]`, by pp index): NCCL keeps one stream per group, so a send
never queues behind a receive going the other way (parallel/pipeline.py's deadlock check rests on
that). `ring` adds the pair from the last stage back to the first (interleaved schedules).

The degrees come validated (layout.py); this file only lays the grid out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from braidtrain.collective.comm import Comm
from braidtrain.collective.group import Group, group_name

AXES = ("pp", "dp", "cp", "tp")


@dataclass
class Mesh:
    sizes: dict[str, int]  # pp, dp, cp, tp
    coords: dict[str, int]
    groups: dict[str, Group]  # pp, dp, cp, tp, replica, ep, expert, world: this rank's group along each
    rank: int = 0
    p2p: dict = field(default_factory=dict)  # (from, to) pp indices -> the group of that direction

    def size(self, axis: str) -> int:
        return self.groups[axis].size

    def coord(self, axis: str) -> int:
        return self.coords[axis] if axis in self.coords else self.groups[axis].index

    def loss_ranks(self) -> slice:
        """The ranks whose loss counts: the last pipeline stage's with tp coordinate 0 (every tp
        rank holds the same full sum), in rank order -- that is, by (dp, cp) coordinate. A slice
        of the world's ranks (every tp-th of the last stage's), so that picking their rows out of
        a device tensor needs no index copied to the device."""
        pp, dp, cp, tp = (self.sizes[a] for a in AXES)
        first = (pp - 1) * dp * cp * tp
        return slice(first, first + dp * cp * tp, tp)


def build_mesh(rank: int, world: int, comm: Comm, *, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, new_group=None,
               ring: bool = False, members: list[int] | None = None) -> Mesh | None:
    """Every rank must call this with the same degrees: new_group is collective over the world.
    `new_group(ranks, axis)` makes one line's process group (runtime.Runtime.new_group: the run's
    timeout, the axis's NCCL stream priority; default torch's own). Lines with the same members
    share one process group. `members`: the mesh over these ranks only (tests run several layouts
    in one process group; a rank outside them joins the new_group calls and gets None)."""
    members = list(range(world)) if members is None else list(members)
    full = dist.get_world_size() if dist.is_initialized() else 1
    world = len(members)
    assert world % (pp * cp * tp) == 0, (world, pp, cp, tp)  # layout.py said so already
    sizes = {"pp": pp, "dp": world // (pp * cp * tp), "cp": cp, "tp": tp}
    grid = torch.tensor(members).reshape(*(sizes[a] for a in AXES))
    coords = dict(zip(AXES, (grid == rank).nonzero()[0].tolist())) if rank in members else {}
    lines = {axis: grid.movedim(d, -1).reshape(-1, sizes[axis]).tolist() for d, axis in enumerate(AXES)}
    # replica lines: ranks sharing (pp, tp), varying (dp, cp), in rank order
    lines["replica"] = grid.permute(0, 3, 1, 2).reshape(-1, sizes["dp"] * sizes["cp"]).tolist()
    tree = tuple(d * cp + c for c in range(cp) for d in range(sizes["dp"]))  # its members cp-major
    n, orders = sizes["dp"] * cp, {}
    lines["ep"], lines["expert"] = [], []
    for line in lines["replica"]:  # runs of ep replicas in tree order; rank k of each run: the same experts
        ordered = [line[i] for i in tree]
        runs = [ordered[j : j + ep] for j in range(0, n, ep)]
        same = [[sorted(run)[k] for run in runs] for k in range(ep)]
        for group in runs + same:  # a group's members in rank order (torch's), its exact order kept
            orders[tuple(sorted(group))] = tuple(sorted(group).index(g) for g in group)
        lines["ep"] += [sorted(run) for run in runs]
        lines["expert"] += [sorted(g) for g in same]
    lines["world"] = [members]
    # a world live recovery rebuilt numbers its members 0..n-1 in torch's default group
    renumbered = full == world and members != list(range(full))
    pg = {r: members.index(r) if renumbered else r for r in members}
    made: dict[tuple, object] = {}
    groups = {}
    for axis, axis_lines in lines.items():
        for line in axis_lines:
            key = tuple(line)
            # new_group must be entered by all ranks for every line, in the same order
            if key not in made:
                if len(line) == 1:
                    made[key] = None
                elif len(line) == full:
                    made[key] = dist.group.WORLD
                else:
                    ranks = [pg[r] for r in line]
                    made[key] = new_group(ranks, axis) if new_group else dist.new_group(ranks)
            if rank in line:
                order = tree if axis == "replica" else orders[key] if axis in ("ep", "expert") else ()
                groups[axis] = Group(axis, key, line.index(rank), made[key], comm, group_name(axis, line, world), order,
                                     tuple(pg[r] for r in line) if renumbered else ())
    p2p = {}
    for line in lines["pp"]:  # each direction between neighbours, a group of its own
        pairs = [(i, i + 1) for i in range(pp - 1)] + ([(pp - 1, 0)] if ring and pp > 1 else [])
        for i, j in dict.fromkeys(d for a, b in pairs for d in ((a, b), (b, a))):
            ranks = (line[i], line[j])
            pair = [pg[r] for r in ranks]  # (not `members`: the mesh's own, read below)
            made_pg = new_group(pair, "pp") if new_group else dist.new_group(sorted(pair))
            if rank in ranks:
                p2p[(i, j)] = Group("pp", ranks, ranks.index(rank), made_pg, comm, f"pp[{ranks[0]}>{ranks[1]}]",
                                    pg_ranks=tuple(pg[r] for r in ranks) if renumbered else ())
    return Mesh(sizes, coords, groups, rank, p2p) if rank in members else None
