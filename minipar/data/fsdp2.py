"""Per-parameter sharding, FSDP2's design (PyTorch's ``fully_shard``; Zhao et al. 2023, "PyTorch FSDP",
arXiv:2304.11277, and PyTorch's FSDP2 notes): every parameter is sharded on dim 0, so each one keeps its identity,
shape and dtype, and after backward the shard's gradient is in its own ``.grad``.

A parameter of shape (d₀, …) is padded to N·c rows, c = ⌈d₀/N⌉; rank r holds rows [r·c, (r+1)·c) as a
parameter of shape (c, …). A unit (a module gathered together) still moves its parameters in one collective
each way, through staging buffers (:mod:`minipar.data.per_parameter_unit`: copy-in, collective, copy-out).

Bytes per unit and step: all-gather before forward and again before backward, reduce-scatter after it,
(N-1)·b·T each, the same as the flat buffer of :mod:`minipar.data.flat_unit` up to the padding (per parameter
here: at most N-1 rows of each; there: at most N-1 elements of the unit). The price is the copy-in and
copy-out around each collective; the flat buffer computes straight from the gathered buffer.

Semantics as on one device: a frozen parameter (``requires_grad=False``) stays whole and is never sharded;
a parameter that no rank used in a backward keeps ``.grad`` None (one all-reduce of a byte per parameter
tells every rank), so ``torch.optim.AdamW`` skips it; gradients accumulate over backwards until
``zero_grad``. The gradients are reduce-scattered when the backward ends, unit after unit in a fixed order,
so every rank issues the same collectives whichever parameters it used; they are posted one after another and
waited for together (PyTorch's FSDP2 starts each unit's reduce-scatter as that unit's backward ends, overlapping
it with the rest of the backward). The all-gathers overlap compute: from the second step on, when a unit's
forward (backward) begins, the all-gather of the unit that came next in the first step's forward (backward) is
posted, so it travels while this unit computes (prefetch; two units' parameters alive at once).

Composition with replication (PyTorch: ``fully_shard`` on the big layers, ``replicate`` on the rest; torchtitan
does so for small parameters in some layouts): a trainable parameter in none of the units is replicated — whole
on every rank, its gradient averaged by one all-reduce at the end of the backward (DDP's), so it is the same on
every rank, and the optimizer steps it beside the shards. A norm's few parameters cost N times their memory and
one all-reduce of 2(N-1)/N times their bytes, instead of an all-gather per use and a reduce-scatter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .per_parameter_unit import PerParameterUnit, ShardedParam
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
    """``FSDP(module, per_parameter=True)``: the module's trainable parameters in ``units`` become their dim-0
    shards (``model.parameters()`` yields them, each ``.grad`` of its shape and dtype after backward); ``units``
    chooses what is gathered together (see :class:`~minipar.data.fsdp.FSDP`); ``fp32_modules`` (the norms, under
    a ``param_dtype`` policy) inside a unit are units of their own, gathered and computed in their parameters'
    dtype. A trainable parameter in no unit is replicated (``fully_shard`` on the big layers, ``replicate`` on
    the rest): whole on every rank, in its own dtype, its gradient averaged by one all-reduce at the end of the
    backward, so it is the same on every rank; ``model.parameters()`` yields it beside the shards.
    ``prefetch``: from the second step on, a unit's forward (backward) posts the all-gather of the unit that ran
    next in the first step's forward (backward); ``async_reduce``: the reduce-scatters are posted one after
    another and waited for together. ``events``: (step, what, unit label), in the order they happened."""

    def __init__(self, module: nn.Module, *, group=None, units, param_dtype=None, reduce_dtype=None,
                 fp32_modules=(), prefetch: bool = True, async_reduce: bool = True):
        super().__init__()
        self.module, self.group, self.prefetch, self.async_reduce = module, group, prefetch, async_reduce
        n, rank = self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        owners = {}
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((m, name))
        unit_modules = list(units(module))
        in_units = {id(p) for m in unit_modules for p in m.parameters()}
        sharded_norms = [m for m in fp32_modules if all(id(p) in in_units for p in m.parameters())]
        claimed, chosen = set(), []
        for unit_module in [*sharded_norms, *unit_modules]:     # each parameter in the first unit that has it
            mine = [p for p in unit_module.parameters() if p.requires_grad and id(p) not in claimed]
            claimed.update(id(p) for p in mine)
            chosen.append((unit_module, mine))
        self.replicated = [p for p in module.parameters() if p.requires_grad and id(p) not in claimed]
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
        self.forward_order, self.backward_order, self._recording = [], [], True
        self.events, self.steps_done, self._held = [], 0, None

    def _post_gather(self, unit, async_op: bool = False) -> None:
        if not unit.gathered:                            # the ranks agree on the unit first (minipar.data.units)
            self.order.agree("all-gather", unit)
            self.events.append((self.steps_done, "all-gather posted", unit.label))
            unit.gather(async_op)

    def _gather(self, unit, order) -> None:
        """Gather ``unit`` (or finish its prefetch), then post the all-gather of the unit after it in ``order``
        (the first step records the order): it travels while this unit computes."""
        self._post_gather(unit)
        unit.wait()
        if self._recording:
            if unit not in order:
                order.append(unit)
        elif self.prefetch and unit in order and order.index(unit) + 1 < len(order):
            self._post_gather(order[order.index(unit) + 1], async_op=True)

    def _before_forward(self, unit) -> None:
        self._gather(unit, self.forward_order)
        self.events.append((self.steps_done, "forward", unit.label))
        for p in unit.params:
            p.install(p.full)

    def _after_forward(self, unit, output) -> None:
        self.events.append((self.steps_done, "forward done", unit.label))
        for p in unit.params:
            p.install(p.shard)
        unit.free()
        for t in [output] if torch.is_tensor(output) else [t for t in output if torch.is_tensor(t)]:
            if t.requires_grad:
                t.register_hook(lambda grad, u=unit: self._before_backward(u))

    def _before_backward(self, unit) -> None:
        self._gather(unit, self.backward_order)          # the unit's backward begins
        self.events.append((self.steps_done, "backward", unit.label))

    def _grad_arrived(self, unit) -> None:
        unit.freed_after_backward += 1
        if unit.freed_after_backward == len(unit.params):
            self.events.append((self.steps_done, "backward done", unit.label))
            unit.free()                                  # its backward is done: the parameters can go

    def forward(self, *args, **kwargs):
        self.order.new_step()
        out = self.module(*args, **kwargs)
        for t in [out] if torch.is_tensor(out) else [t for t in out if torch.is_tensor(t)]:
            if t.requires_grad:                          # the backward begins: no parameter's grad has arrived
                t.register_hook(lambda grad: self._hold_replicated_grads())
        return finish_at_backward_end(self, out)

    def _hold_replicated_grads(self) -> None:
        """Set aside what the replicated parameters' ``.grad`` hold from earlier backwards (already averaged),
        so that this backward's all-reduce averages this backward's gradients only."""
        if self._held is None:
            self._held = [p.grad for p in self.replicated]
            for p in self.replicated:
                p.grad = None

    def finish_gradient_synchronization(self) -> None:
        """At the end of each backward: which parameters some rank used (one all-reduce), then one
        reduce-scatter per unit in unit order, then one all-reduce of the replicated parameters' gradients."""
        self._hold_replicated_grads()
        sharded = [p.full.grad is not None for u in self.units for p in u.params]
        flags = torch.tensor(sharded + [p.grad is not None for p in self.replicated], dtype=torch.uint8)
        comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        index = 0
        for unit in self.units:
            active = [bool(f) for f in flags[index:index + len(unit.params)]]
            index += len(unit.params)
            unit.free()                                  # (a prefetch still in flight ends here)
            if any(active):
                unit.reduce(active, async_op=self.async_reduce)
            unit.freed_after_backward = 0
        for unit in self.units:
            unit.finish_reduce()
        self._average_replicated([bool(f) for f in flags[index:]])
        self._recording, self.steps_done = False, self.steps_done + 1

    def _average_replicated(self, used) -> None:
        """DDP's all-reduce for the parameters in no unit: the mean over ranks of this backward's gradients
        (zeros where this rank had none), added to what ``.grad`` held; one no rank used keeps its ``.grad``."""
        held, self._held = self._held, None
        chosen = [(p, old) for p, old, u in zip(self.replicated, held, used) if u]
        for dtype in dict.fromkeys(p.dtype for p, _ in chosen):
            same = [(p, old) for p, old in chosen if p.dtype == dtype]
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p, _ in same])
            flat.div_(self.n)                            # the mean: divide, then sum (as DDP)
            comm.all_reduce(flat, group=self.group)
            for (p, old), mean in zip(same, flat.split([p.numel() for p, _ in same])):
                p.grad = mean.view_as(p).clone() if old is None else old + mean.view_as(p)
        for p, old, u in zip(self.replicated, held, used):
            if not u:
                p.grad = old

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
