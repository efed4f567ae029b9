"""The communication of tensor parallelism as autograd functions over a tensor-parallel group.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism") needs only two operators, conjugate to each other:

=======================  ==================  ===================  ==========================================
operator                 forward             backward             where
=======================  ==================  ===================  ==========================================
``f = copy_to_tp``       identity            all-reduce (sum)     entering a tensor-parallel region: every
                                                                  rank used the same X, each added a part of dX
``g = reduce_from_tp``   all-reduce (sum)    identity             leaving it: the ranks' partial sums of Y
``split_to_tp``          keep my slice       all-gather           a replicated tensor cut along a dimension
``gather_from_tp``       all-gather          keep my slice        column-parallel output made whole
=======================  ==================  ===================  ==========================================

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") replaces each all-reduce by a reduce-scatter plus an all-gather along the sequence dimension:

=============================  ====================  ====================
``gather_sequence``  (g-bar)   all-gather            reduce-scatter
``scatter_sequence`` (g-bar*)  reduce-scatter        all-gather
=============================  ====================  ====================

Every collective goes through :mod:`minipar.comm`, so its bytes are logged. ``group`` is always the
tensor-parallel process group, passed in (a hybrid run has one per data/pipeline coordinate).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["copy_to_tp", "reduce_from_tp", "split_to_tp", "gather_from_tp", "gather_sequence",
           "scatter_sequence", "split_sequence", "all_gather_dim", "reduce_scatter_dim", "split_dim",
           "all_reduce_sum", "tp_rank", "tp_size"]

SEQ_DIM = 1   # activations are (batch, sequence, hidden)


def tp_size(group) -> int:
    return dist.get_world_size(group)


def tp_rank(group) -> int:
    return dist.get_rank(group)


# ----------------------------------------------------------------------------------------------------
# The plain collectives along one dimension (no autograd)
# ----------------------------------------------------------------------------------------------------

def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()   # a copy: the incoming tensor may be shared by autograd
    return comm.all_reduce(out, group=group)


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (1/t of it)."""
    t = tp_size(group)
    if x.shape[dim] % t:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split into {t} equal parts")
    return x.chunk(t, dim=dim)[tp_rank(group)].contiguous()


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    t = tp_size(group)
    if t == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()   # all_gather_into_tensor concatenates along dim 0
    out = x0.new_empty((t * x0.shape[0],) + x0.shape[1:])
    comm.all_gather_into_tensor(out, x0, group=group)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's slice along ``dim``."""
    t = tp_size(group)
    if t == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // t,) + x0.shape[1:])
    comm.reduce_scatter_tensor(out, x0, group=group)
    return out.movedim(0, dim)


_OPS = {
    "identity": lambda x, dim, group: x.view_as(x),
    "all_reduce": lambda x, dim, group: all_reduce_sum(x, group),
    "split": split_dim,
    "all_gather": all_gather_dim,
    "reduce_scatter": reduce_scatter_dim,
}


class _ConjugatePair(torch.autograd.Function):
    """Forward runs one collective, backward its conjugate (the operation that moves the gradient)."""

    @staticmethod
    def forward(ctx, x, forward_op, backward_op, dim, group):
        ctx.backward_op, ctx.dim, ctx.group = backward_op, dim, group
        return _OPS[forward_op](x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _OPS[ctx.backward_op](grad, ctx.dim, ctx.group), None, None, None, None


# ----------------------------------------------------------------------------------------------------
# Tensor parallelism (Megatron-LM)
# ----------------------------------------------------------------------------------------------------

def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """f: identity forward; all-reduce of the gradient backward (each rank's branch adds a part of dX)."""
    return _ConjugatePair.apply(x, "identity", "all_reduce", -1, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """g: all-reduce forward (sum the ranks' partial products); identity backward (dY is replicated)."""
    return _ConjugatePair.apply(x, "all_reduce", "identity", -1, group)


def split_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of a replicated tensor; backward all-gathers the slices' gradients."""
    return _ConjugatePair.apply(x, "split", "all_gather", dim, group)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather the ranks' slices (e.g. a column-parallel output); backward keeps this rank's slice."""
    return _ConjugatePair.apply(x, "all_gather", "split", dim, group)


# ----------------------------------------------------------------------------------------------------
# Sequence parallelism (Korthikanti et al. 2022)
# ----------------------------------------------------------------------------------------------------

def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence shards -> whole sequence before a column-parallel layer: all-gather forward,
    reduce-scatter backward (each rank's column shard contributed a partial dX for every token)."""
    return _ConjugatePair.apply(x, "all_gather", "reduce_scatter", SEQ_DIM, group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums -> summed sequence shard after a row-parallel layer: reduce-scatter forward,
    all-gather backward (the next region needs dY for every token)."""
    return _ConjugatePair.apply(x, "reduce_scatter", "all_gather", SEQ_DIM, group)


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's sequence shard of a replicated tensor; backward all-gathers."""
    return _ConjugatePair.apply(x, "split", "all_gather", SEQ_DIM, group)
