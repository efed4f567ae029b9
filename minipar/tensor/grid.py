"""Process grids for multi-dimensional tensor parallelism: q×q (2D), d×q×q (2.5D) and q×q×q (3D).

The layout is a :class:`minipar.mesh.Mesh` with named dimensions (last one fastest), so every group is a
list of ranks computed from the mesh, never a hard-coded global layout::

    2D   q=2,      4 ranks   dims (i, j)       grid [[0, 1],
                                                     [2, 3]]         rank (i, j) = 2i + j
    2.5D q=2, d=2, 8 ranks   dims (k, i, j)    two stacked 2×2 layers: depth k = 0 holds ranks 0-3, k = 1 ranks 4-7
    3D   q=2,      8 ranks   dims (x, y, z)    a 2×2×2 cube

``group("j")`` is the line of ranks that differ from this one only in ``j``: with blocks indexed
``X[i][j]`` that is *this rank's block row* (same i, every j). A 3D grid also has the three planes
(``plane("z")``: the q² ranks that share this rank's z coordinate and differ in x and y). A rank's view of a
grid is the mesh's own :class:`minipar.mesh.RankMesh` (groups over any set of dims, ``rank_at``, ``q``).

Sizes that are not q², d·q², q³ are refused with a ValueError before any process starts
(:func:`grid_2d`, :func:`grid_2p5d`, :func:`grid_3d` are pure: call them in ``validate``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import comm
from ..mesh import Mesh, RankMesh
from ..validation import positive_int

__all__ = ["grid_2d", "grid_2p5d", "grid_3d", "build", "reduce_to"]


def _isqrt_exact(n: int):
    q = math.isqrt(n)
    return q if q * q == n else None


def _icbrt_exact(n: int):
    q = round(n ** (1 / 3))
    for c in (q - 1, q, q + 1):
        if c > 0 and c ** 3 == n:
            return c
    return None


def grid_2d(world_size: int) -> Mesh:
    """A q×q grid (dims ``i``, ``j``); ValueError unless ``world_size`` = q²."""
    positive_int("world_size", world_size)
    q = _isqrt_exact(world_size)
    if q is None:
        near = math.isqrt(world_size)
        raise ValueError(f"2D tensor parallelism needs a square number of ranks (q×q), got {world_size}: "
                         f"use {near * near} or {(near + 1) ** 2}")
    return Mesh(world_size, order=("i", "j"), i=q, j=q)


def grid_2p5d(world_size: int, depth: int) -> Mesh:
    """d stacked q×q layers (dims ``k`` (depth), ``i``, ``j``); ValueError unless ``world_size`` = d·q²."""
    positive_int("world_size", world_size)
    positive_int("depth", depth)
    if world_size % depth:
        raise ValueError(f"2.5D tensor parallelism needs world_size = depth·q², but {world_size} ranks do not "
                         f"divide into depth {depth}")
    q = _isqrt_exact(world_size // depth)
    if q is None:
        raise ValueError(f"2.5D tensor parallelism needs world_size = depth·q²: {world_size} ranks / depth "
                         f"{depth} = {world_size // depth}, which is not a square")
    return Mesh(world_size, order=("k", "i", "j"), k=depth, i=q, j=q)


def grid_3d(world_size: int) -> Mesh:
    """A q×q×q cube (dims ``x``, ``y``, ``z``); ValueError unless ``world_size`` = q³."""
    positive_int("world_size", world_size)
    q = _icbrt_exact(world_size)
    if q is None:
        near = max(1, int(world_size ** (1 / 3)))
        raise ValueError(f"3D tensor parallelism needs a cube number of ranks (q×q×q), got {world_size}: "
                         f"use {near ** 3} or {(near + 1) ** 3}")
    return Mesh(world_size, order=("x", "y", "z"), x=q, y=q, z=q)


def build(mesh: Mesh, rank: int) -> RankMesh:
    """This rank's :class:`minipar.mesh.RankMesh` of a grid: its line groups (``group("j")``), its planes
    (``plane("z")`` = ``group("x", "y")``), ``rank_at(j=k)``. Every rank calls it, in the same order."""
    return mesh.build(rank)


def reduce_to(t: torch.Tensor, root: int, group) -> torch.Tensor | None:
    """Sum ``t`` over ``group`` onto global rank ``root`` with direct sends (each other rank sends its
    S bytes once; the root receives and adds). Returns the sum on the root, None elsewhere.

    Written with :func:`comm.send`/:func:`comm.recv` so that the bytes on the wire are the textbook
    figure: gloo's own ``reduce`` moves about 1.5× (2 ranks) to 1.25× (4 ranks) of it."""
    members = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    t = t.contiguous()
    if me != root:
        comm.send(t, root)
        return None
    total = t.clone()
    buf = torch.empty_like(t)
    for r in members:
        if r != root:
            comm.recv(buf, r)
            total += buf
    return total
