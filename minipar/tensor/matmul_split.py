"""One matmul ``y = x @ w`` split three ways over N ranks, forward and backward written by hand.

Shapes: x (B×K), w (K×M), y (B×M). With the upstream gradient ``dy = ∂loss/∂y`` the backward is
``dx = dy @ wᵀ`` and ``dw = xᵀ @ dy``. Each split keeps the product exact and moves a different tensor:

=============  =====================  ================================  =======================================
split          rank i holds           forward                           backward
=============  =====================  ================================  =======================================
data (x dim0)  x rows i, all of w     y rows i = x_i w: no comm         dw = Σ_i x_iᵀ dy_i: all-reduce of dw
column (w d1)  all of x, w cols i     y cols i = x w_i: no comm         dx = Σ_i dy_i w_iᵀ: all-reduce of dx
row (w dim0)   x cols i, w rows i     y = Σ_i x_i w_i: all-reduce of y  dw rows i, dx cols i: no comm
=============  =====================  ================================  =======================================

Bytes sent per rank (ring, S = the tensor's bytes): all-reduce 2(N-1)/N·S. Data parallelism all-reduces
a weight-sized tensor (K·M), the column split an input-sized one (B·K), the row split an output-sized one
(B·M): which split is cheapest depends on the shapes. Holding the whole output on every rank after a data
or column split costs one more all-gather, (N-1)/N·|y| (the next layer often does not need it: a row split
consumes the column split's output as it is — Megatron's MLP, Shoeybi et al. 2019, arXiv:1909.08053).

Uneven splits follow ``torch.tensor_split`` (the first ``size % N`` ranks get one more row or column); an
all-gather of uneven pieces pads each to the largest and trims after, and the padding is sent too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..recipe import Recipe, RunResult
from ..launcher import launch

__all__ = ["SPLITS", "shard_sizes", "shard", "validate", "gather_pieces",
           "data_forward", "data_backward", "column_forward", "column_backward", "row_forward", "row_backward",
           "run_split", "run", "predicted_bytes", "Matmul", "matmul_recipe", "parallel_train"]

SPLITS = ("data", "column", "row")
# which tensor each split cuts, along which dimension (x: B×K, w: K×M)
CUTS = {"data": ("x", 0), "column": ("w", 1), "row": ("w", 0)}


def shard_sizes(size: int, n: int) -> list:
    """How many of ``size`` rows (or columns) each of ``n`` ranks gets (as ``torch.tensor_split``)."""
    return [size // n + (1 if i < size % n else 0) for i in range(n)]


def shard(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``t`` along ``dim`` (a copy: the rank owns it)."""
    return torch.tensor_split(t, n, dim=dim)[rank].clone()


def validate(split: str, x_shape, w_shape, *, world_size: int) -> None:
    """ValueError (before any process starts) unless ``split`` can give every one of ``n`` ranks a piece."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    (b, k), (k2, m) = x_shape, w_shape
    if k != k2:
        raise ValueError(f"x is {b}×{k} but w is {k2}×{m}: inner dimensions differ")
    size = {"data": b, "column": m, "row": k}[split]
    if world_size > size:
        raise ValueError(f"the {split} split cuts a dimension of size {size}: it cannot give {world_size} "
                         f"ranks a piece each")


def gather_pieces(piece: torch.Tensor, dim: int, full_size: int, group=None) -> torch.Tensor:
    """All-gather every rank's piece along ``dim`` into the whole (pieces may be uneven: padded, trimmed)."""
    n = dist.get_world_size(group)
    sizes = shard_sizes(full_size, n)
    pad_shape = list(piece.shape)
    pad_shape[dim] = sizes[0] - piece.shape[dim]
    padded = torch.cat([piece, piece.new_zeros(pad_shape)], dim).contiguous()
    out = [torch.empty_like(padded) for _ in range(n)]
    comm.all_gather(out, padded, group=group)
    return torch.cat([o.narrow(dim, 0, s) for o, s in zip(out, sizes)], dim)


# ----------------------------------------------------------------------------------------------------
# The three splits: forward and backward on one rank. Every communication is here, through minipar.comm.
# ----------------------------------------------------------------------------------------------------

def data_forward(x_rows, w):
    """Rows i of y: ``x_i @ w``. No communication (w is whole on every rank)."""
    return x_rows @ w


def data_backward(x_rows, w, dy_rows, group=None):
    """dx rows i stay local; ``dw = Σ_i x_iᵀ dy_i`` is a sum over ranks: all-reduce (K×M)."""
    dw = x_rows.T @ dy_rows            # this rank's rows' share of the gradient
    comm.all_reduce(dw, group=group)   # without it each replica would step with its own gradient and drift
    return dy_rows @ w.T, dw


def column_forward(x, w_cols):
    """Columns i of y: ``x @ w_i``. No communication (x is whole on every rank)."""
    return x @ w_cols


def column_backward(x, w_cols, dy_cols, group=None):
    """dw columns i are local; ``dx = Σ_i dy_i w_iᵀ`` is a sum over ranks: all-reduce (B×K)."""
    dx = dy_cols @ w_cols.T            # every output column depends on every input: partial sums of dx
    comm.all_reduce(dx, group=group)
    return dx, x.T @ dy_cols


def row_forward(x_cols, w_rows, group=None):
    """``y = Σ_i x_i w_i``: each rank's product is a partial sum of all of y: all-reduce (B×M)."""
    y = x_cols @ w_rows
    comm.all_reduce(y, group=group)
    return y


def row_backward(x_cols, w_rows, dy):
    """dy is whole on every rank (so was y): dx columns i and dw rows i are local. No communication."""
    return dy @ w_rows.T, x_cols.T @ dy


def run_split(rank, world_size, split, x, w, dy, group=None) -> dict:
    """One forward and backward of ``split`` on this rank, from the whole x, w and dy (each rank takes its
    own pieces). Returns the pieces, the assembled y, dx and dw, and the bytes this rank sent in each phase
    (``forward``, ``backward``: what training needs; ``gather_y``, ``gather_dx``, ``gather_dw``: gathering
    the whole tensor on every rank, done only to compare with one device). ``y_local``, ``dx_local``,
    ``dw_local``: this rank's own products before any communication; ``y_piece``, ``dx_piece``,
    ``dw_piece``: what it holds after the split's collective."""
    with comm.recording() as fwd_log:
        if split == "data":
            x_p, w_p = shard(x, 0, rank, world_size), w.clone()
            y_p = data_forward(x_p, w_p)
        elif split == "column":
            x_p, w_p = x.clone(), shard(w, 1, rank, world_size)
            y_p = column_forward(x_p, w_p)
        else:
            x_p, w_p = shard(x, 1, rank, world_size), shard(w, 0, rank, world_size)
            y_p = row_forward(x_p, w_p, group)
    dy_p = {"data": lambda: shard(dy, 0, rank, world_size), "column": lambda: shard(dy, 1, rank, world_size),
            "row": lambda: dy.clone()}[split]()
    with comm.recording() as bwd_log:
        if split == "data":
            dx_p, dw_p = data_backward(x_p, w_p, dy_p, group)
        elif split == "column":
            dx_p, dw_p = column_backward(x_p, w_p, dy_p, group)
        else:
            dx_p, dw_p = row_backward(x_p, w_p, dy_p)
    # The whole y, dx and dw on every rank, only to compare with one device: gather the pieces that are cut.
    (b, k), m = x.shape, w.shape[1]
    cut = {"data": {"y": 0, "dx": 0, "dw": None}, "column": {"y": 1, "dx": None, "dw": 1},
           "row": {"y": None, "dx": 1, "dw": 0}}[split]
    pieces, shapes = {"y": y_p, "dx": dx_p, "dw": dw_p}, {"y": (b, m), "dx": (b, k), "dw": (k, m)}
    whole, gather_bytes = {}, {}
    for name, piece in pieces.items():
        dim = cut[name]
        with comm.recording() as log:
            whole[name] = piece if dim is None else gather_pieces(piece, dim, shapes[name][dim], group)
        gather_bytes[f"gather_{name}"] = log.bytes_sent
    return {"x": x_p, "w": w_p, "dy": dy_p,
            "y_local": x_p @ w_p, "dx_local": dy_p @ w_p.T, "dw_local": x_p.T @ dy_p,   # before any collective
            "y_piece": y_p, "dx_piece": dx_p, "dw_piece": dw_p, **whole,
            "bytes": {"forward": fwd_log.bytes_sent, "backward": bwd_log.bytes_sent, **gather_bytes},
            "ops": {"forward": fwd_log.by_op(), "backward": bwd_log.by_op()}}


def _run_splits(rank, world_size, splits, x, w, dy):
    return {s: run_split(rank, world_size, s, x, w, dy) for s in splits}


def run(x, w, dy, *, world_size: int, splits=SPLITS) -> list:
    """:func:`run_split` for each of ``splits`` on ``world_size`` ranks; per rank ``{split: result}``.
    Refuses a split that cannot give every rank a piece with a ValueError, before any process starts."""
    for s in splits:
        validate(s, tuple(x.shape), tuple(w.shape), world_size=world_size)
    return launch(_run_splits, world_size, tuple(splits), x, w, dy, quiet=True)


def predicted_bytes(split: str, x_shape, w_shape, n: int, itemsize: int = 4) -> dict:
    """The formula for the ``forward`` and ``backward`` bytes one rank sends in :func:`run_split`."""
    (b, k), m = x_shape, w_shape[1]
    ar = lambda elems: comm.predicted_bytes_sent("all_reduce", elems * itemsize, n)  # noqa: E731
    return {"data": {"forward": 0, "backward": ar(k * m)},
            "column": {"forward": 0, "backward": ar(b * k)},
            "row": {"forward": ar(b * m), "backward": 0}}[split]


# ----------------------------------------------------------------------------------------------------
# Training with a split, checked against one device with minipar.check
# ----------------------------------------------------------------------------------------------------

class Matmul(nn.Module):
    """The one-layer model ``y = x @ w`` (w: K×M, no bias), deterministic in ``seed``."""

    def __init__(self, k: int = 5, m: int = 8, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(k, m, generator=g) / k ** 0.5)

    def forward(self, x):
        return x @ self.w


def matmul_recipe(b: int = 4, k: int = 5, m: int = 8, steps: int = 3, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> Recipe:
    """Mean-squared-error regression of a random target with SGD: x (b×k) · w (k×m), ``steps`` batches."""
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(b, k, generator=g, dtype=dtype), torch.randn(b, m, generator=g, dtype=dtype))
               for _ in range(steps)]
    return Recipe(model=lambda: Matmul(k, m, seed), batches=batches,
                  loss=lambda model, x, t: F.mse_loss(model(x), t), dtype=dtype, name=f"matmul {b}x{k}x{m}")


def parallel_train(rank, world_size, recipe: Recipe, *, split: str, group=None) -> RunResult:
    """Train ``recipe`` (a :func:`matmul_recipe`) with ``split``: hand-written forward and backward, the
    optimizer on this rank's piece of w only. Loss = mean((y - t)²); ``dy = 2 (y - t) / (B·M)`` is computed
    on each rank's own piece of y, the loss itself by summing the pieces' squared errors (one scalar)."""
    w_full = recipe.model().to(recipe.dtype).w.detach()
    cut_dim = {"data": None, "column": 1, "row": 0}[split]
    w = nn.Parameter(w_full.clone() if cut_dim is None else shard(w_full, cut_dim, rank, world_size))
    opt = recipe.optimizer([w])
    losses = []
    for x, t in recipe.batches:
        b, m = t.shape
        if split == "data":
            xs, ts = shard(x, 0, rank, world_size), shard(t, 0, rank, world_size)
            y = data_forward(xs, w.data)
        elif split == "column":
            xs, ts = x, shard(t, 1, rank, world_size)
            y = column_forward(xs, w.data)
        else:
            xs, ts = shard(x, 1, rank, world_size), t
            y = row_forward(xs, w.data, group)
        dy = 2 * (y - ts) / (b * m)
        sq = ((y - ts) ** 2).sum()
        if split != "row":                  # each rank saw a piece of y: the loss is the sum of pieces
            comm.all_reduce(sq, group=group)
        losses.append(float(sq) / (b * m))
        if split == "data":
            _, w.grad = data_backward(xs, w.data, dy, group)
        elif split == "column":
            _, w.grad = column_backward(xs, w.data, dy, group)
        else:
            _, w.grad = row_backward(xs, w.data, dy)
        opt.step()
    k = w_full.shape[0]
    full = w.data if cut_dim is None else gather_pieces(w.data, cut_dim, k if cut_dim == 0 else w_full.shape[1],
                                                        group)
    return RunResult(losses, {"w": full})
