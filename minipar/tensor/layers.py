"""Megatron's tensor-parallel layers, cut from a single-device layer (Shoeybi et al. 2019).

A linear layer computes ``Y = X A + b`` (PyTorch stores ``W = Aᵀ``, shape (out, in)). On t ranks:

* **column-parallel**: ``A = [A_1 … A_t]`` by columns (W by rows); rank i computes ``Y_i = X A_i + b_i``,
  a slice of the output features. Needs the whole X: ``f`` in front (backward all-reduce of dX).
* **row-parallel**: ``A = [A_1; …; A_t]`` by rows (W by columns); rank i takes the slice ``X_i`` of the input
  features (the column-parallel output, as it is) and computes the partial sum ``X_i A_i``;
  ``Y = Σ_i X_i A_i`` by ``g`` (all-reduce forward). The bias is added once, after the sum.

So ``MLP(X) = GeLU(X A) B`` is column then row: GeLU acts element-wise on ``X A_i`` (no communication
between the two layers), one all-reduce forward (g) and one backward (f). Attention splits by heads: each
rank's QKV columns are its heads' Q, K and V; the output projection is row-parallel.

With ``sequence_parallel=True`` the layers take and give sequence shards (see :mod:`.sequence`): the
column-parallel layer all-gathers its input, the row-parallel one reduce-scatters its output.

Dropout draws from :class:`minipar.rng.DropoutStreams` (Megatron's seed rule): one stream the same on every rank of the group (for tensors
every rank holds whole), one different on every rank (for tensors each rank holds a different part of).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import canonical
from ..invariant_mode import active as invariant_active
from ..models import CausalSelfAttention
from ..rng import DropoutStreams
from .operators import (copy_to_tp, gather_from_tp, gather_sequence, reduce_from_tp, scatter_sequence, split_to_tp,
                        tp_rank, tp_size)
from .sequence import column_linear_sequence_parallel

__all__ = ["shard_rows", "shard_cols", "streams_of", "recompute_context_fn",
           "dropout", "StreamDropout", "ColumnParallelLinear", "RowParallelLinear",
           "TensorParallelMLP", "TensorParallelAttention", "keep_gathered_inputs"]


def shard_rows(w: torch.Tensor, rank: int, t: int, parts: int = 1) -> torch.Tensor:
    """Rank ``rank``'s rows of ``w``. With ``parts`` > 1 (a fused QKV weight), ``w`` is ``parts`` stacked
    blocks and the shard is this rank's slice of each block, stacked (its heads' Q, K and V)."""
    blocks = w.chunk(parts, dim=0)
    return torch.cat([b.chunk(t, dim=0)[rank] for b in blocks]).detach().clone()


def shard_cols(w: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    return w.chunk(t, dim=1)[rank].detach().clone()


def streams_of(module: nn.Module) -> list:
    """The distinct :class:`DropoutStreams` the dropout layers inside ``module`` draw from."""
    found = {id(m.streams): m.streams for m in module.modules()
             if isinstance(m, StreamDropout) and m.streams is not None}
    return list(found.values())


def recompute_context_fn(module: nn.Module):
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(module, ..., use_reentrant=False)``: every
    stream ``module`` draws from replays its forward's masks in the recomputation."""
    generators = [g for s in streams_of(module) for g in (s.replicated, s.per_rank)]

    def context_fn():
        noted = []
        return _NoteStates(generators, noted), _ReplayStates(generators, noted)
    return context_fn


class _NoteStates:
    """Around a checkpointed forward: note where the generators stand."""

    def __init__(self, generators, noted: list):
        self.generators, self.noted = generators, noted

    def __enter__(self):
        self.noted[:] = [g.get_state() for g in self.generators]

    def __exit__(self, *exc):
        return False


class _ReplayStates(_NoteStates):
    """Around a recomputation (entered again for each one: a zero-bubble schedule recomputes for B and for W):
    start where the forward started, then put the generators back where they were."""

    def __enter__(self):
        self.now = [g.get_state() for g in self.generators]
        for g, state in zip(self.generators, self.noted):
            g.set_state(state)

    def __exit__(self, *exc):
        for g, state in zip(self.generators, self.now):
            g.set_state(state)
        return False


def dropout(x: torch.Tensor, p: float, generator: torch.Generator | None, training: bool) -> torch.Tensor:
    """Inverted dropout with a 1-byte mask drawn from ``generator``."""
    if not training or p == 0.0:
        return x
    keep = torch.empty(x.shape, device=x.device).bernoulli_(1 - p, generator=generator).bool()
    return x * keep / (1 - p)


class StreamDropout(nn.Module):
    """:func:`dropout` as a module drawing from ``streams.per_rank`` (``per_rank=True``: a tensor each rank
    holds a different part of) or ``streams.replicated`` (a tensor every rank holds whole)."""

    def __init__(self, p: float, streams: DropoutStreams | None, per_rank: bool):
        super().__init__()
        self.p, self.streams, self.per_rank = p, streams, per_rank

    def forward(self, x):
        stream = None if self.streams is None else (self.streams.per_rank if self.per_rank
                                                    else self.streams.replicated)
        return dropout(x, self.p, stream, self.training)


class ColumnParallelLinear(nn.Module):
    """``Y_i = X A_i + b_i``: this rank's output features. Built from the full ``weight`` (out, in) and
    ``bias``; ``parts=3`` for a fused QKV weight; ``gather_output`` all-gathers Y (else Y stays split)."""

    def __init__(self, weight, bias, group, parts: int = 1, gather_output: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        t, r = tp_size(group), tp_rank(group)
        if weight.shape[0] % (t * parts):
            raise ValueError(f"{weight.shape[0]} output features do not split into {t} ranks × {parts} parts")
        self.group, self.parts, self.gather_output = group, parts, gather_output
        self.sequence_parallel = sequence_parallel
        self.keep_gathered_input = False       # SP only: keep the gathered input for backward (keep_gathered_inputs)
        self.weight = nn.Parameter(shard_rows(weight, r, t, parts))
        self.bias = None if bias is None else nn.Parameter(shard_rows(bias, r, t, parts))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> "ColumnParallelLinear":
        return cls(linear.weight, linear.bias, group, **kwargs)

    def forward(self, x):
        if invariant_active():
            return self.canonical_forward(x)
        if self.sequence_parallel:   # x is a sequence shard: gather it inside the matmul (saves memory)
            y = column_linear_sequence_parallel(x, self.weight, self.bias, self.group, self.keep_gathered_input)
        else:
            y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)   # f
        return gather_from_tp(y, self.group) if self.gather_output else y

    def canonical_forward(self, x):
        """The invariant mode: each part (Q, K, V of a fused weight) is its own product with its own f (or SP
        all-gather), so dX's sum over a part's output features, split over the ranks, is completed by a tree
        across them before the parts are added (in the same order on one device)."""
        weights = self.weight.chunk(self.parts)
        biases = [None] * self.parts if self.bias is None else self.bias.chunk(self.parts)
        ys = [canonical.linear(gather_sequence(x, self.group) if self.sequence_parallel
                               else copy_to_tp(x, self.group), w, b) for w, b in zip(weights, biases)]
        y = torch.cat(ys, -1)
        return gather_from_tp(y, self.group) if self.gather_output else y


def keep_gathered_inputs(module: nn.Module, keep: bool = True) -> nn.Module:
    """Under sequence parallelism, make every column-parallel layer in ``module`` keep its all-gathered input
    for backward instead of gathering it again there: SP's bytes then equal TP's, for t times the memory
    of those inputs (see :mod:`minipar.tensor.sequence`). Returns ``module``."""
    for m in module.modules():
        if isinstance(m, ColumnParallelLinear):
            m.keep_gathered_input = keep
    return module


class RowParallelLinear(nn.Module):
    """``Y = Σ_i X_i A_i + b``: partial products summed by g (or reduce-scattered along the sequence
    under sequence parallelism), then the full bias, added once on every rank."""

    def __init__(self, weight, bias, group, input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        t, r = tp_size(group), tp_rank(group)
        if weight.shape[1] % t:
            raise ValueError(f"{weight.shape[1]} input features do not split into {t} ranks")
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(shard_cols(weight, r, t))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> "RowParallelLinear":
        return cls(linear.weight, linear.bias, group, **kwargs)

    def forward(self, x):
        if not self.input_is_parallel:
            x = split_to_tp(x, self.group)
        canonical_mode = invariant_active()    # the inner sum a tree: this rank's chunk of it a subtree
        partial = canonical.linear(x, self.weight) if canonical_mode else F.linear(x, self.weight)
        if self.sequence_parallel:             # no bias yet: t ranks would add it t times
            y = scatter_sequence(partial, self.group)
        else:
            y = reduce_from_tp(partial, self.group)
        if self.bias is None:
            return y
        # SP: this rank's tokens are a chunk of each row, so the bias gradient's token sum needs the group
        return canonical.AddBias.apply(y, self.bias, self.group if self.sequence_parallel else None) \
            if canonical_mode else y + self.bias


class TensorParallelMLP(nn.Module):
    """``Dropout(GeLU(X A) B)`` with A column-parallel and B row-parallel: one all-reduce each way."""

    def __init__(self, fc: nn.Linear, proj: nn.Linear, group, sequence_parallel: bool = False,
                 p_dropout: float = 0.0, streams: DropoutStreams | None = None):
        super().__init__()
        self.fc = ColumnParallelLinear.from_linear(fc, group, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_linear(proj, group, sequence_parallel=sequence_parallel)
        self.drop = _residual_dropout(p_dropout, streams, sequence_parallel)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))      # GeLU on this rank's columns: no communication


def _residual_dropout(p, streams, sequence_parallel):
    """Dropout after the row-parallel layer: every rank holds the whole Y under TP (masks must agree),
    a different sequence shard under SP (masks must differ)."""
    return StreamDropout(p, streams, per_rank=sequence_parallel)


class TensorParallelAttention(CausalSelfAttention):
    """Causal self-attention with the heads split: QKV column-parallel (this rank's heads' Q, K, V),
    the attention core on ``n_head`` = n_head/t local heads, the output projection row-parallel. The
    forward and the core are the reference's (:class:`minipar.models.CausalSelfAttention`, with the core a
    strategy set on it); only the layers and the dropout streams differ."""

    def __init__(self, attn, group, sequence_parallel: bool = False, streams: DropoutStreams | None = None):
        nn.Module.__init__(self)
        t = tp_size(group)
        if attn.n_head % t:
            raise ValueError(f"n_head={attn.n_head} is not divisible by the tensor-parallel degree {t}")
        self.n_head, self.dropout = attn.n_head // t, attn.dropout
        self.core = attn.core              # the reference's attention core (a context-parallel method's, if set)
        self.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, parts=3, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_linear(attn.proj, group, sequence_parallel=sequence_parallel)
        self.streams, self.sequence_parallel = streams, sequence_parallel
        self.resid_drop = _residual_dropout(attn.dropout, streams, sequence_parallel)
        self.prob_drop = StreamDropout(attn.dropout, streams, per_rank=True)

    @property
    def local_heads(self) -> int:
        return self.n_head

    def attention_dropout(self, att):
        """Heads differ by rank, so the attention dropout draws from the per-rank stream."""
        return self.prob_drop(att)
