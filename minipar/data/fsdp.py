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
3 · b · Ψ · (N-1)/N per step. ``FSDP(module, per_parameter=True)`` is that design here
(:mod:`minipar.data.fsdp2`), and ``torch_fsdp2_train`` runs PyTorch's version on the same recipe so the
two can be compared step by step.

What the flat shards alone cannot do: a parameter no rank used in a step still has its elements in the unit's
flat shard, with a zero gradient, so an optimizer over the shards steps them (Adam's moments decay, weight
decay shrinks them); frozen parameters are left out of the units and never move. FSDP1's answer is
``use_orig_params=True``: the optimizer sees each parameter's *piece* of the shard (a view, maybe empty) with
its own state and step count, and a piece whose parameter no rank used gets ``.grad`` None (one all-reduce of
a byte per parameter says which) — skipped, as one device skips it. Per-parameter sharding keeps ``.grad``
None for an unused parameter by construction.

:class:`FSDP` is the drop-in ``nn.Module`` wrapper for a loop of your own (``model = FSDP(model)``, then your
optimizer over ``model.parameters()``); :func:`fully_shard` returns the ``ZeRO`` object that owns the optimizer.
The mechanism lives in :mod:`minipar.data.flat_unit` (the flat buffer: gather, compute, free,
reduce-scatter) and :mod:`minipar.data.zero` (when each unit does it; prefetch).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..recipe import RunResult
from ..launcher import launch
from ..loop import mean_over_ranks, shard_batch
from . import zero
from .fsdp2 import PerParameterFSDP
from .fsdp_shared import compute_in_own_dtype, finish_at_backward_end, load_module_state_dict, \
    module_state_dict

__all__ = ["FSDP", "NORMS", "is_norm", "block_units", "single_unit", "validate", "fully_shard", "parallel_train", "torch_fsdp2_train",
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
    zero.check_units(model, units(model) if callable(units) else units)


def fully_shard(model: nn.Module, optimizer_factory, units=block_units, group=None, param_dtype=None,
                prefetch: bool = True) -> zero.ZeRO:
    """Shard ``model`` FSDP-style: ZeRO stage 3 over the units ``units(model)`` (nested units first,
    the root last). Returns the :class:`~minipar.data.zero.ZeRO` object that owns the optimizer."""
    return zero.ZeRO(model, optimizer_factory, 3, group, units(model), param_dtype, prefetch)


NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._BatchNorm)


def is_norm(module: nn.Module, norm_classes=()) -> bool:
    """A normalisation layer, recognised by what it is: one of torch's (:data:`NORMS`), one of
    ``norm_classes``, a class whose name ends in "Norm" (a learner's ``RMSNorm``), or a module marked
    ``module.is_norm = True``; with parameters of its own (what the policy keeps in FP32)."""
    named = type(module).__name__.lower().endswith("norm") or getattr(module, "is_norm", False)
    return bool((isinstance(module, NORMS + tuple(norm_classes)) or named)
                and list(module.parameters(recurse=False)))


def _norms(module, param_dtype, norms_in_fp32: bool, norm_classes) -> list:
    """The norms a 16-bit policy keeps in their own dtype (none without one)."""
    if param_dtype is None or not norms_in_fp32:
        return []
    return [m for m in module.modules() if is_norm(m, norm_classes)]


class FSDP(nn.Module):
    """FSDP as a drop-in ``nn.Module`` wrapper for your own loop (ZeRO-3 over ``units(module)``)::

        model = FSDP(model, group=group, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)        # this rank's flat shards, one per unit
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

    ``parameters()`` are the flat master shards this rank owns (1/N of each unit, FSDP1's flat parameters):
    what the optimizer steps, their ``.grad`` the reduce-scattered mean gradient. The wrapped module's own
    parameters exist whole only while their unit computes; reading one between steps raises
    :class:`~minipar.data.sharded_parameter.FreedParameterError` saying what to do. Gradients are finished at the
    end of every backward (an autograd callback: units whose gradients never arrived are reduced then).
    Policy: compute copies and all-gathers in ``param_dtype``, the reduce-scatter in ``reduce_dtype``, the
    shards and the optimizer in the module's dtype; normalisation layers gather and compute in that dtype
    too (``norms_in_fp32``; :func:`is_norm` says which, ``norm_classes`` names more), their inputs upcast and
    outputs cast back.

    ``use_orig_params=True`` (FSDP1's option): ``parameters()`` are each wrapped parameter's piece of those shards,
    under its own name, with per-parameter optimizer state; one no rank used has ``.grad`` None and is skipped.

    ``per_parameter=True`` shards each parameter on dim 0 instead (FSDP2's design,
    :class:`~minipar.data.fsdp2.PerParameterFSDP`): ``parameters()`` are then the module's own parameters as
    dim-0 shards, each with its ``.grad`` after backward; a trainable parameter in none of ``units`` is then
    replicated (whole on every rank, its gradient all-reduced to the mean), not an error."""

    def __new__(cls, module=None, *, per_parameter: bool = False, group=None, units=block_units, param_dtype=None,
                reduce_dtype=None, norms_in_fp32: bool = True, prefetch: bool = True, norm_classes=(),
                use_orig_params: bool = False):
        if per_parameter:
            return PerParameterFSDP(module, group=group, units=units, param_dtype=param_dtype,
                                    reduce_dtype=reduce_dtype, prefetch=prefetch,
                                    fp32_modules=_norms(module, param_dtype, norms_in_fp32, norm_classes))
        return super().__new__(cls)

    def __init__(self, module: nn.Module, *, group=None, units=block_units, param_dtype=None, reduce_dtype=None,
                 norms_in_fp32: bool = True, prefetch: bool = True, norm_classes=(), per_parameter: bool = False,
                 use_orig_params: bool = False):
        super().__init__()
        modules = list(units(module))                          # (zero.ZeRO checks they cover the module)
        norms = _norms(module, param_dtype, norms_in_fp32, norm_classes)
        self.module, self.param_dtype = module, param_dtype
        self.zero = zero.ZeRO(module, None, 3, group, norms + modules, param_dtype, prefetch,
                              reduce_dtype=reduce_dtype, fp32_modules=norms)
        self.flat_shards = nn.ParameterList([u.master for u in self.zero.units])
        for norm in norms:
            compute_in_own_dtype(norm, param_dtype)
        self._finish_queued, self.pieces, self._used = False, None, set()
        if use_orig_params:          # each parameter's piece of my shard: a view the optimizer steps by itself
            self.pieces = [[nn.Parameter(u.master.data[lo:hi]) for lo, hi in u.layout.piece_bounds(u.rank)]
                           for u in self.zero.units]
            for p in (p for u in self.zero.units for p in u.params):
                p.register_post_accumulate_grad_hook(lambda p: self._used.add(id(p)))

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Only this rank's flat shards (what an optimizer steps), named ``flat_shards.i``; with
        ``use_orig_params`` each parameter's piece of them, under the wrapped module's names."""
        dot = f"{prefix}." if prefix else ""
        if self.pieces is not None:
            for unit, pieces in zip(self.zero.units, self.pieces):
                yield from ((f"{dot}{name}", piece) for name, piece in zip(unit.names, pieces))
            return
        for i, shard in enumerate(self.flat_shards):
            yield f"{dot}flat_shards.{i}", shard

    def forward(self, *args, **kwargs):
        self.zero.expect_backward()                            # a new forward: a new backward to count
        return finish_at_backward_end(self, self.module(*args, **kwargs))

    def finish_gradient_synchronization(self) -> None:
        """Reduce-scatter the units no gradient reached the inputs of (the root); runs by itself
        at the end of each backward, so a plain loop never needs to call it."""
        self.zero.finish_gradients(ends_step=True)             # the caller's optimizer steps the shards
        if self.pieces is not None:
            self._move_grads_to_pieces()

    def _move_grads_to_pieces(self) -> None:
        """``use_orig_params``: the shard's gradient into the pieces of the parameters some rank used (added to
        a gradient the pieces kept from an earlier backward, as ``.grad`` accumulates); the others keep theirs."""
        units = self.zero.units
        used = torch.tensor([id(p) in self._used for u in units for p in u.params], dtype=torch.uint8)
        comm.all_reduce(used, op=dist.ReduceOp.MAX, group=self.zero.group)   # used on any rank: it has a grad
        flags = iter(used.tolist())
        for unit, pieces in zip(units, self.pieces):
            for piece, (lo, hi) in zip(pieces, unit.layout.piece_bounds(unit.rank)):
                if next(flags):
                    grad = unit.master.grad[lo:hi]
                    piece.grad = grad.clone() if piece.grad is None else piece.grad + grad
            unit.master.grad = None
        self._used.clear()

    def gathered(self):
        """``with model.gathered(): ...`` — every unit's full parameters for the block (every rank enters)."""
        return self.zero.gathered()

    def full_state_dict(self) -> dict:
        """{name: full tensor} under the wrapped module's names, gathered (every rank calls it)."""
        return self.zero.full_parameters()

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The wrapped module's full state dict (PyTorch FSDP's; every rank calls it: an all-gather per unit):
        its own keys, every parameter whole, buffers and frozen parameters (never in a unit) included."""
        full = {id(p): t for unit in self.zero.units for p, t in zip(unit.params, unit.full_tensors(unit.master))}
        return module_state_dict(self.module, full, prefix)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (the wrapped module's names, as :meth:`state_dict` gives): each rank keeps its
        shard of every unit; buffers and frozen parameters are copied whole."""
        sharded = {id(p) for unit in self.zero.units for p in unit.params}
        result = load_module_state_dict(self.module, state_dict, sharded, strict)
        for unit in self.zero.units:
            full = [state_dict[n] if n in state_dict else unit.master.new_zeros(p.shape)
                    for n, p in zip(unit.names, unit.params)]
            with torch.no_grad():
                unit.master.copy_(unit.my_shard(full))
        return result

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the shards' gradients so the *global* 2-norm is at most ``max_norm``; returns that norm.
        (``torch.nn.utils.clip_grad_norm_(model.parameters())`` would see this rank's shards only.)"""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64)
        for g in grads:
            total += g.double().square().sum()
        comm.all_reduce(total, group=self.zero.group)          # Σ over ranks of Σ shard² = ‖g‖²
        norm = total.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return norm.to(grads[0].dtype if grads else torch.float32)

    def full_gradients(self) -> dict:
        """{name: full mean gradient} gathered from the shards' ``.grad`` (every rank calls it)."""
        out = {}
        for i, unit in enumerate(self.zero.units):
            grad = unit.master.grad if unit.master.grad is not None else torch.zeros_like(unit.master)
            if self.pieces is not None:                        # the pieces hold it (None: zeros)
                grad = torch.zeros_like(unit.master)
                for piece, (lo, hi) in zip(self.pieces[i], unit.layout.piece_bounds(unit.rank)):
                    if piece.grad is not None:
                        grad[lo:hi] = piece.grad
            out.update(zip(unit.names, unit.full_tensors(grad)))
        return out


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
