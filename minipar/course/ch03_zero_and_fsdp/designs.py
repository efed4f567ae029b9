"""Chapter 03's two FSDP designs on one recipe: the flat buffer (FSDP1, ZeRO: ``FSDP(model)``) and a shard per
parameter (FSDP2: ``FSDP(model, per_parameter=True)``), each trained in a plain loop on N ranks, with what
each unit moves (the ``minipar.comm`` log), its padding (counted from the units) and the shape of the
gradients the loop sees after backward."""
from __future__ import annotations

import torch

from minipar import comm, launch
from minipar.check import RunResult, gpt_recipe
from minipar.data.fsdp import FSDP
from minipar.loop import mean_over_ranks, shard_batch

__all__ = ["RECIPE", "recipe", "train", "run"]

RECIPE = dict(steps=2, batch_size=8, seq_len=8, n_layer=2, n_embd=18, n_head=2)   # 18 rows: 2 padded over 4


def recipe():
    r = gpt_recipe(**RECIPE)
    r.dtype = torch.float64            # the two designs and one device agree to ~1e-15
    return r


def _units(model, per_parameter: bool) -> list:
    """[(elements, elements with padding)] per unit, as each design lays them out on N ranks."""
    if per_parameter:
        return [(sum(p.d0 * p.rest for p in u.params), u.n * u.total) for u in model.units]
    return [(u.numel, u.padded_numel) for u in model.zero.units]


def train(rank, world_size, recipe, per_parameter: bool) -> dict:
    """One design in a learner's loop: losses and full parameters, per-step bytes by op, units, grad shapes."""
    model = FSDP(recipe.model().to(recipe.dtype), per_parameter=per_parameter)
    opt = recipe.optimizer(model.parameters())
    losses, grads = [], None
    with comm.recording() as log:
        for inputs, targets in recipe.batches:
            loss = recipe.loss(model, *shard_batch((inputs, targets), rank, world_size))
            loss.backward()
            grads = [(tuple(p.shape), None if p.grad is None else tuple(p.grad.shape)) for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
    steps = len(recipe.batches)
    ops = {op: (calls // steps, nbytes / steps) for op, (calls, nbytes) in log.by_op().items()}
    return {"result": RunResult(losses, model.full_state_dict()), "per_step": ops,
            "units": _units(model, per_parameter), "grads": grads}


DESIGNS = (("flat", False), ("per-parameter", True))


def _both(rank, world_size, recipe) -> dict:
    return {name: train(rank, world_size, recipe, per_parameter) for name, per_parameter in DESIGNS}


def run(world_size: int = 4) -> dict:
    """{"flat": every rank's :func:`train`, "per-parameter": the same}, both designs in one launch on
    ``world_size`` ranks, one after the other."""
    per_rank = launch(_both, world_size, recipe(), quiet=True)
    return {name: [r[name] for r in per_rank] for name, _ in DESIGNS}
