"""Per-parameter sharding, FSDP2's design (PyTorch's ``fully_shard``; Zhao et al. 2023, "PyTorch FSDP",
arXiv:2304.11277, and PyTorch's FSDP2 notes): every parameter is sharded on dim 0, so each one keeps its identity,
shape and dtype, and after backward the shard's gradient is in its own ``.grad``.

A parameter of shape (d₀, …) is padded to N·c rows, c = ⌈d₀/N⌉; rank r holds rows [r·c, (r+1)·c) as a
parameter of shape (c, …) (zeros past d₀). A unit (a module gathered together) still moves its parameters in
one collective each way, through staging buffers::

    copy-in     my shards, one after another, into a flat send buffer        T = Σ c_p·(rest of p) elements
    all-gather  N·T elements: row r of the (N, T) result is rank r's buffer
    copy-out    each parameter's column block of it, (N·c_p, …), cut to d₀ rows: the full parameter
    ... forward / backward with the full parameters ...
    copy-in     each full gradient padded to N·c_p rows, as (N, c_p·rest), into its column block
    reduce-scatter  (÷N first) row r, T elements, to rank r; copy-out: each parameter's piece is its ``.grad``

Bytes per unit and step: all-gather before forward and again before backward, reduce-scatter after it,
(N-1)·b·T each, the same as the flat buffer of :mod:`minipar.data.flat_unit` up to the padding (per parameter
here: at most N-1 rows of each; there: at most N-1 elements of the unit). The price is the copy-in and
copy-out around each collective; the flat buffer computes straight from the gathered buffer.

Semantics as on one device: a frozen parameter (``requires_grad=False``) stays whole and is never sharded;
a parameter that no rank used in a backward keeps ``.grad`` None (one all-reduce of a byte per parameter
tells every rank), so ``torch.optim.AdamW`` skips it; gradients accumulate over backwards until
``zero_grad``. The gradients are reduce-scattered when the backward ends, unit after unit in a fixed order,
so every rank issues the same collectives whichever parameters it used (PyTorch's FSDP2 starts each unit's
reduce-scatter as that unit's backward ends, overlapping it with the rest).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..flat import FlatLayout
from .units import UnitOrder

__all__ = ["ShardedParam", "PerParameterUnit", "PerParameterFSDP", "compute_in_own_dtype", "finish_at_backward_end",
           "module_state_dict", "load_module_state_dict"]


def compute_in_own_dtype(module: nn.Module, param_dtype) -> None:
    """A layer kept in its parameters' dtype under a 16-bit policy (a norm): its inputs cast up to that dtype,
    its output back to ``param_dtype``."""
    own = next(module.parameters()).dtype
    module.register_forward_pre_hook(lambda m, args: tuple(
        a.to(own) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    module.register_forward_hook(lambda m, args, out: out.to(param_dtype))


class ShardedParam:
    """One parameter sharded on dim 0: ``shard`` (c, …) is what the optimizer steps, ``full`` the gathered
    (d₀, …) tensor the module computes with (its storage freed between uses); ``owners`` are the (module,
    name) pairs that register it (a tied weight has two)."""

    def __init__(self, param: nn.Parameter, owners, n: int, rank: int, compute_dtype):
        self.shape, self.owners = param.shape, owners
        rows = param.detach().reshape(param.shape[0] if param.dim() else 1, -1)     # (d₀, rest)
        self.d0, self.rest = rows.shape
        self.c = -(-self.d0 // n)                                                   # ⌈d₀/N⌉ rows per rank
        padded = torch.cat([rows, rows.new_zeros(n * self.c - self.d0, self.rest)])
        local_shape = (self.c, *param.shape[1:]) if param.dim() else (self.c,)
        self.shard = nn.Parameter(padded[rank * self.c:(rank + 1) * self.c].clone().view(local_shape))
        self.full = nn.Parameter(param.detach().to(compute_dtype).clone())
        self.full.data.untyped_storage().resize_(0)                                 # gathered when needed
        self.numel = self.c * self.rest                                             # my elements

    def my_rows(self, full: torch.Tensor, n: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of a full tensor of this parameter's shape: rows [r·c, (r+1)·c), zeros past d₀."""
        rows = full.detach().reshape(self.d0, self.rest).to(self.shard.dtype)
        padded = torch.cat([rows, rows.new_zeros(n * self.c - self.d0, self.rest)])
        return padded[rank * self.c:(rank + 1) * self.c].view(self.shard.shape)

    def install(self, which: nn.Parameter) -> None:
        for module, name in self.owners:
            module._parameters[name] = which


class PerParameterUnit:
    """The parameters gathered together (one module's): one all-gather and one reduce-scatter each way."""

    def __init__(self, module, params, group, reduce_dtype=None, label="(root)"):
        self.module, self.params, self.group, self.reduce_dtype = module, params, group, reduce_dtype
        self.label = label
        self.n = dist.get_world_size(group)
        self.layout = FlatLayout([p.shard.shape for p in params])                 # my shards, one after another
        self.offsets, self.total = self.layout.offsets, self.layout.numel         # T = Σ c_p·rest
        self.gathered, self.freed_after_backward = False, 0

    def gather(self) -> None:
        """Copy-in, all-gather, copy-out: every parameter's full tensor (storage re-allocated)."""
        if self.gathered:
            return
        for p, full in zip(self.params, self.full_tensors(self.params[0].full.dtype)):
            p.full.data.untyped_storage().resize_(full.numel() * full.element_size())
            p.full.data.copy_(full)                     # .data: refilling it is no autograd in-place write
        self.gathered = True

    def full_tensors(self, dtype) -> list:
        """Every rank's shards, all-gathered in ``dtype``: each parameter's full tensor, one per parameter (the
        compute dtype to compute with; the shards' own for a state dict, which a 16-bit copy would round)."""
        send = self.layout.flatten([p.shard.detach().to(dtype) for p in self.params])         # copy-in
        received = send.new_empty(self.n * self.total)
        comm.all_gather_into_tensor(received, send, group=self.group)
        table = received.view(self.n, self.total)
        return [table[:, offset:offset + p.numel].reshape(self.n * p.c, p.rest)[:p.d0].reshape(p.shape)
                for p, offset in zip(self.params, self.offsets)]                               # copy-out

    def free(self) -> None:
        for p in self.params:
            p.full.data.untyped_storage().resize_(0)
        self.gathered = False

    def reduce(self, active) -> None:
        """Copy-in the full gradients, reduce-scatter their mean, copy-out each piece into ``shard.grad``
        (added, as torch accumulates); a parameter no rank used keeps its ``.grad``."""
        dtype = self.reduce_dtype or self.params[0].full.dtype
        table = torch.zeros(self.n, self.total, dtype=dtype)
        for p, offset in zip(self.params, self.offsets):
            if p.full.grad is not None:
                rows = p.full.grad.reshape(p.d0, p.rest).to(dtype)
                padded = torch.cat([rows, rows.new_zeros(self.n * p.c - p.d0, p.rest)])
                table[:, offset:offset + p.numel] = padded.view(self.n, p.numel)
        table.div_(self.n)                                                  # the mean: divide, then sum
        mine = table.new_empty(self.total)
        comm.reduce_scatter_tensor(mine, table.view(-1), group=self.group)
        for p, offset, used in zip(self.params, self.offsets, active):
            p.full.grad = None
            if used:
                piece = mine[offset:offset + p.numel].view_as(p.shard).to(p.shard.dtype)
                p.shard.grad = piece.clone() if p.shard.grad is None else p.shard.grad + piece


def module_state_dict(module: nn.Module, full_by_param: dict, prefix: str = "") -> dict:
    """``module.state_dict()``'s keys in its order, each value whole (PyTorch FSDP's full state dict): a sharded
    parameter's full tensor ``full_by_param[id(p)]``, a buffer or a frozen parameter copied as it is. Used by
    both FSDP designs; ``keep_vars`` so that nothing reads a freed parameter."""
    return {prefix + name: full_by_param[id(v)] if id(v) in full_by_param else v.detach().clone()
            for name, v in module.state_dict(keep_vars=True).items()}


def load_module_state_dict(module: nn.Module, state_dict: dict, sharded: set, strict: bool = True):
    """Check ``state_dict``'s keys against ``module.state_dict()``'s (``strict``: RuntimeError unless equal) and
    copy the values of what is not sharded (buffers, frozen parameters; ``sharded``: ids of the others, which
    the caller loads into its shards). Returns torch's (missing_keys, unexpected_keys)."""
    own = module.state_dict(keep_vars=True)
    missing, unexpected = [k for k in own if k not in state_dict], [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(f"the state dict does not fit the wrapped module: missing keys {missing[:3]}, "
                           f"unexpected keys {unexpected[:3]} (a full state dict has the module's own names)")
    with torch.no_grad():
        for name, value in own.items():
            if name in state_dict and id(value) not in sharded:
                value.copy_(state_dict[name])
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def finish_at_backward_end(wrapper, out):
    """``out``, hooked so that ``wrapper.finish_gradient_synchronization()`` runs once when the backward
    through it ends (autograd's ``queue_callback``: after every gradient of that pass) — so a plain training
    loop never calls it. Used by both FSDP designs."""
    wrapper._finish_queued = False

    def queue(grad):
        if not wrapper._finish_queued:
            wrapper._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(wrapper.finish_gradient_synchronization)
    for t in [out] if torch.is_tensor(out) else [t for t in out if torch.is_tensor(t)]:
        if t.requires_grad:
            t.register_hook(queue)
    return out


class PerParameterFSDP(nn.Module):
    """``FSDP(module, per_parameter=True)``: the module's trainable parameters become their dim-0 shards
    (``model.parameters()`` yields them, each ``.grad`` of its shape and dtype after backward); ``units``
    chooses what is gathered together (see :class:`~minipar.data.fsdp.FSDP`); ``fp32_modules`` (the norms, under
    a ``param_dtype`` policy) are units of their own, gathered and computed in their parameters' dtype."""

    def __init__(self, module: nn.Module, *, group=None, units, param_dtype=None, reduce_dtype=None,
                 fp32_modules=()):
        super().__init__()
        self.module, self.group = module, group
        n, rank = self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        owners = {}
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((m, name))
        claimed, chosen = set(), []
        for unit_module in [*fp32_modules, *units(module)]:     # each parameter in the first unit that has it
            mine = [p for p in unit_module.parameters() if p.requires_grad and id(p) not in claimed]
            claimed.update(id(p) for p in mine)
            chosen.append((unit_module, mine))
        self.units, labels = [], {m: name for name, m in module.named_modules()}
        for unit_module, mine in chosen:
            if not mine:
                continue
            own = any(unit_module is m for m in fp32_modules)
            sharded = [ShardedParam(p, owners[id(p)], n, rank, p.dtype if own else param_dtype or p.dtype)
                       for p in mine]
            unit = PerParameterUnit(unit_module, sharded, group, reduce_dtype, labels[unit_module] or "(root)")
            for p in sharded:
                p.install(p.shard)                       # between steps the module holds its shards
                p.full.register_post_accumulate_grad_hook(lambda _, u=unit: self._grad_arrived(u))
            unit_module.register_forward_pre_hook(lambda m, a, u=unit: self._before_forward(u))
            unit_module.register_forward_hook(lambda m, a, out, u=unit: self._after_forward(u, out))
            self.units.append(unit)
        for norm in fp32_modules:
            compute_in_own_dtype(norm, param_dtype)
        self._finish_queued, self.order = False, UnitOrder(self.units, group)   # every rank runs every unit

    def _gather(self, unit) -> None:
        if not unit.gathered:                            # the ranks agree on the unit first (minipar.data.units)
            self.order.agree("all-gather", unit)
        unit.gather()

    def _before_forward(self, unit) -> None:
        self._gather(unit)
        for p in unit.params:
            p.install(p.full)

    def _after_forward(self, unit, output) -> None:
        for p in unit.params:
            p.install(p.shard)
        unit.free()
        for t in [output] if torch.is_tensor(output) else [t for t in output if torch.is_tensor(t)]:
            if t.requires_grad:
                t.register_hook(lambda grad, u=unit: self._gather(u))     # the unit's backward begins

    def _grad_arrived(self, unit) -> None:
        unit.freed_after_backward += 1
        if unit.freed_after_backward == len(unit.params):
            unit.free()                                  # its backward is done: the parameters can go

    def forward(self, *args, **kwargs):
        self.order.new_step()
        return finish_at_backward_end(self, self.module(*args, **kwargs))

    def finish_gradient_synchronization(self) -> None:
        """At the end of each backward: which parameters some rank used (one all-reduce), then one
        reduce-scatter per unit in unit order."""
        flags = torch.tensor([p.full.grad is not None for u in self.units for p in u.params], dtype=torch.uint8)
        comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        index = 0
        for unit in self.units:
            active = [bool(f) for f in flags[index:index + len(unit.params)]]
            index += len(unit.params)
            if any(active):
                unit.reduce(active)
            unit.free()
            unit.freed_after_backward = 0

    def full_state_dict(self) -> dict:
        """{name: full tensor} under the wrapped module's names (every rank calls it: one gather per unit)."""
        names = dict(self.module.named_parameters())
        return {name: t for name, t in self.state_dict().items() if name in names}

    def _full_by_shard(self) -> dict:
        """{id(shard): full tensor}, gathered in the shards' own dtype (FP32 masters stay FP32)."""
        return {id(p.shard): full for unit in self.units
                for p, full in zip(unit.params, unit.full_tensors(unit.params[0].shard.dtype))}

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """The wrapped module's full state dict (every rank calls it: one gather per unit): its own keys, every
        parameter whole, buffers and frozen parameters included; ``load_state_dict`` takes it back."""
        return module_state_dict(self.module, self._full_by_shard(), prefix)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (as :meth:`state_dict` gives): each rank keeps its rows of every sharded
        parameter; buffers and frozen parameters are copied whole."""
        params = [p for unit in self.units for p in unit.params]
        names = {id(v): k for k, v in self.module.state_dict(keep_vars=True).items()}
        result = load_module_state_dict(self.module, state_dict, {id(p.shard) for p in params}, strict)
        with torch.no_grad():
            for p in params:
                if names[id(p.shard)] in state_dict:
                    p.shard.copy_(p.my_rows(state_dict[names[id(p.shard)]], self.n, self.rank))
        return result
