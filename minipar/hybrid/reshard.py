"""Where each tensor-parallel piece sits in the full tensor, and the moves between the two: what lets a
checkpoint saved at one tp degree load at another (:mod:`minipar.hybrid.checkpoint`).

A parameter of :class:`minipar.tensor.gpt.TensorParallelGPT` is one of three kinds:

* ``"rows"`` — column-parallel weights and biases, and the vocabulary rows of the embedding and the head:
  rank r holds rows ``[r·R/t, (r+1)·R/t)`` of each of ``parts`` stacked blocks (3 for a fused QKV weight);
  a vocabulary tensor is padded with zero rows to a multiple of t first, and the padding is dropped again;
* ``"cols"`` — row-parallel weights: rank r holds columns ``[r·C/t, (r+1)·C/t)``;
* ``"whole"`` — LayerNorms, row-parallel biases, position embeddings: the same on every rank.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..tensor.layers import ColumnParallelLinear, RowParallelLinear, shard_cols, shard_rows
from ..tensor.operators import all_gather_dim, tp_size
from ..tensor.vocab import VocabParallelEmbedding, pad_rows, padded_vocab_size

__all__ = ["tp_layouts", "to_full", "to_shard"]

WHOLE = ("whole", 1, None)


def tp_layouts(model: nn.Module) -> dict:
    """{id(parameter): (kind, parts, vocab rows or None)} for every parameter of ``model``."""
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    layouts = {}
    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding):
            layouts.setdefault(id(module.weight), ("rows", 1, module.vocab_size))
        elif isinstance(module, ColumnParallelLinear):
            rows = vocab if name.split(".")[-1] == "head" else None
            for p in (module.weight, module.bias):
                if p is not None:
                    layouts.setdefault(id(p), ("rows", module.parts, rows))
        elif isinstance(module, RowParallelLinear):
            layouts.setdefault(id(module.weight), ("cols", 1, None))
    for p in model.parameters():
        layouts.setdefault(id(p), WHOLE)
    return layouts


def to_full(piece: torch.Tensor, layout: tuple, group) -> torch.Tensor:
    """The full tensor from every rank's ``piece`` (a collective over the tp ``group``)."""
    kind, parts, vocab = layout
    if kind == "whole":
        return piece.detach().clone()
    if kind == "cols":
        return all_gather_dim(piece.detach().contiguous(), 1, group).clone()
    gathered = all_gather_dim(piece.detach().contiguous(), 0, group).chunk(tp_size(group))   # one per rank
    full = torch.cat([torch.cat([g.chunk(parts)[i] for g in gathered]) for i in range(parts)])
    return full[:vocab].clone() if vocab is not None else full


def to_shard(full: torch.Tensor, layout: tuple, rank: int, t: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` on a tp group of ``t`` (no communication: every rank cuts its own)."""
    kind, parts, vocab = layout
    if kind == "whole":
        return full.detach().clone()
    if kind == "cols":
        return shard_cols(full, rank, t)
    if vocab is not None:
        full = pad_rows(full, padded_vocab_size(vocab, t))
    return shard_rows(full, rank, t, parts)
