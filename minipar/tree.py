"""One sum in one order: Σ over a dimension as a balanced tree of adjacent pairs — the canonical order of the
invariant mode (:mod:`minipar.invariant_mode`). A contiguous, power-of-two aligned chunk of the dimension is a
subtree, so a rank that sums its chunk and a tree over the ranks' chunks in rank order build one device's tree
exactly. No imports of minipar: the communication layer (:mod:`minipar.comm`) and the canonical operators
(:mod:`minipar.canonical`) both use it."""
from __future__ import annotations

import torch

__all__ = ["tree_sum"]


def tree_sum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Σ over ``dim`` as a balanced tree of adjacent pairs (a length that is no power of two is padded with
    zeros at the end: x + 0 = x exactly)."""
    x = x.movedim(dim, 0)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = torch.cat([x, x.new_zeros((1,) + x.shape[1:])])
        x = x[0::2] + x[1::2]
    return x[0]
