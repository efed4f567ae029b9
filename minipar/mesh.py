"""A device mesh: the world's ranks laid out on a grid with named dimensions.

    grid = torch.arange(world_size).view(dp, pp, tp)     # picotron's way of teaching it

A rank's coordinates are its index in the grid (a dict by name). Its group over a set of dimensions D is
the ranks whose coordinates agree with its own outside D; members are listed in the mesh's order, last
dimension fastest, which on a row-major grid is ascending global rank. With (dp, pp, tp) = (2, 2, 2)::

    tp groups: [0,1] [2,3] [4,5] [6,7]     (last dimension varies fastest: neighbours share a node)
    pp groups: [0,2] [1,3] [4,6] [5,7]
    dp groups: [0,4] [1,5] [2,6] [3,7]
    (dp, tp):  [0,1,4,5] [2,3,6,7]         (a "plane": the gradients of a CP run reduce over dp × cp)

:class:`Mesh` is pure (no processes needed: a chapter can print it, a test can check it);
:meth:`Mesh.build` creates the ``torch.distributed`` groups on a running rank and returns a
:class:`RankMesh`, which is what strategies take as an argument. ``devices_per_node`` places ranks on
nodes (rank // devices_per_node, as torchrun's LOCAL_WORLD_SIZE does; the caller passes it).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .validation import positive_int

__all__ = ["Mesh", "RankMesh", "DEFAULT_ORDER", "megatron_order", "node_of", "crosses_nodes"]

# Outermost first. tp innermost: its ranks are neighbours (same node), since TP talks the most.
DEFAULT_ORDER = ("dp", "pp", "cp", "ep", "tp")


def node_of(rank: int, devices_per_node: int | None) -> int:
    """The node holding global ``rank``: rank // devices_per_node, ranks numbered node by node as torchrun
    does (0 for every rank when ``devices_per_node`` is None: one node). The one rule of node placement:
    the mesh, the cost model's links and the replay all ask it."""
    return 0 if devices_per_node is None else rank // devices_per_node


def crosses_nodes(ranks, devices_per_node: int | None) -> bool:
    """Does a group of global ``ranks`` span more than one node (its traffic then takes the slow link)?"""
    return len({node_of(r, devices_per_node) for r in ranks}) > 1


def megatron_order(spec: str = "tp-cp-ep-dp-pp") -> tuple:
    """Megatron-Core's order string (innermost first, ``"tp-cp-ep-dp-pp"`` its default) as a :class:`Mesh`
    order (outermost first): ``("pp", "dp", "ep", "cp", "tp")``. With it ``Mesh(world, order, **sizes)``
    has Megatron's ``RankGenerator`` groups (tests/test_mesh_megatron.py)."""
    names = spec.lower().split("-")
    if len(set(names)) != len(names) or not all(names):
        raise ValueError(f"order {spec!r}: each dimension must appear once, separated by '-'")
    return tuple(reversed(names))


class Mesh:
    """Named dimensions over ``world_size`` ranks. ``Mesh(8, dp=2, pp=2, tp=2)``; omitted dims are 1."""

    def __init__(self, world_size: int, order: tuple = DEFAULT_ORDER, *, devices_per_node: int | None = None,
                 **sizes: int):
        unknown = set(sizes) - set(order)
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {sorted(unknown)}; known: {list(order)}")
        for name, size in sizes.items():
            positive_int(f"mesh dimension {name}", size)
        if devices_per_node is not None:
            positive_int("devices_per_node", devices_per_node)
        self.world_size, self.devices_per_node = world_size, devices_per_node
        self.dims = tuple(order)
        self.sizes = {d: sizes.get(d, 1) for d in self.dims}
        product = math.prod(self.sizes.values())
        if product != world_size:
            shown = " x ".join(f"{d}={s}" for d, s in self.sizes.items() if s > 1) or "1"
            raise ValueError(f"mesh {shown} has {product} ranks but world_size is {world_size}: "
                             f"the dimension sizes must multiply to the world size")
        self.grid = torch.arange(world_size, device="cpu").view(*self.sizes.values())   # host-side bookkeeping
        self.strides = dict(zip(self.dims, self.grid.stride()))

    def __repr__(self) -> str:
        shown = ", ".join(f"{d}={s}" for d, s in self.sizes.items() if s > 1)
        return f"Mesh(world_size={self.world_size}{', ' if shown else ''}{shown})"

    def size(self, *dims: str) -> int:
        """Ranks in a group over ``dims`` (the product of their sizes)."""
        return math.prod(self.sizes[d] for d in self.dims_of(dims))

    def dims_of(self, dims) -> tuple:
        """``dims`` (a name, or several) as a tuple in the mesh's order; ValueError for an unknown name."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        unknown = [d for d in names if d not in self.sizes]
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {unknown}; this mesh has {list(self.dims)}")
        return tuple(d for d in self.dims if d in names)

    def key(self, dims) -> tuple:
        """The dims of size > 1 among ``dims``: groups with the same key have the same members."""
        return tuple(d for d in self.dims_of(dims) if self.sizes[d] > 1)

    def coords(self, rank: int) -> dict:
        """{dim: index} of ``rank`` in the grid: c_d = (rank // stride_d) mod size_d."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world_size} ranks")
        return {d: rank // self.strides[d] % self.sizes[d] for d in self.dims}

    def rank_of(self, coords: dict) -> int:
        """The global rank at ``coords`` (every dim named): Σ_d c_d · stride_d."""
        return sum(coords[d] * self.strides[d] for d in self.dims)

    def rank_at(self, rank: int, **changes: int) -> int:
        """The rank at ``rank``'s coordinates with ``changes`` applied (``rank_at(5, pp=0)``)."""
        return self.rank_of(self.coords(rank) | changes)

    def group_ranks(self, dims, rank: int) -> list:
        """``rank``'s group over ``dims`` (a name or several): the ranks whose coordinates equal ``rank``'s
        outside ``dims``, in mesh order (last dim fastest = ascending rank)."""
        inside = self.dims_of(dims)
        index = tuple(slice(None) if d in inside else c for d, c in self.coords(rank).items())
        return self.grid[index].flatten().tolist()

    def groups(self, *dims: str) -> list:
        """Every group over ``dims``: the grid with ``dims`` moved last (in mesh order), one row per group;
        rows ordered by the other dims' coordinates in mesh order."""
        inside = self.dims_of(dims)
        axes = [self.dims.index(d) for d in inside]
        moved = self.grid.movedim(axes, list(range(-len(axes), 0))) if axes else self.grid.unsqueeze(-1)
        return moved.reshape(-1, math.prod(self.sizes[d] for d in inside)).tolist()

    def dims_spanned(self, ranks) -> tuple:
        """The dims along which ``ranks``' coordinates vary (mesh order): ``(0, 1, 4, 5)`` on dp=pp=tp=2 spans
        (dp, tp). A set that is no mesh group (the world of a 1-D run, a p2p pair) gets its dims too."""
        coords = [self.coords(r) for r in ranks]
        return tuple(d for d in self.dims if len({c[d] for c in coords}) > 1)

    def node_of(self, rank: int) -> int:
        """The node holding ``rank`` (:func:`node_of` with this mesh's ``devices_per_node``)."""
        return node_of(rank, self.devices_per_node)

    def crosses_nodes(self, ranks) -> bool:
        """Does a group of ``ranks`` span more than one node (:func:`crosses_nodes`)?"""
        return crosses_nodes(ranks, self.devices_per_node)

    def combinations(self) -> list:
        """Every key a default :meth:`build` creates: (), each dim of size > 1, and each set of them."""
        big = [d for d in self.dims if self.sizes[d] > 1]
        return [c for n in range(len(big) + 1) for c in itertools.combinations(big, n)]

    def build(self, rank: int, backend: str | None = None, combos=None) -> "RankMesh":
        """Create the groups (all ranks must call this, in the same order) and return this rank's view.

        ``combos=None``: a group over every set of the dims of size > 1 (2^k − 1 kinds for k such dims, plus
        the one-rank groups of the size-1 dims). ``combos=[("dp", "cp")]``: each single dim and only those
        sets; asking a :class:`RankMesh` for another set raises a ValueError saying what to pass."""
        keys = self.combinations() if combos is None else sorted(
            {self.key(d) for d in self.dims} | {self.key(c) for c in combos}, key=lambda k: (len(k), k))
        handles = {}
        for key in keys:
            for ranks in self.groups(*key):
                group = dist.new_group(ranks, backend=backend)
                if rank in ranks:
                    handles[key] = group
        return RankMesh(self, rank, handles)


@dataclass
class RankMesh:
    """One rank's view of a :class:`Mesh`: its coordinates and its process groups over sets of dims."""
    mesh: Mesh
    rank: int
    _groups: dict    # {Mesh.key(dims): process group}

    def group(self, *dims: str):
        """This rank's process group over ``dims`` (``group("dp")``, ``group("dp", "cp")``)."""
        key = self.mesh.key(dims)
        if key not in self._groups:
            raise ValueError(f"no group over {self.mesh.dims_of(dims)} was built: build the mesh with "
                             f"combos=[{key!r}] (on every rank, in the same order) or combos=None for all")
        return self._groups[key]

    def ranks(self, *dims: str) -> list:
        return self.mesh.group_ranks(dims, self.rank)

    @property
    def coords(self) -> dict:
        """{dim: index} of this rank."""
        return self.mesh.coords(self.rank)

    def coord(self, dim: str) -> int:
        return self.coords[dim]

    def size(self, *dims: str) -> int:
        return self.mesh.size(*dims)

    def rank_at(self, **coords: int) -> int:
        """The global rank at this rank's coordinates with ``coords`` changed."""
        return self.mesh.rank_at(self.rank, **coords)

    def plane(self, fixed: str):
        """The group of the ranks sharing this rank's ``fixed`` coordinate (a 3D grid's q² plane): the group
        over every other dim."""
        return self.group(*(d for d in self.mesh.dims if d != self.mesh.dims_of(fixed)[0]))

    @property
    def pp_prev(self):
        """Global rank of the previous pipeline stage (None on the first stage)."""
        i = self.coord("pp")
        return self.rank_at(pp=i - 1) if i > 0 else None

    @property
    def pp_next(self):
        """Global rank of the next pipeline stage (None on the last stage)."""
        i = self.coord("pp")
        return self.rank_at(pp=i + 1) if i + 1 < self.size("pp") else None

    @property
    def is_first_stage(self) -> bool:
        return self.coord("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord("pp") == self.size("pp") - 1
