"""A device mesh: the world's ranks laid out on a grid with named dimensions.

    grid = torch.arange(world_size).view(dp, pp, tp)     # picotron's way of teaching it

A rank's coordinates are its index in the grid; its group along a dimension is the line of ranks that
differ from it only in that coordinate. With dims (dp, pp, tp) = (2, 2, 2) on 8 ranks::

    tp groups: [0,1] [2,3] [4,5] [6,7]     (last dimension varies fastest: neighbours share a node)
    pp groups: [0,2] [1,3] [4,6] [5,7]
    dp groups: [0,4] [1,5] [2,6] [3,7]

:class:`Mesh` is pure (no processes needed: a chapter can print it, a test can check it);
:meth:`Mesh.build` creates the ``torch.distributed`` groups on a running rank and returns a
:class:`RankMesh`, which is what strategies take as an argument.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Mesh", "RankMesh", "DEFAULT_ORDER"]

# Outermost first. tp innermost: its ranks are neighbours (same node), since TP talks the most.
DEFAULT_ORDER = ("dp", "pp", "cp", "ep", "tp")


class Mesh:
    """Named dimensions over ``world_size`` ranks. ``Mesh(8, dp=2, pp=2, tp=2)``; omitted dims are 1."""

    def __init__(self, world_size: int, order: tuple = DEFAULT_ORDER, **sizes: int):
        unknown = set(sizes) - set(order)
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {sorted(unknown)}; known: {list(order)}")
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dimension {name} must be a positive integer, got {size!r}")
        self.world_size = world_size
        self.dims = tuple(order)
        self.sizes = {d: sizes.get(d, 1) for d in self.dims}
        product = math.prod(self.sizes.values())
        if product != world_size:
            shown = " x ".join(f"{d}={s}" for d, s in self.sizes.items() if s > 1) or "1"
            raise ValueError(f"mesh {shown} has {product} ranks but world_size is {world_size}: "
                             f"the dimension sizes must multiply to the world size")
        self.grid = torch.arange(world_size, device="cpu").view(*self.sizes.values())   # host-side bookkeeping

    def __repr__(self) -> str:
        shown = ", ".join(f"{d}={s}" for d, s in self.sizes.items() if s > 1)
        return f"Mesh(world_size={self.world_size}{', ' if shown else ''}{shown})"

    def size(self, dim: str) -> int:
        return self.sizes[dim]

    def coords(self, rank: int) -> dict:
        """{dim: index} of ``rank`` in the grid."""
        idx = (self.grid == rank).nonzero()[0].tolist()
        return dict(zip(self.dims, idx))

    def group_ranks(self, dim: str, rank: int) -> list:
        """The ranks in ``rank``'s group along ``dim`` (in order of their coordinate along ``dim``)."""
        index = [slice(None) if d == dim else c for d, c in self.coords(rank).items()]
        return self.grid[tuple(index)].flatten().tolist()

    def groups(self, dim: str) -> list:
        """Every group along ``dim``: the grid with ``dim`` moved last, one row per group."""
        axis = self.dims.index(dim)
        return self.grid.movedim(axis, -1).reshape(-1, self.sizes[dim]).tolist()

    def build(self, rank: int, backend: str | None = None) -> "RankMesh":
        """Create every group of every dimension (all ranks must call this, in the same order) and return
        this rank's view. Dimensions of size 1 get a group of one rank."""
        handles = {}
        for dim in self.dims:
            for ranks in self.groups(dim):
                group = dist.new_group(ranks, backend=backend)
                if rank in ranks:
                    handles[dim] = group
        return RankMesh(self, rank, handles)


@dataclass
class RankMesh:
    """One rank's view of a :class:`Mesh`: its coordinates and its process group along each dimension."""
    mesh: Mesh
    rank: int
    _groups: dict

    def group(self, dim: str):
        return self._groups[dim]

    def ranks(self, dim: str) -> list:
        return self.mesh.group_ranks(dim, self.rank)

    def coord(self, dim: str) -> int:
        return self.mesh.coords(self.rank)[dim]

    def size(self, dim: str) -> int:
        return self.mesh.size(dim)

    @property
    def pp_prev(self):
        """Global rank of the previous pipeline stage (None on the first stage)."""
        r, i = self.ranks("pp"), self.coord("pp")
        return r[i - 1] if i > 0 else None

    @property
    def pp_next(self):
        """Global rank of the next pipeline stage (None on the last stage)."""
        r, i = self.ranks("pp"), self.coord("pp")
        return r[i + 1] if i + 1 < len(r) else None

    @property
    def is_first_stage(self) -> bool:
        return self.coord("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord("pp") == self.size("pp") - 1
