"""The n-D device mesh: axes pp, dp, cp, tp (outer to inner), one process group per axis.

The rank grid is an explicit tensor, arange(world).reshape(pp, dp, cp, tp). tp is innermost, so a
tensor-parallel group is a run of consecutive ranks -- consecutive local GPUs, the fastest links.
A rank's coordinate on an axis is its index along that dim of the grid; its group on an axis is the
line through it along that dim.

      world = 8, pp=1 dp=2 cp=1 tp=4          dp groups: {0,4} {1,5} {2,6} {3,7}
      dp=0:  [0 1 2 3]  <- one tp group       tp groups: {0,1,2,3} {4,5,6,7}
      dp=1:  [4 5 6 7]

The *replica* group of a parameter -- the ranks that average its gradient and share its ZeRO
shards -- is the dp*cp ranks with the same (pp, tp) coordinates. Expert parallelism (later) shards
experts over those same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from braidtrain.errors import UserError

AXES = ("pp", "dp", "cp", "tp")


def mesh_shape(world: int, pp: int = 1, dp: int | None = None, cp: int = 1, tp: int = 1) -> dict[str, int]:
    """Validated axis sizes; dp = world / (pp*cp*tp) unless given."""
    for name, size in (("pp", pp), ("cp", cp), ("tp", tp)):
        if size < 1:
            raise UserError(f"{name}={size}: every parallel degree must be >= 1")
    inner = pp * cp * tp
    if dp is None:
        if world % inner:
            raise UserError(
                f"world size {world} is not divisible by pp*cp*tp = {pp}*{cp}*{tp} = {inner}: "
                f"use a world size that is a multiple of {inner}, or change the degrees"
            )
        dp = world // inner
    if dp < 1 or pp * dp * cp * tp != world:
        raise UserError(f"pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} = {pp * dp * cp * tp} does not match the world size {world}")
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}


@dataclass
class Mesh:
    sizes: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, object]  # axis (or "replica") -> process group, None where world size is 1
    ranks: dict[str, list[int]]  # axis -> global ranks of this rank's group, in axis order

    def size(self, axis: str) -> int:
        return len(self.ranks[axis])

    def coord(self, axis: str) -> int:
        return self.coords[axis] if axis in self.coords else self.ranks[axis].index(self.rank)

    rank: int = 0


def build_mesh(rank: int, world: int, **degrees) -> Mesh:
    """Every rank must call this with the same degrees: new_group is collective over the world."""
    sizes = mesh_shape(world, **degrees)
    grid = torch.arange(world).reshape(*(sizes[a] for a in AXES))
    where = (grid == rank).nonzero()[0].tolist()
    coords = dict(zip(AXES, where))
    lines = {}
    for d, axis in enumerate(AXES):
        lines[axis] = grid.movedim(d, -1).reshape(-1, sizes[axis]).tolist()
    # replica lines: ranks sharing (pp, tp), varying (dp, cp), in dp-major order
    lines["replica"] = grid.permute(0, 3, 1, 2).reshape(-1, sizes["dp"] * sizes["cp"]).tolist()
    groups, ranks = {}, {}
    for axis, axis_lines in lines.items():
        for line in axis_lines:
            # new_group must be entered by all ranks for every line, in the same order
            if world == 1:
                g = None
            elif len(line) == world:
                g = dist.group.WORLD
            else:
                g = dist.new_group(line) if len(line) > 1 else None
            if rank in line:
                groups[axis], ranks[axis] = g, line
    return Mesh(sizes, coords, groups, ranks, rank)
