"""The tiny GPT made tensor-parallel by swapping its layers, and back (Shoeybi et al. 2019; with
``sequence_parallel=True``, Korthikanti et al. 2022).

:class:`TensorParallelGPT` is built from a single-device :class:`minipar.models.TinyGPT`: every shard is
cut from the reference weights, so a parallel run starts from exactly the same model. Per block::

    x = x + Attn(LN1(x))     QKV column-parallel (heads split), projection row-parallel
    x = x + MLP(LN2(x))      fc column-parallel, GeLU on the shard, proj row-parallel

The token embedding and the LM head are vocabulary-parallel, and the loss is computed from the
vocabulary-sharded logits (:func:`minipar.tensor.vocab.vocab_parallel_cross_entropy`).
:meth:`TensorParallelGPT.full_state_dict` gathers the shards back into one state dict under the
reference names, so :mod:`minipar.check` compares parameter by parameter.

The group is an argument: the tensor-parallel group of a :class:`minipar.mesh.RankMesh` in a hybrid run.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import canonical
from ..check import check_equivalence
from ..invariant_mode import active as invariant_active
from ..recipe import Recipe, RunResult
from ..rng import DropoutStreams
from ..launcher import launch
from ..loop import lm_loss
from ..mesh import Mesh
from ..models import FeedForward, TokenPositionEmbedding
from ..validation import positive_int
from .layers import (ColumnParallelLinear, RowParallelLinear, StreamDropout, TensorParallelAttention,
                     TensorParallelMLP)
from .operators import all_gather_dim, tp_rank, tp_size
from .sequence import sync_sequence_parallel_grads
from .vocab import VocabParallelEmbedding, pad_rows, padded_vocab_size, vocab_parallel_cross_entropy

__all__ = ["validate", "TensorParallelBlock", "SequenceShardEmbedding", "TensorParallelGPT", "smoothed_recipe", "parallel_train", "run",
           "compare_to_one_device"]


def validate(cfg, *, tp: int, seq_len: int | None = None, sequence_parallel: bool = False) -> None:
    """Raise a ValueError (before any process starts) if the model ``cfg`` cannot be split ``tp`` ways."""
    positive_int("the tensor-parallel degree", tp)
    for what, size in (("n_head (attention heads)", cfg.n_head), ("n_embd (hidden size)", cfg.n_embd),
                       ("ffn_hidden (MLP hidden size)", cfg.ffn_hidden)):
        if size % tp:
            raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel degree {tp}: "
                             f"each rank must get the same number of heads / columns")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence parallelism splits the sequence into {tp} shards, but the sequence "
                         f"length {seq_len} is not divisible by {tp}")


class TensorParallelBlock(nn.Module):
    def __init__(self, block, group, sequence_parallel: bool, streams: DropoutStreams):
        super().__init__()
        self.ln1, self.ln2 = block.ln1, block.ln2      # replicated; on sequence shards under SP
        self.attn = TensorParallelAttention(block.attn, group, sequence_parallel, streams)
        # a block's FFN is split over tp; any other MLP (an MoE layer) stays whole on every tp rank (expert-TP = 1)
        self.mlp = TensorParallelMLP(block.mlp.fc, block.mlp.proj, group, sequence_parallel,
                                     block.mlp.drop.p, streams) if isinstance(block.mlp, FeedForward) else block.mlp

    def forward(self, x):
        if invariant_active():     # LayerNorm's statistics and weight gradients as canonical trees
            seq_group = self.attn.proj.group if self.attn.sequence_parallel else None
            x = x + self.attn(canonical.layer_norm(self.ln1, x, seq_group))
            return x + self.mlp(canonical.layer_norm(self.ln2, x, seq_group))
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SequenceShardEmbedding(TokenPositionEmbedding):
    """The reference's embedding seam on a tensor-parallel rank: under sequence parallelism the
    vocabulary-parallel ``tok_emb`` returns this rank's s/t tokens (a reduce-scatter), so the positions it
    holds are its chunk of 0 … s − 1. Needs ``group`` and ``sequence_parallel`` besides the seam's attributes."""

    def positions_held(self, idx):
        positions = super().positions_held(idx)
        return positions.chunk(tp_size(self.group))[tp_rank(self.group)] if self.sequence_parallel else positions

    def sequence_split_group(self):
        return self.group if self.sequence_parallel else None

    def final_norm(self, x):
        """``ln_f(x)``; in the invariant mode canonical (its gradient over the SP ranks' chunks too)."""
        return canonical.layer_norm(self.ln_f, x, self.sequence_split_group()) if invariant_active() else self.ln_f(x)


class TensorParallelGPT(SequenceShardEmbedding, nn.Module):
    """``forward(idx)`` returns this rank's vocabulary columns of the logits, (b, s, V_padded/t)."""

    def __init__(self, ref, group, sequence_parallel: bool = False, seed: int = 0):
        super().__init__()
        cfg, t = ref.cfg, tp_size(group)
        validate(cfg, tp=t)
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        self.streams = DropoutStreams(seed, group, ref.tok_emb.weight.device)
        self.tok_emb = VocabParallelEmbedding(ref.tok_emb, group, sequence_parallel)
        self.pos_emb, self.ln_f = ref.pos_emb, ref.ln_f
        self.drop = StreamDropout(cfg.dropout, self.streams, per_rank=sequence_parallel)  # SP: shards differ
        self.blocks = nn.ModuleList(TensorParallelBlock(b, group, sequence_parallel, self.streams)
                                    for b in ref.blocks)
        head = pad_rows(ref.head.weight, padded_vocab_size(cfg.vocab_size, t))
        self.head = ColumnParallelLinear(head, None, group, sequence_parallel=sequence_parallel)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight   # the same vocabulary rows on this rank

    def forward(self, idx, positions=None):
        """``positions``: the global positions of the tokens the embedding returns (default: all of ``idx``'s,
        or this rank's shard of them under SP); a context-parallel rank passes its own."""
        x = self.embed(idx, positions)                 # whole sequence, or my shard under SP
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))           # the head all-gathers the sequence under SP

    def loss(self, idx, targets, label_smoothing: float = 0.0):
        per_token = vocab_parallel_cross_entropy(self(idx), targets, self.group, self.cfg.vocab_size,
                                                 label_smoothing)
        return per_token.mean()

    def sequence_parallel_params(self) -> list:
        """Replicated parameters applied to sequence shards (their gradients need a sum over the group)."""
        if not self.sequence_parallel:
            return []
        params = list(self.pos_emb.parameters()) + list(self.ln_f.parameters())
        for b in self.blocks:
            params += list(b.ln1.parameters()) + list(b.ln2.parameters())
            params += [m.bias for m in (b.attn.proj, b.mlp.proj) if m.bias is not None]
        return params

    def finish_backward(self) -> None:
        """Call after ``backward()``: the SP gradient sum (nothing to do without SP)."""
        sync_sequence_parallel_grads(self.sequence_parallel_params(), self.group)

    def full_state_dict(self) -> dict:
        """Every parameter whole, under the reference names (a collective: every rank of the group calls it)."""
        out = {}
        for name, p in self.named_parameters():
            module_name = name.rsplit(".", 1)[0]
            module = self.get_submodule(module_name)
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                full = _gather_rows(p.detach(), self.group, getattr(module, "parts", 1))
                if module_name in ("tok_emb", "head"):
                    full = full[: self.cfg.vocab_size]        # drop the padding rows
            elif isinstance(module, RowParallelLinear) and name.endswith("weight"):
                full = all_gather_dim(p.detach(), 1, self.group).clone()   # tp=1: a copy, not the live tensor
            else:
                full = p.detach().clone()
            out[name] = full
        return out


def _gather_rows(shard, group, parts):
    """Inverse of :func:`minipar.tensor.layers.shard_rows`: all-gather and put each part's rows back."""
    gathered = all_gather_dim(shard, 0, group).chunk(tp_size(group))           # one shard per rank
    return torch.cat([torch.cat([g.chunk(parts)[i] for g in gathered]) for i in range(parts)])


def smoothed_recipe(recipe: Recipe, label_smoothing: float) -> Recipe:
    """``recipe`` whose single-device loss uses the same label smoothing as the parallel run."""
    if not label_smoothing:
        return recipe
    loss = lambda model, x, y: lm_loss(model(x), y, label_smoothing)  # noqa: E731
    return Recipe(recipe.model, recipe.batches, recipe.optimizer, loss, recipe.dtype, recipe.name)


def parallel_train(rank, world_size, recipe: Recipe, *, sequence_parallel: bool = False,
                   label_smoothing: float = 0.0, group=None, after_step=None) -> RunResult:
    """Train ``recipe`` (a TinyGPT) tensor-parallel; every rank of the group gets the whole batch.
    ``group`` defaults to a tensor-parallel group over all ranks (``Mesh(world_size, tp=world_size)``).
    ``after_step(model)`` (optional) runs after each optimizer step, as in :func:`minipar.check.train_steps`
    (a caller that watches the run: chapter 13 keeps the full parameters of every step)."""
    group = group if group is not None else Mesh(world_size, tp=world_size).build(rank).group("tp")
    ref = recipe.model().to(recipe.dtype)
    model = TensorParallelGPT(ref, group, sequence_parallel)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for inputs, targets in recipe.batches:
        opt.zero_grad(set_to_none=True)
        loss = model.loss(inputs, targets, label_smoothing)
        loss.backward()
        model.finish_backward()
        opt.step()
        if after_step is not None:
            after_step(model)
        losses.append(loss.item())
    return RunResult(losses, model.full_state_dict())


def run(recipe: Recipe, *, world_size: int, sequence_parallel: bool = False, label_smoothing: float = 0.0,
        quiet: bool = True) -> list:
    """Validate, then train with TP (± SP) on ``world_size`` ranks: per-rank RunResults."""
    validate(recipe.model().cfg, tp=world_size, seq_len=recipe.batches[0][0].shape[1],
             sequence_parallel=sequence_parallel)
    return launch(parallel_train, world_size, recipe, sequence_parallel=sequence_parallel,
                  label_smoothing=label_smoothing, quiet=quiet)


def compare_to_one_device(recipe: Recipe, *, world_size: int, sequence_parallel: bool = False,
                          label_smoothing: float = 0.0, **check_kwargs):
    """Validate, train with TP (± SP) and compare with one device training the same loss
    (:func:`minipar.check.check_equivalence`). Returns the :class:`~minipar.check.Comparison`."""
    validate(recipe.model().cfg, tp=world_size, seq_len=recipe.batches[0][0].shape[1],
             sequence_parallel=sequence_parallel)
    return check_equivalence(parallel_train, world_size, smoothed_recipe(recipe, label_smoothing),
                             sequence_parallel=sequence_parallel, label_smoothing=label_smoothing,
                             **check_kwargs)

