"""The communication of tensor parallelism as autograd functions over a tensor-parallel group.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism") needs two operators, conjugate to each other: what one does forward, the other does
backward. Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") adds a second conjugate pair along the sequence dimension. The two papers name them
differently — Korthikanti et al. rename Shoeybi's g to f̄ and use g, ḡ for the new pair — so every class
below carries both names:

=============================  ============  =====================  ==============  ==============
function (class)               Shoeybi 2019  Korthikanti 2022       forward         backward
=============================  ============  =====================  ==============  ==============
``copy_to_tp``                 f             f                      identity        all-reduce
(:class:`CopyToTensorParallel`)
``reduce_from_tp``             g             f̄ (f-bar)              all-reduce      identity
(:class:`ReduceFromTensorParallel`)
``gather_sequence``            —             g                      all-gather      reduce-scatter
(:class:`GatherSequence`)
``scatter_sequence``           —             ḡ (g-bar)              reduce-scatter  all-gather
(:class:`ScatterSequence`)
``split_to_tp``                —             —                      keep my slice   all-gather
(:class:`SplitToTensorParallel`)
``gather_from_tp``             —             —                      all-gather      keep my slice
(:class:`GatherFromTensorParallel`)
=============================  ============  =====================  ==============  ==============

Where they sit: f where a tensor-parallel region starts (every rank used the same X, each adds a part of
dX), g / f̄ where it ends (the ranks' partial sums of Y). With sequence parallelism g replaces f before a
column-parallel layer and ḡ replaces f̄ after a row-parallel one: an all-reduce is a reduce-scatter plus an
all-gather, so the bytes stay the same while the LayerNorms and dropouts between the regions work on s/t
tokens.

Every collective goes through :mod:`minipar.comm`, so its bytes are logged (and, inside
``comm.ring_algorithms()``, run on minipar's send/recv rings). ``group`` is always the tensor-parallel
process group, passed in (a hybrid run has one per data/pipeline coordinate).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["copy_to_tp", "reduce_from_tp", "split_to_tp", "gather_from_tp", "gather_sequence",
           "scatter_sequence", "CopyToTensorParallel", "ReduceFromTensorParallel", "SplitToTensorParallel",
           "GatherFromTensorParallel", "GatherSequence", "ScatterSequence", "all_gather_dim",
           "reduce_scatter_dim", "split_dim", "all_reduce_sum", "tp_rank", "tp_size", "SEQ_DIM"]

SEQ_DIM = 1   # activations are (batch, sequence, hidden)


def tp_size(group) -> int:
    return dist.get_world_size(group)


def tp_rank(group) -> int:
    return dist.get_rank(group)


# ----------------------------------------------------------------------------------------------------
# The plain collectives along one dimension (no autograd)
# ----------------------------------------------------------------------------------------------------

def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Σ over the ranks of ``x``, into a copy (the incoming tensor may be shared by autograd); a group of one
    rank has nothing to add, so no call is made (Megatron's ``_reduce`` bypasses it the same way)."""
    if tp_size(group) == 1:
        return x
    return comm.all_reduce(x.contiguous().clone(), group=group)


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (1/t of it)."""
    t = tp_size(group)
    if x.shape[dim] % t:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split into {t} equal parts")
    return x.chunk(t, dim=dim)[tp_rank(group)].contiguous()


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (``comm.all_gather_into_tensor``)."""
    t = tp_size(group)
    if t == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()   # all_gather_into_tensor concatenates along dim 0
    out = x0.new_empty((t * x0.shape[0],) + x0.shape[1:])
    comm.all_gather_into_tensor(out, x0, group=group)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's slice along ``dim`` (``comm.reduce_scatter_tensor``)."""
    t = tp_size(group)
    if t == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // t,) + x0.shape[1:])
    comm.reduce_scatter_tensor(out, x0, group=group)
    return out.movedim(0, dim)


# ----------------------------------------------------------------------------------------------------
# Tensor parallelism (Megatron-LM): f and g (Korthikanti's f and f̄)
# ----------------------------------------------------------------------------------------------------

class CopyToTensorParallel(torch.autograd.Function):
    """f (both papers): identity forward; backward all-reduces dX, to which every rank's branch added a part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), group=ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g (Shoeybi 2019) = f̄ (Korthikanti 2022): all-reduce forward (sum the ranks' partial products);
    identity backward (dY is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.contiguous().clone(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SplitToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor along ``dim``; backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class GatherFromTensorParallel(torch.autograd.Function):
    """All-gather the ranks' slices along ``dim`` (a column-parallel output made whole); backward keeps
    this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """f: identity forward; all-reduce of the gradient backward (each rank's branch adds a part of dX)."""
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """g (Korthikanti's f̄): all-reduce forward (sum the ranks' partial products); identity backward."""
    return ReduceFromTensorParallel.apply(x, group)


def split_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice of a replicated tensor; backward all-gathers the slices' gradients."""
    return SplitToTensorParallel.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather the ranks' slices (e.g. a column-parallel output); backward keeps this rank's slice."""
    return GatherFromTensorParallel.apply(x, group, dim)


# ----------------------------------------------------------------------------------------------------
# Sequence parallelism (Korthikanti et al. 2022): g and ḡ
# ----------------------------------------------------------------------------------------------------

class GatherSequence(torch.autograd.Function):
    """g (Korthikanti 2022; not Shoeybi's g): sequence shards -> whole sequence before a column-parallel
    layer. Forward all-gathers along the sequence; backward reduce-scatters, since each rank's column shard
    contributed a partial dX for every token."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, SEQ_DIM, ctx.group), None


class ScatterSequence(torch.autograd.Function):
    """ḡ, g-bar (Korthikanti 2022): partial sums -> summed sequence shard after a row-parallel layer.
    Forward reduce-scatters along the sequence; backward all-gathers (the next region needs dY for every
    token)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, SEQ_DIM, ctx.group), None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """g (Korthikanti 2022): all-gather along the sequence forward, reduce-scatter backward."""
    return GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """ḡ (Korthikanti 2022): reduce-scatter along the sequence forward, all-gather backward."""
    return ScatterSequence.apply(x, group)
