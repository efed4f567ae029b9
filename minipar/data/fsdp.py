"""FSDP: ZeRO-3 as PyTorch ships it, where the user chooses the units that are gathered together
(Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", arXiv:2304.11277).

A *unit* is a module whose parameters are all-gathered together before it runs and freed after: here one
transformer block each, plus the root (embeddings, final LayerNorm, head). Bigger units mean fewer,
larger collectives (better bandwidth) but more parameters alive at once; smaller units the reverse. The
peak of gathered parameters is about (root + 2 units) with prefetch: the unit computing and the next one
arriving.

Flat parameters, not per-parameter shards. minipar concatenates a unit's parameters into one flat buffer,
pads it once to a multiple of N and gives rank r the r-th contiguous slice (FSDP1's ``FlatParameter``):
one all-gather and one reduce-scatter per unit, straight into and out of the buffer the module computes
with, at most N-1 padding elements per unit. PyTorch's FSDP2 (``fully_shard``) instead shards every
parameter on dim 0 (a ``DTensor`` per parameter, each padded to a multiple of N): parameters keep their
identity, shape and dtype, so per-parameter optimizers, frozen parameters and sharded checkpoints are
simple, at the price of a copy into a staging buffer around each collective. Both move the same bytes:
3 · b · Ψ · (N-1)/N per step. ``torch_fsdp2_train`` runs PyTorch's version on the same recipe so the
two can be compared step by step.

The mechanism (gather, compute, free; prefetch; reduce-scatter) lives in :mod:`minipar.data.zero` and
:mod:`minipar.data.flat_unit`.
"""
from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from ..check import RunResult
from ..launcher import launch
from ..loop import mean_over_ranks, shard_batch
from . import zero

__all__ = ["block_units", "single_unit", "validate", "fully_shard", "parallel_train", "torch_fsdp2_train",
           "run"]

block_units = zero.block_units                 # one unit per transformer block + the root


def single_unit(model: nn.Module) -> list:
    """The whole model as one unit: ZeRO-3 memory between steps, but every parameter alive while it runs."""
    return [model]


def validate(recipe, *, world_size: int, units=block_units, **_) -> None:
    """ValueError, before any process starts, unless the batch splits over the ranks and every trainable
    parameter belongs to one of the chosen units' modules."""
    zero.validate(recipe, world_size=world_size, stage=3)
    model = recipe.model()
    modules = units(model) if callable(units) else units
    inside = {id(p) for m in modules for p in m.parameters()}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside]
    if missing:
        raise ValueError(f"parameters {missing[:3]} are in no unit; add the root module to the units "
                         f"(it takes whatever the other units leave)")


def fully_shard(model: nn.Module, optimizer_factory, units=block_units, group=None, param_dtype=None,
                prefetch: bool = True) -> zero.ZeRO:
    """Shard ``model`` FSDP-style: ZeRO stage 3 over the units ``units(model)`` (nested units first,
    the root last). Returns the :class:`~minipar.data.zero.ZeRO` object that owns the optimizer."""
    modules = units(model)
    inside = {id(p) for m in modules for p in m.parameters()}
    if any(p.requires_grad and id(p) not in inside for p in model.parameters()):
        raise ValueError("some parameters are in no unit; add the root module to the units")
    return zero.ZeRO(model, optimizer_factory, 3, group, units(model), param_dtype, prefetch)


def parallel_train(rank, world_size, recipe, *, units=block_units, param_dtype=None, prefetch=True,
                   observe=None):
    """minipar's FSDP on ``recipe``: ZeRO-3 with the chosen units."""
    return zero.parallel_train(rank, world_size, recipe, stage=3, units=units, param_dtype=param_dtype,
                               prefetch=prefetch, observe=observe)


def torch_fsdp2_train(rank, world_size, recipe, *, units=block_units, steps=None):
    """The same training with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same units."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world_size,))
    model = recipe.model().to(device=device, dtype=recipe.dtype)
    for module in units(model):
        torch_fully_shard(module, mesh=mesh)
    optimizer = recipe.optimizer(model.parameters())
    losses = []
    for inputs, targets in recipe.batches[:steps]:
        x, y = (t.to(device) for t in shard_batch((inputs, targets), rank, world_size))
        optimizer.zero_grad()
        loss = recipe.loss(model, x, y)
        loss.backward()
        optimizer.step()
        losses.append(mean_over_ranks(loss))
    return RunResult(losses, {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()})


def run(recipe, *, world_size: int, units=block_units, quiet: bool = True, **config) -> list:
    """Check the configuration in this process, then train on ``world_size`` ranks: per-rank results."""
    validate(recipe, world_size=world_size, units=units)
    return launch(parallel_train, world_size, recipe, units=units, quiet=quiet, **config)
