"""The vocabulary split across the tensor-parallel group: embedding and cross-entropy (Shoeybi et al.
2019, §3).

Rank i owns the vocabulary rows ``[i·V/t, (i+1)·V/t)`` of the embedding and of the LM head (a column-parallel
layer over the vocabulary). The vocabulary is padded to a multiple of t (:func:`padded_vocab_size`); padded
rows are never looked up and their logits are masked out of the loss.

* **Embedding**: each rank looks up the ids it owns, writes zeros for the others, and the ranks' outputs
  are summed (g; under sequence parallelism a reduce-scatter).
* **Cross-entropy without the full logits**: with z the logits (b·s × V, split by columns),
  ``loss = log Σ_j exp(z_j) − z_target``, computed with three reductions over the group of vectors of
  b·s numbers, never of the b·s × V logits:

  1. ``m = max_j z_j``  (all-reduce MAX: a stable exp needs the global max);
  2. ``z_target − m``   (all-reduce SUM: only the rank that owns the target has it, the others add 0);
  3. ``Σ_j exp(z_j − m)`` (all-reduce SUM), together with ``Σ_j (z_j − m)`` when label smoothing is on.

  Label smoothing ε: ``(1−ε)(log Z − z_t) + ε(log Z − mean_j z_j)``, as ``F.cross_entropy(label_smoothing=ε)``.
  The gradient is ``softmax − (1−ε)·onehot − ε/V``, computed from this rank's columns only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import canonical, comm
from ..invariant_mode import active as invariant_active
from .operators import reduce_from_tp, scatter_sequence, tp_rank, tp_size

__all__ = ["padded_vocab_size", "pad_rows", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def padded_vocab_size(vocab_size: int, t: int) -> int:
    """The smallest multiple of t that holds the vocabulary."""
    return -(-vocab_size // t) * t


def pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` with zero rows appended up to ``rows``."""
    return torch.cat([w.detach(), w.new_zeros((rows - w.shape[0],) + tuple(w.shape[1:]))])


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the (padded) embedding table; ids outside them are masked, outputs summed."""

    def __init__(self, emb: nn.Embedding, group, sequence_parallel: bool = False):
        super().__init__()
        t, r = tp_size(group), tp_rank(group)
        self.vocab_size = emb.num_embeddings
        per_rank = padded_vocab_size(self.vocab_size, t) // t
        self.start, self.end = r * per_rank, (r + 1) * per_rank
        self.group, self.sequence_parallel = group, sequence_parallel
        full = pad_rows(emb.weight, t * per_rank)
        self.weight = nn.Parameter(full[self.start: self.end].clone())

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)                # any valid row; zeroed below
        lookup = canonical.embedding if invariant_active() else F.embedding   # invariant: Σ over tokens a tree
        out = lookup(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return scatter_sequence(out, self.group)                     # sum, and keep my tokens
        return reduce_from_tp(out, self.group)                            # g


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, label_smoothing, group):
        n_local = logits.shape[-1]
        columns = torch.arange(vocab_start, vocab_start + n_local, device=logits.device)
        real = columns < vocab_size                                       # padded columns are no class
        logits = logits.masked_fill(~real, float("-inf"))

        m = logits.max(dim=-1).values                                     # 1. the global max
        comm.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = logits - m.unsqueeze(-1)

        owned = (targets >= vocab_start) & (targets < vocab_start + n_local)
        local_target = (targets - vocab_start).masked_fill(~owned, 0)
        z_target = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        comm.all_reduce(z_target, group=group)                           # 2. the target's logit

        exp_z = z.exp()
        total = canonical.tree_sum if invariant_active() else torch.sum   # invariant: this shard a subtree
        sums = [total(exp_z, -1)] + ([total(z.masked_fill(~real, 0.0), -1)] if label_smoothing else [])
        sums = torch.stack(sums)
        comm.all_reduce(sums, group=group)                  # 3. Σ exp (and Σ z); invariant: the tree finished
        log_partition = sums[0].log()
        loss = log_partition - z_target
        if label_smoothing:
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_partition - sums[1] / vocab_size)

        ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
        ctx.save_for_backward(exp_z / sums[0].unsqueeze(-1), local_target, owned, real)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, owned, real = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (1 - eps) * owned.to(grad.dtype)
        if eps:
            grad -= (eps / ctx.vocab_size) * real.to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, group, vocab_size: int,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy from this rank's columns of the logits ``(..., V_padded/t)``; ``targets``
    ``(...)`` are global ids < ``vocab_size``. Same value on every rank of ``group``."""
    t = tp_size(group)
    n_local = logits_shard.shape[-1]
    if n_local * t < vocab_size:
        raise ValueError(f"{t} shards of {n_local} columns do not cover a vocabulary of {vocab_size}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    start = tp_rank(group) * n_local
    flat = logits_shard.reshape(-1, n_local)
    loss = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), start, vocab_size, label_smoothing, group)
    return loss.view(targets.shape)
