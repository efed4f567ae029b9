"""3D tensor parallelism: the cube algorithm on q×q×q ranks (Agarwal et al. 1995; Bian et al. 2021,
"Maximizing Parallelism in Distributed Training for Huge Neural Networks").

For ``Y = X A`` (X: M×K tokens × features, A: K×N), each layer gives the cube's three axes three roles:
m (token blocks), k (the summed dimension) and n (output feature blocks). Rank (m, k, n) holds

* piece n of the block X_mk   (the block split again by rows along the n-axis: |X|/q³),
* piece m of the block A_kn   (split again along the m-axis: |A|/q³),
* and ends with piece k of the block Y_mn (|Y|/q³).

Forward — three collectives, each on a line of q ranks::

    X_mk = all-gather of the n-axis line's pieces
    A_kn = all-gather of the m-axis line's pieces
    Y_mn piece k = reduce-scatter along the k-axis of X_mk A_kn   (Y_mn = Σ_k X_mk A_kn)

Backward — three more: all-gather dY_mn along the k-axis; dX_mk = Σ_n dY_mn A_knᵀ reduce-scattered along
the n-axis; dA_kn = Σ_m X_mkᵀ dY_mn reduce-scattered along the m-axis (X_mk, A_kn kept from forward).

Y_mn split along k is exactly the layout the next layer needs for its input if that layer swaps the
k- and n-axes: layers alternate roles (x, y, z) and (x, z, y) (:data:`ROLES`), so no re-layout is needed.

Bytes one rank sends per linear layer, ring collectives ((q−1)/q of each gathered or reduced block of
|X|/q², |A|/q², |Y|/q²): forward (q−1)/q³ (|X| + |A| + |Y|), backward the same again — in all
2(q−1)/q³ (|X| + |A| + |Y|): Bian et al.'s 6 collectives of (q−1)/q³ of a matrix each. Messages: 6(q−1).
Note that A moves too (1D Megatron never moves weights): with few tokens and wide layers that term wins.

The bias b_n is replicated on the q² ranks of the plane with this n; its gradient is summed over that plane.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm
from ..mesh import RankMesh
from .operators import all_gather_dim

__all__ = ["ROLES", "roles", "piece", "Cube", "Linear3D", "cube_forward", "bytes_per_linear"]

ROLES = (("x", "y", "z"), ("x", "z", "y"))     # (m-axis, k-axis, n-axis) for layers 0, 2, 4 … and 1, 3, …


def roles(layer: int) -> tuple:
    return ROLES[layer % 2]


def piece(t: torch.Tensor, row_block: int, col_block: int, part: int, q: int) -> torch.Tensor:
    """Block (row_block, col_block) of a q×q cut of ``t``, then its rows cut in q and part ``part`` kept."""
    return t.chunk(q, 0)[row_block].chunk(q, 1)[col_block].chunk(q, 0)[part].contiguous()


def reduce_scatter_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over the line, keep this rank's 1/q of the rows (minipar's send/recv ring: gloo's own
    reduce-scatter all-reduces internally and moves twice the bytes)."""
    return comm.ring_reduce_scatter(t.contiguous(), group)


def cube_forward(x: torch.Tensor, a: torch.Tensor, g: RankMesh, axes: tuple):
    """The three collectives and one matmul of the forward: returns (Y piece, X_mk, A_kn)."""
    m, k, n = axes
    x_mk = all_gather_dim(x, 0, g.group(n))       # gather X's pieces along the n-axis
    a_kn = all_gather_dim(a, 0, g.group(m))       # gather A's pieces along the m-axis
    y = reduce_scatter_rows(x_mk @ a_kn, g.group(k))   # sum over k, keep piece k of Y_mn
    return y, x_mk, a_kn


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, g, axes):
        y, x_mk, a_kn = cube_forward(x, a, g, axes)
        ctx.save_for_backward(x_mk, a_kn)
        ctx.g, ctx.axes = g, axes
        return y

    @staticmethod
    def backward(ctx, dy):
        x_mk, a_kn = ctx.saved_tensors
        m, k, n = ctx.axes
        g = ctx.g
        dy_mn = all_gather_dim(dy.contiguous(), 0, g.group(k))
        dx = reduce_scatter_rows(dy_mn @ a_kn.T, g.group(n))
        da = reduce_scatter_rows(x_mk.T @ dy_mn, g.group(m))
        return dx, da, None, None


class Linear3D(nn.Module):
    """A linear layer on the cube; ``layer`` (its index in the model) picks its roles."""

    def __init__(self, linear: nn.Linear, g: RankMesh, layer: int = 0):
        super().__init__()
        q = g.size("x")
        if linear.in_features % (q * q) or linear.out_features % q:
            raise ValueError(f"a {linear.in_features}→{linear.out_features} layer does not split on a {q}×{q}×{q} "
                             f"cube (in_features must divide by q², out_features by q)")
        self.g, self.axes = g, roles(layer)
        m, k, n = (g.coord(d) for d in self.axes)
        self.weight = nn.Parameter(piece(linear.weight.detach().T, k, n, m, q))   # piece m of A_kn
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().chunk(q)[n].clone())

    def forward(self, x):
        y = Cube.apply(x, self.weight, self.g, self.axes)
        return y if self.bias is None else y + self.bias

    def sync_grads(self):
        if self.bias is not None and self.bias.grad is not None:
            comm.all_reduce(self.bias.grad, group=self.g.plane(self.axes[2]))

    def full_weight(self) -> torch.Tensor:
        """W (out, in) from every rank's piece: all-gather over the world, placed by each rank's roles."""
        return _assemble_world(self.weight.detach(), self.g, lambda c: (c[1], c[2], c[0]), self.axes).T

    def full_bias(self) -> torch.Tensor:
        return all_gather_dim(self.bias.detach(), 0, self.g.group(self.axes[2]))


def _assemble_world(t, g: RankMesh, where, axes) -> torch.Tensor:
    """Place every rank's piece: ``where((m, k, n))`` -> (row block, column block, row piece)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    pieces = [torch.empty_like(t) for _ in range(world)]
    comm.all_gather(pieces, t.contiguous())
    q = g.size("x")
    rows = [[[None] * q for _ in range(q)] for _ in range(q)]
    for r, p in enumerate(pieces):
        c = g.mesh.coords(r)
        rb, cb, part = where(tuple(c[d] for d in axes))
        rows[rb][cb][part] = p
    return torch.cat([torch.cat([torch.cat(parts) for parts in row], 1) for row in rows])


def bytes_per_linear(tokens: int, d_in: int, d_out: int, q: int, value_bytes: int = 4) -> dict:
    """Bytes one rank sends for one :class:`Linear3D` (no bias), forward and backward (module docstring)."""
    total = (tokens * d_in + d_in * d_out + tokens * d_out) * value_bytes
    return {"forward": (q - 1) / q**3 * total, "backward": (q - 1) / q**3 * total}
