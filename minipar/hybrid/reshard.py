"""Where each tensor-parallel piece sits in the full tensor, and the moves between the two: what lets a
checkpoint saved at one tp degree load at another (:mod:`minipar.hybrid.checkpoint`).

A parameter of :class:`minipar.tensor.gpt.TensorParallelGPT` is one of three kinds:

* ``"rows"`` — column-parallel weights and biases, and the vocabulary rows of the embedding and the head:
  rank r holds rows ``[r·R/t, (r+1)·R/t)`` of each of ``parts`` stacked blocks (3 for a fused QKV weight);
  a vocabulary tensor is padded with zero rows to a multiple of t first, and the padding is dropped again;
* ``"cols"`` — row-parallel weights: rank r holds columns ``[r·C/t, (r+1)·C/t)``;
* ``"whole"`` — LayerNorms, row-parallel biases, position embeddings, an MoE model's routers and experts
  (expert-TP = 1): the same on every rank.

The optimizer side: :func:`optimizer_pieces` gathers ZeRO-1's flat shards into per-parameter moments (the
experts, outside the shards, from their own optimizer) and :func:`set_optimizer_state` cuts them back.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..tensor.layers import ColumnParallelLinear, RowParallelLinear, shard_cols, shard_rows
from ..tensor.operators import all_gather_dim, tp_size
from ..tensor.vocab import VocabParallelEmbedding, pad_rows, padded_vocab_size

__all__ = ["tp_layouts", "to_full", "to_shard", "optimizer_pieces", "set_optimizer_state"]

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


def _plain_pieces(optimizer, params, pieces: dict, scalars: dict) -> None:
    for p in params:
        for k, v in optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and v.shape == p.shape:
                pieces.setdefault(id(p), {})[k] = v
            else:
                scalars[k] = v


def optimizer_pieces(trainer) -> tuple:
    """({id(param): {state key: TP piece}}, {scalar key: tensor}) of this rank's stages, ZeRO-1's flat
    shards gathered over dp × cp first (a collective); an MoE model's experts, outside ZeRO-1's shards, from
    their own optimizer (the same Adam step count)."""
    pieces, scalars = {}, {}
    if trainer.zero is None:
        _plain_pieces(trainer.optimizer, trainer.params, pieces, scalars)
        return pieces, scalars
    if trainer.experts and trainer.experts.optimizer:
        _plain_pieces(trainer.experts.optimizer, trainer.experts.params, pieces, scalars)
    for unit in trainer.zero.units:
        for k, v in trainer.optimizer.state.get(unit.master, {}).items():
            if not (torch.is_tensor(v) and v.shape == unit.master.shape):
                scalars[k] = v
                continue
            for p, full in zip(unit.params, unit.full_tensors(v)):     # all-gather the moment, cut it
                pieces.setdefault(id(p), {})[k] = full
    return pieces, scalars


def set_optimizer_state(trainer, pieces: dict, scalars: dict) -> None:
    """Install full-size ``pieces`` {state key: {id(param): this rank's TP piece}} and ``scalars`` into the
    trainer's optimizer(s): per parameter, or cut into this rank's ZeRO-1 slice of each flat buffer."""
    def plain(optimizer, params):
        for p in params:
            optimizer.state[p] = {**{k: v.clone() for k, v in scalars.items()}, **{k: pieces[k][id(p)] for k in pieces}}
    if trainer.zero is None:
        return plain(trainer.optimizer, trainer.params)
    if trainer.experts and trainer.experts.optimizer:
        plain(trainer.experts.optimizer, trainer.experts.params)
    for unit in trainer.zero.units:
        state = {k: v.clone() for k, v in scalars.items()}
        for k in pieces:
            state[k] = unit.my_shard([pieces[k][id(p)] for p in unit.params])
        trainer.optimizer.state[unit.master] = state
