"""2D tensor parallelism: SUMMA on a q×q grid (van de Geijn & Watts 1997; Optimus, Xu et al. 2021).

Every matrix is cut into q×q blocks and rank (i, j) holds block (i, j) of each: the input X (tokens ×
features), the weight A (in × out; PyTorch's ``weight`` is Aᵀ) and the output Y. Nothing is replicated but
the biases, so parameters *and* activations take 1/q² of the memory per rank (1D Megatron: 1/P of the
weights, whole activations).

SUMMA forward, ``Y_ij = Σ_k X_ik A_kj`` in q steps; in step k::

    rank (i, k) broadcasts X_ik along its block row    (the q ranks with the same i)
    rank (k, j) broadcasts A_kj along its block column (the q ranks with the same j)
    every rank adds X_ik A_kj to its Y_ij

Backward (Optimus's two transposed SUMMA variants), in q steps each:

* ``dX_il = Σ_j dY_ij A_ljᵀ``: A_lj broadcast along column j, each rank computes dY_ij A_ljᵀ, the row
  reduces it onto rank (i, l).
* ``dA_kj = Σ_i X_ikᵀ dY_ij``: X_ik broadcast along row i, each rank computes X_ikᵀ dY_ij, the column
  reduces it onto rank (k, j).

Bytes one rank sends for one linear layer (blocks of S_X = |X|/q², S_A = |A|/q², S_Y = |Y|/q² bytes;
over q steps each rank is the root once per line, and a broadcast root or a non-root of a reduce sends
(q−1)·S): forward ``(q−1)(S_X + S_A)``, backward ``(q−1)(S_A + S_X) + (q−1)(S_X + S_A)`` (two more
broadcast rounds and the reductions of dX and dA blocks). Optimus states it as 3 × 2 broadcast-or-reduce
rounds, each moving (q−1)/q of a row's or column's blocks: the "6(q−1)/q" of the comparison table.
Messages: q per round (the latency term grows with q, not log q).

The bias ``b_j`` (out/q) is replicated on the q ranks of column j; its gradient is the column's sum.
LayerNorm over features that are split over the block row needs two all-reduces along the row (mean and
mean of squares) forward and two backward.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm
from ..mesh import RankMesh
from .grid import reduce_to
from .operators import all_gather_dim, all_reduce_sum

__all__ = ["summa_step", "summa", "summa_nt", "summa_tn", "Summa", "block", "Linear2D", "LayerNorm2D",
           "bytes_per_linear"]


def block(t: torch.Tensor, i: int, j: int, q: int) -> torch.Tensor:
    """Block (i, j) of a matrix cut into q×q."""
    return t.chunk(q, 0)[i].chunk(q, 1)[j].contiguous()


def summa_step(k: int, x: torch.Tensor, a: torch.Tensor, acc: torch.Tensor, g: RankMesh) -> torch.Tensor:
    """Step k of SUMMA on rank (i, j): receive X_ik along the row and A_kj along the column, accumulate."""
    i, j = g.coord("i"), g.coord("j")
    x_k = x.clone() if j == k else torch.empty_like(x)      # rank (i, k) owns X_ik
    comm.broadcast(x_k, src=g.rank_at(j=k), group=g.group("j"))
    a_k = a.clone() if i == k else torch.empty_like(a)      # rank (k, j) owns A_kj
    comm.broadcast(a_k, src=g.rank_at(i=k), group=g.group("i"))
    return acc + x_k @ a_k


def summa(x: torch.Tensor, a: torch.Tensor, g: RankMesh) -> torch.Tensor:
    """``Y_ij = Σ_k X_ik A_kj`` (all blocks the same shape on every rank: an even split)."""
    acc = x.new_zeros(x.shape[0], a.shape[1])
    for k in range(g.size("j")):
        acc = summa_step(k, x, a, acc, g)
    return acc


def summa_nt(dy: torch.Tensor, a: torch.Tensor, g: RankMesh) -> torch.Tensor:
    """``dX_il = Σ_j dY_ij A_ljᵀ``: broadcast A_lj down column j, multiply, reduce along row i onto (i, l)."""
    i, j, out = g.coord("i"), g.coord("j"), None
    for l in range(g.size("i")):
        a_l = a.clone() if i == l else torch.empty_like(a)
        comm.broadcast(a_l, src=g.rank_at(i=l), group=g.group("i"))
        total = reduce_to(dy @ a_l.T, g.rank_at(j=l), g.group("j"))
        out = total if j == l else out
    return out


def summa_tn(x: torch.Tensor, dy: torch.Tensor, g: RankMesh) -> torch.Tensor:
    """``dA_kj = Σ_i X_ikᵀ dY_ij``: broadcast X_ik along row i, multiply, reduce along column j onto (k, j)."""
    i, j, out = g.coord("i"), g.coord("j"), None
    for k in range(g.size("j")):
        x_k = x.clone() if j == k else torch.empty_like(x)
        comm.broadcast(x_k, src=g.rank_at(j=k), group=g.group("j"))
        total = reduce_to(x_k.T @ dy, g.rank_at(i=k), g.group("i"))
        out = total if i == k else out
    return out


class Summa(torch.autograd.Function):
    """Y = X A on blocks: SUMMA forward, the two transposed SUMMAs backward."""

    @staticmethod
    def forward(ctx, x, a, g):
        ctx.save_for_backward(x, a)
        ctx.g = g
        return summa(x, a, g)

    @staticmethod
    def backward(ctx, dy):
        x, a = ctx.saved_tensors
        dy = dy.contiguous()
        return summa_nt(dy, a, ctx.g), summa_tn(x, dy, ctx.g), None


class Linear2D(nn.Module):
    """A linear layer with X, A = Wᵀ and Y all in q×q blocks; bias b_j on every rank of column j."""

    def __init__(self, linear: nn.Linear, g: RankMesh):
        super().__init__()
        q, i, j = g.size("i"), g.coord("i"), g.coord("j")
        if linear.in_features % q or linear.out_features % q:
            raise ValueError(f"a {linear.in_features}→{linear.out_features} layer does not split into {q}×{q} blocks")
        self.g = g
        self.weight = nn.Parameter(block(linear.weight.detach().T, i, j, q))   # A_ij (in/q, out/q)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().chunk(q)[j].clone())

    def forward(self, x):
        y = Summa.apply(x, self.weight, self.g)
        return y if self.bias is None else y + self.bias

    def sync_grads(self):
        """The bias is replicated down column j: its gradient is the sum of the column's."""
        if self.bias is not None and self.bias.grad is not None:
            comm.all_reduce(self.bias.grad, group=self.g.group("i"))

    def full_weight(self) -> torch.Tensor:
        """W (out, in) assembled from every rank's block (an all-gather over the grid)."""
        return _assemble(self.weight.detach(), self.g).T.contiguous()

    def full_bias(self) -> torch.Tensor:
        return _gather_line(self.bias.detach(), self.g.group("j"))


def _gather_line(t, group):
    return all_gather_dim(t.contiguous(), 0, group)


def _assemble(blk, g):
    """The whole matrix from the q×q blocks of one grid layer: gather along the row, then the column."""
    row = _gather_line(blk.T.contiguous(), g.group("j")).T          # [X_i0 ... X_i,q-1]
    return _gather_line(row.contiguous(), g.group("i"))


class _RowStats(torch.autograd.Function):
    """A sum over the block row that every rank of the row goes on to use: all-reduce forward, and
    all-reduce backward (each rank's loss depends on the sum, so dL/dpart is the row's sum of dL_r/dsum)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return all_reduce_sum(t, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


class LayerNorm2D(nn.Module):
    """LayerNorm over features split along the block row: mean and mean of squares all-reduced along the
    row (2 all-reduces of tokens/q numbers); γ_j, β_j replicated down column j like a bias."""

    def __init__(self, ln: nn.LayerNorm, g: RankMesh):
        super().__init__()
        q, j = g.size("j"), g.coord("j")
        self.g, self.eps, self.features = g, ln.eps, ln.normalized_shape[0]
        self.weight = nn.Parameter(ln.weight.detach().chunk(q)[j].clone())
        self.bias = nn.Parameter(ln.bias.detach().chunk(q)[j].clone())

    def forward(self, x):
        row = self.g.group("j")
        mean = _RowStats.apply(x.sum(-1, keepdim=True), row) / self.features
        centred = x - mean
        var = _RowStats.apply(centred.pow(2).sum(-1, keepdim=True), row) / self.features
        return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias

    def sync_grads(self):
        for p in (self.weight, self.bias):
            comm.all_reduce(p.grad, group=self.g.group("i"))


def bytes_per_linear(tokens: int, d_in: int, d_out: int, q: int, value_bytes: int = 4) -> dict:
    """Bytes one rank sends for one :class:`Linear2D` (no bias), forward and backward (module docstring)."""
    s_x, s_a = tokens * d_in * value_bytes / q**2, d_in * d_out * value_bytes / q**2
    return {"forward": (q - 1) * (s_x + s_a), "backward": 2 * (q - 1) * (s_x + s_a)}
