"""Muon under tensor parallelism: a column-parallel matrix is split by rows over the t ranks of the TP group,
a row-parallel one by columns, and Newton–Schulz needs the whole (:mod:`.muon`). Every rank holds its piece of
the gradient already (TP's gradients need no reduction), so the question is only where NS runs:

    per_shard  NS(U_piece), scaled by the piece's shape: another optimizer (tests: how far off)
    gather     all-gather the pieces of U along the split dimension; every rank orthogonalises the whole, keeps
               its piece
    owner      matrix m's owner o_m = m mod t gathers the pieces, orthogonalises, scatters them back

Whole-matrix placement has no TP form: the forward needs every rank's piece of every matrix.

The model: :class:`minipar.models.MLP` with its hidden matrices in Megatron's pairs (column-parallel, then
row-parallel, GeLU between: :mod:`minipar.tensor.layers`); the input layer and the head replicated (AdamW's,
as :func:`.muon.hidden_matrix_names` says). Bytes the optimizer step sends per rank (:func:`step_bytes`),
S_m = b·numel(m) of the whole matrix::

    gather  Σ_m (t−1)/t·S_m            owner  Σ_m ([r≠o_m]·S_m/t + [r=o_m]·(t−1)/t·S_m)            per_shard  0

Sources: Keller Jordan, "Muon" (2024); Shoeybi et al., "Megatron-LM" (2019); Liu et al., "Muon is Scalable
for LLM Training" (2025).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..launcher import launch
from ..models import MLP
from ..recipe import Recipe, RunResult
from ..tensor.layers import ColumnParallelLinear, RowParallelLinear
from .muon import MuonFactory, adamw, apply_update, momentum_update, newton_schulz

__all__ = ["METHODS", "TensorParallelMuon", "validate", "parallel_train", "run", "step_bytes"]

METHODS = ("per_shard", "gather", "owner")


def validate(recipe: Recipe, *, world_size: int, method: str = "owner") -> None:
    if method not in METHODS:
        raise ValueError(f"method {method!r}: use one of {METHODS} (whole-matrix placement has no TP form)")
    if not isinstance(recipe.optimizer, MuonFactory):
        raise ValueError("the recipe's optimizer must be a minipar.optim.muon.MuonFactory (muon_recipe)")
    model = recipe.model()
    if not isinstance(model, MLP) or (len(model.layers) - 2) % 2:
        raise ValueError("Muon TP trains a minipar.models.MLP with an even number of hidden matrices")
    for layer in model.layers[1:-1]:
        if layer.weight.shape[0] % world_size or layer.weight.shape[1] % world_size:
            raise ValueError(f"a hidden matrix {tuple(layer.weight.shape)} does not split over {world_size} ranks")


class TensorParallelMLP(nn.Module):
    """The MLP with hidden layers (column, row, column, row, ...) split over ``group``; the ends replicated."""

    def __init__(self, ref: MLP, group):
        super().__init__()
        hidden = ref.layers[1:-1]
        self.layers = nn.ModuleList(
            [ref.layers[0]]
            + [(ColumnParallelLinear if i % 2 == 0 else RowParallelLinear).from_linear(layer, group)
               for i, layer in enumerate(hidden)]
            + [ref.layers[-1]])

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class TensorParallelMuon:
    """One TP rank: its model, Muon momenta of its pieces of the hidden matrices, AdamW for the rest."""

    def __init__(self, ref: MLP, factory: MuonFactory, group, method: str):
        self.cfg, self.group, self.method = factory.config, group, method
        self.t, self.r = dist.get_world_size(group), dist.get_rank(group)
        self.shapes = {name: p.shape for name, p in ref.named_parameters()}
        self.model = TensorParallelMLP(ref, group)
        self.params = dict(self.model.named_parameters())
        self.hidden = [name for name in self.params if name in factory.hidden]
        self.split_dim = {name: 0 if isinstance(self.model.get_submodule(name.rsplit(".", 1)[0]),
                                                ColumnParallelLinear) else 1 for name in self.hidden}
        self.owner = {name: m % self.t for m, name in enumerate(self.hidden)}
        self.momentum = {name: torch.zeros_like(self.params[name]) for name in self.hidden}
        self.adam = adamw([p for name, p in self.params.items() if name not in factory.hidden], self.cfg)

    @torch.no_grad()
    def optimizer_step(self) -> None:
        for name, buf in self.momentum.items():
            piece = self.params[name]
            ortho = self.orthogonalize(name, momentum_update(piece.grad, buf, self.cfg))
            apply_update(piece, ortho, self.cfg, piece.shape if self.method == "per_shard" else self.shapes[name])
        self.adam.step()
        self.model.zero_grad(set_to_none=True)

    def orthogonalize(self, name: str, update: torch.Tensor) -> torch.Tensor:
        """This rank's piece of NS(U), U the whole matrix's update (pieces split on ``split_dim[name]``)."""
        if self.method == "per_shard":
            return newton_schulz(update, self.cfg)
        dim = self.split_dim[name]
        piece = (update if dim == 0 else update.T).contiguous()      # split along rows, whichever way
        if self.method == "gather":
            whole = torch.empty((self.t * piece.shape[0], piece.shape[1]), dtype=piece.dtype)
            comm.all_gather_into_tensor(whole.view(-1), piece.view(-1), group=self.group)
            ortho = newton_schulz(whole if dim == 0 else whole.T, self.cfg)
            return ortho.chunk(self.t, dim=dim)[self.r]
        mine, owner = self.owner[name] == self.r, dist.get_global_rank(self.group, self.owner[name])
        pieces = [torch.empty_like(piece) for _ in range(self.t)] if mine else None
        comm.gather(piece, pieces, dst=owner, group=self.group)
        chunks = None
        if mine:
            whole = torch.cat(pieces)
            ortho = newton_schulz(whole if dim == 0 else whole.T, self.cfg)
            chunks = [(c if dim == 0 else c.T).contiguous() for c in ortho.chunk(self.t, dim=dim)]
        out = torch.empty_like(piece, dtype=self.cfg.ns_dtype or piece.dtype)
        comm.scatter(out, chunks, src=owner, group=self.group)
        return out if dim == 0 else out.T

    def train_step(self, recipe: Recipe, batch) -> float:
        inputs, targets = batch                   # every TP rank sees the whole batch
        loss = recipe.loss(self.model, inputs, targets)
        loss.backward()                           # TP's gradients: each rank's piece, nothing to reduce
        self.optimizer_step()
        return loss.item()

    def state_tensors(self) -> list:
        """Muon momenta (of this rank's pieces) and AdamW's moments (of the replicated parameters)."""
        return list(self.momentum.values()) + [t for s in self.adam.state.values() for t in s.values()
                                               if torch.is_tensor(t) and t.dim()]

    @torch.no_grad()
    def full_params(self) -> dict:
        out = {}
        for name, p in self.params.items():
            dim = self.split_dim.get(name, 0)
            if p.shape == self.shapes[name]:
                out[name] = p.detach().clone()
                continue
            piece = (p if dim == 0 else p.T).contiguous()
            whole = torch.empty((self.t * piece.shape[0],) + piece.shape[1:], dtype=p.dtype)
            comm.all_gather_into_tensor(whole.view(-1), piece.view(-1), group=self.group)
            out[name] = whole if dim == 0 else whole.T
        return out


def parallel_train(rank, world_size, recipe: Recipe, *, method: str = "owner", group=None) -> RunResult:
    """Train ``recipe`` with Muon over the TP ``group`` (default: all ranks); full parameters at the end."""
    group = group if group is not None else dist.group.WORLD
    trainer = TensorParallelMuon(recipe.model().to(recipe.dtype), recipe.optimizer, group, method)
    losses = [trainer.train_step(recipe, batch) for batch in recipe.batches]
    return RunResult(losses, trainer.full_params())


def run(recipe: Recipe, *, world_size: int, method: str = "owner", **launch_kwargs):
    validate(recipe, world_size=world_size, method=method)
    return launch(parallel_train, world_size, recipe, method=method, **launch_kwargs)


def step_bytes(recipe: Recipe, *, world_size: int, method: str, rank: int) -> float:
    """The docstring's bytes one TP rank sends in one optimizer step."""
    t, factory = world_size, recipe.optimizer
    hidden = [name for name in factory.names if name in factory.hidden]
    size = {name: p.numel() * p.element_size() for name, p in recipe.model().to(recipe.dtype).named_parameters()}
    total = 0.0
    for m, name in enumerate(hidden):
        if method == "gather":
            total += (t - 1) / t * size[name]
        elif method == "owner":
            total += (t - 1) / t * size[name] if m % t == rank else size[name] / t
    return total
