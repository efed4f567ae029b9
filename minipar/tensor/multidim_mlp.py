"""The reference MLP on 1D, 2D, 2.5D and 3D tensor parallelism: trained against one device, and measured.

``run(recipe, world_size=4, layout="2d")`` checks the layout fits (:func:`validate`, before any process
starts), then trains ``recipe`` (an :func:`minipar.check.mlp_recipe`, mean-squared-error loss) on the
ranks with :func:`parallel_train` and compares loss and parameters with one device.

Every layout keeps each element of the output on exactly one rank (1D: on all), so the loss is
``Σ_ranks Σ_my elements (y − t)² / (tokens · features)`` and each rank's backward starts from its own part.

=========  ======================  =============================  ==================================
layout     grid                    weight held per rank           activation held per rank
=========  ======================  =============================  ==================================
``1d``     P (Megatron, :mod:`.layers`)   1/P                     whole (X and Y replicated)
``2d``     q×q (:mod:`.tp2d`)      1/q²                           1/q²
``2.5d``   d×q×q (:mod:`.tp2p5d`)  1/q²  (replicated over depth)  1/(d·q²)
``3d``     q×q×q (:mod:`.tp3d`)    1/q³                           1/q³ (plus the gathered blocks
                                                                  kept for backward)
=========  ======================  =============================  ==================================

What each layout costs (bytes, messages, memory; measured from the communication log, beside the closed
forms) is measured beside this file, in :mod:`minipar.tensor.multidim_measure`.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from .. import comm
from ..check import check_equivalence
from ..recipe import RunResult, default_loss
from ..mesh import Mesh
from ..models import MLP
from . import grid as grids
from . import tp2d, tp2p5d, tp3d
from .layers import ColumnParallelLinear, RowParallelLinear
from .operators import all_gather_dim

__all__ = ["LAYOUTS", "in_dtype", "validate", "make_grid", "build_group", "MultiDimMLP", "parallel_train", "run"]

LAYOUTS = ("1d", "2d", "2.5d", "3d")


def in_dtype(recipe, dtype=torch.float64):
    """A copy of ``recipe`` trained in ``dtype``, its batches converted too (float64: only summation order
    differs from one device, so the comparison can be tight)."""
    batches = [(x.to(dtype), t.to(dtype) if t.is_floating_point() else t) for x, t in recipe.batches]
    return dataclasses.replace(recipe, batches=batches, dtype=dtype)


def make_grid(layout: str, world_size: int, depth: int = 2):
    """The pure grid (a :class:`minipar.mesh.Mesh`) of a layout; ValueError if the world does not fit."""
    if layout == "1d":
        return Mesh(world_size, tp=world_size)
    if layout == "2d":
        return grids.grid_2d(world_size)
    if layout == "2.5d":
        return grids.grid_2p5d(world_size, depth)
    if layout == "3d":
        return grids.grid_3d(world_size)
    raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")


def _divisors(layout, world_size, depth):
    """(what the token count must divide by, what each feature size must divide by) for a layout."""
    mesh = make_grid(layout, world_size, depth)
    q = mesh.size(mesh.dims[-1])
    return {"1d": (1, world_size), "2d": (q, q), "2.5d": (depth * q, q), "3d": (q * q, q * q)}[layout]


def validate(recipe, *, world_size: int, layout: str, depth: int = 2) -> None:
    """ValueError with the reason if ``recipe``'s MLP and batches do not fit ``layout`` on ``world_size``."""
    token_div, feature_div = _divisors(layout, world_size, depth)
    model = recipe.model()
    layers = getattr(model, "layers", None)
    if layers is None or not all(isinstance(m, nn.Linear) for m in layers):
        raise ValueError("multi-dimensional TP here takes the reference MLP (minipar.models.MLP)")
    if recipe.loss is not default_loss:
        raise ValueError("the parallel loss is the mean squared error of default_loss; use mlp_recipe's loss")
    for n, layer in enumerate(layers):
        for what, size in (("in_features", layer.in_features), ("out_features", layer.out_features)):
            if size % feature_div:
                raise ValueError(f"layers.{n}.{what} = {size} does not divide by {feature_div} ({layout} on "
                                 f"{world_size} ranks)")
    for s, (inputs, targets) in enumerate(recipe.batches):
        if targets.dtype == torch.long:
            raise ValueError("the parallel loss is the mean squared error: targets must be float")
        if inputs.shape[0] % token_div:
            raise ValueError(f"batch {s} has {inputs.shape[0]} rows, which do not divide by {token_div} "
                             f"({layout} on {world_size} ranks)")


class MultiDimMLP(nn.Module):
    """``MLP`` (Linear, GeLU, …, Linear) with every layer on the grid; cut from the reference weights."""

    def __init__(self, ref: nn.Module, layout: str, g):
        super().__init__()
        self.layout, self.g = layout, g
        n = len(ref.layers)
        if layout == "1d":
            made = [ColumnParallelLinear.from_linear(l, g, gather_output=(i == n - 1)) if i % 2 == 0
                    else RowParallelLinear.from_linear(l, g) for i, l in enumerate(ref.layers)]
        elif layout == "2d":
            made = [tp2d.Linear2D(l, g) for l in ref.layers]
        elif layout == "2.5d":
            made = [tp2p5d.Linear2p5D(l, g) for l in ref.layers]
        else:
            made = [tp3d.Linear3D(l, g, i) for i, l in enumerate(ref.layers)]
        self.layers = nn.ModuleList(made)

    forward = MLP.forward       # the reference MLP's own forward (GELU between layers), over the sharded layers

    def _cut(self, t, last: bool):
        """This rank's part of a (tokens, features) tensor: the input (last=False) or the output layout."""
        g = self.g
        if self.layout == "1d":
            return t
        if self.layout == "2d":
            return tp2d.block(t, g.coord("i"), g.coord("j"), g.size("i"))
        if self.layout == "2.5d":
            return tp2p5d.x_block(t, g.coord("k"), g.coord("i"), g.coord("j"), g.size("i"), g.size("k"))
        m, k, n = (g.coord(d) for d in tp3d.roles(len(self.layers) - 1 if last else 0))
        return tp3d.piece(t, m, n, k, g.size("x")) if last else tp3d.piece(t, m, k, n, g.size("x"))

    def input_part(self, x):
        return self._cut(x, last=False)

    def output_part(self, y):
        return self._cut(y, last=True)

    def sync_grads(self):
        if self.layout == "1d":
            return                     # f and g already made every gradient whole
        for layer in self.layers:
            layer.sync_grads()

    def full_params(self) -> dict:
        out = {}
        for n, layer in enumerate(self.layers):
            if self.layout == "1d":
                column = n % 2 == 0
                out[f"layers.{n}.weight"] = all_gather_dim(layer.weight.detach(), 0 if column else 1, self.g)
                if layer.bias is not None:
                    b = layer.bias.detach()
                    out[f"layers.{n}.bias"] = all_gather_dim(b, 0, self.g) if column else b.clone()
                continue
            out[f"layers.{n}.weight"] = layer.full_weight()
            if layer.bias is not None:
                out[f"layers.{n}.bias"] = layer.full_bias()
        return out


def build_group(rank: int, world_size: int, layout: str, depth: int = 2):
    """This rank's part of the layout's grid: the tp group (1D) or the grid's groups (2D / 2.5D / 3D)."""
    mesh = make_grid(layout, world_size, depth)
    return mesh.build(rank).group("tp") if layout == "1d" else grids.build(mesh, rank)


def _local_loss(model, inputs, targets):
    """This rank's share of the mean squared error (1D: every rank holds the whole output)."""
    y = model(model.input_part(inputs))
    t = model.output_part(targets)
    return (y - t).pow(2).sum() / targets.numel()


def parallel_train(rank, world_size, recipe, *, layout: str, depth: int = 2) -> RunResult:
    """Train ``recipe`` on this rank's part of the grid; report losses and full parameters."""
    g = build_group(rank, world_size, layout, depth)
    model = MultiDimMLP(recipe.model().to(recipe.dtype), layout, g)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for inputs, targets in recipe.batches:
        opt.zero_grad(set_to_none=True)
        loss = _local_loss(model, inputs.to(recipe.dtype), targets.to(recipe.dtype))
        loss.backward()
        model.sync_grads()
        opt.step()
        total = loss.detach().clone().reshape(1)
        if layout != "1d":
            comm.all_reduce(total)     # every element of the output lives on one rank: add the shares
        losses.append(total.item())
    return RunResult(losses, model.full_params())


def run(recipe, *, world_size: int, layout: str, depth: int = 2, launch_kwargs: dict | None = None):
    """Validate, then train on ``world_size`` ranks and compare with one device (a ``Comparison``)."""
    validate(recipe, world_size=world_size, layout=layout, depth=depth)
    return check_equivalence(parallel_train, world_size, recipe, layout=layout, depth=depth,
                             launch_kwargs=launch_kwargs)
