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
``zero_grad``. A unit's reduce-scatter is posted (``async_reduce``) when the gradient reaches its inputs —
after its parameters' gradients, the same place in every rank's backward whichever parameters it used (ZeRO-2/3's
rule, :mod:`minipar.data.flat_unit`) — so it travels under the earlier units' backward (PyTorch's FSDP2 does
the same); a unit whose inputs need no gradient (the embedding's tokens) is reduce-scattered when the backward
ends, in unit order, and every posted one is taken then. The all-gathers overlap compute: from the second step
on, when a unit's forward (backward) begins, the all-gather of the unit that came next in the first step's
forward (backward) is posted, so it travels while this unit computes (prefetch; two units' parameters alive at once).

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
from .flat_unit import call_when_gradient_reaches
from .fsdp_shared import compute_in_own_dtype, finish_at_backward_end, load_module_state_dict, module_state_dict
from .per_parameter_unit import PerParameterUnit, ShardedParam
from .units import UnitOrder

__all__ = ["ShardedParam", "PerParameterUnit", "PerParameterFSDP", "compute_in_own_dtype", "finish_at_backward_end",
           "module_state_dict", "load_module_state_dict"]


class PerParameterFSDP(nn.Module):
    """``FSDP(module, per_parameter=True)``: the module's trainable parameters in ``units`` become their dim-0
    shards (``model.parameters()`` yields them, each ``.grad`` of its shape and dtype after backward); ``units``
    chooses what is gathered together (see :class:`~minipar.data.fsdp.FSDP`); ``fp32_modules`` (the norms, under
    a ``param_dtype`` policy) inside a unit are units of their own, gathered and computed in their parameters'
    dtype. A trainable parameter in no unit is replicated (``fully_shard`` on the big layers, ``replicate`` on
    the rest): whole on every rank, in its own dtype, its gradient averaged by one all-reduce at the end of the
    backward, so it is the same on every rank; ``model.parameters()`` yields it beside the shards.
    ``prefetch``: from the second step on, a unit's forward (backward) posts the all-gather of the unit that ran
    next in the first step's forward (backward); ``async_reduce``: a unit's reduce-scatter, posted when the
    gradient reaches its inputs, is waited for at the end of the backward (else at once). Every all-gather and
    reduce-scatter is checked by :class:`~minipar.data.units.UnitOrder` where it is posted. ``events``: (step,
    what, unit label), in the order they happened."""

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
        _check_shared_inside(chosen, owners, labels)
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
            unit_module.register_forward_pre_hook(lambda m, args, u=unit: self._reduce_at_inputs(u, args))
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

    def _reduce_at_inputs(self, unit, args):
        """A forward pre-hook: when the gradient reaches the unit's inputs, after every gradient of its
        parameters (autograd runs AccumulateGrad before the nodes below), post its reduce-scatter — the same
        place in every rank's backward, whichever parameters each used (as ZeRO-2/3's, ``flat_unit``)."""
        unit.reduced = False                             # a forward: this unit's backward is to come
        return call_when_gradient_reaches(args, lambda: self._reduce(unit))   # None: reduced at the end

    def _reduce(self, unit) -> None:
        if not unit.reduced:
            self.order.agree("reduce-scatter", unit)
            self.events.append((self.steps_done, "reduce-scatter posted", unit.label))
            unit.reduce(async_op=self.async_reduce)
            unit.free()

    def _grad_arrived(self, unit) -> None:
        if unit.reduced:
            raise RuntimeError(f"a gradient of unit {unit.label} arrived after its reduce-scatter: a parameter "
                               f"used outside its unit belongs in a unit that holds both uses (the root)")
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
        """At the end of each backward: which parameters some rank used (one all-reduce), the reduce-scatters
        of the units no gradient reached the inputs of (in unit order, those some rank used), every posted
        reduce-scatter taken, then one all-reduce of the replicated parameters' gradients."""
        self._hold_replicated_grads()
        sharded = [u.used_here[i] if u.reduced else p.full.grad is not None
                   for u in self.units for i, p in enumerate(u.params)]
        flags = torch.tensor(sharded + [p.grad is not None for p in self.replicated], dtype=torch.uint8)
        comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        index, active = 0, []
        for unit in self.units:
            active.append([bool(f) for f in flags[index:index + len(unit.params)]])
            index += len(unit.params)
            unit.free()                                  # (a prefetch still in flight ends here)
            if not unit.reduced and any(active[-1]):
                self._reduce(unit)
        for unit, used in zip(self.units, active):
            unit.finish_reduce(used)
            unit.freed_after_backward, unit.reduced = 0, False
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


def _check_shared_inside(chosen, owners, labels) -> None:
    """ValueError unless every module that holds a unit's parameter (a tied weight has two) is inside that unit:
    one outside would compute with the shard between the unit's uses."""
    for unit_module, mine in chosen:
        inside = set(unit_module.modules())
        for p in mine:
            outside = [f"{labels[m] or '(root)'}.{name}" for m, name in owners[id(p)] if m not in inside]
            if outside:
                raise ValueError(
                    f"{outside[0]} is the same parameter as one in unit {labels[unit_module] or '(root)'!r} (tied "
                    f"weights) but lies outside that unit, so it would compute with the shard: choose units so "
                    f"that one holds every module that uses it (their common parent, e.g. the root)")
