"""ZeRO-1 as a drop-in ``torch.optim.Optimizer``: each of N ranks keeps the optimizer state of 1/N of the
parameters (Rajbhandari et al. 2020, "ZeRO", arXiv:1910.02054, stage P_os; PyTorch's
``torch.distributed.optim.ZeroRedundancyOptimizer`` is the same idea with whole parameters per rank).

Use it in your own loop where you would build an optimizer::

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)      # an Optimizer: schedulers work
    loss.backward(); opt.step(); opt.zero_grad(); sched.step()

The trainable parameters of each group (``requires_grad`` when the optimizer is built) are concatenated into
one flat buffer padded to a multiple of N, S = ⌈numel/N⌉; rank r owns elements ``[r·S, (r+1)·S)``
(:class:`minipar.flat.FlatLayout`, the layout of ZeRO's units). Inside its shard every parameter's
elements are a *piece* of their own (a view, possibly empty), and the inner optimizer (``optimizer_class``
with the group's options) steps the pieces, so its state is K·Ψ/N bytes per rank instead of K·Ψ, and each
parameter keeps its own state and step count, as on one device. One step::

    active = {p : p.grad is not None on some rank}      a parameter nobody has a gradient for is skipped
    g_r = reduce-scatter(g / N)[r]        (skipped with average_gradients=False: the model, e.g. DDP, averaged)
    w_r ← inner step on the active pieces  element-wise optimizers: the same arithmetic as on whole tensors
    w   = all-gather(w_r)                  every rank's parameters are whole again

A frozen parameter (``requires_grad=False`` when the optimizer is built) is in no buffer: never moved,
never decayed. A parameter whose ``.grad`` is None on every rank for a step is not stepped (torch.optim's
rule: its moments, weight decay and step count stay). Which parameters are active is one all-reduce of a
byte per parameter (with ``average_gradients=False`` the gradients are already equal on every rank, so
their None-ness is too, and it is skipped). Bytes per rank per step: (N-1)/N·bΨ for the reduce-scatter +
(N-1)/N·bΨ for the all-gather = DDP's all-reduce. Only element-wise optimizers (SGD, Adam, AdamW, ...) give
single-device results on a shard; one that looks at a whole tensor (LAMB's trust ratio, Adafactor, Muon)
does not.

``state_dict()`` gathers the shards into the format of ``optimizer_class`` on one device (keyed by parameter
index, tensors of the parameters' shapes), so a checkpoint loads into either; every rank must call it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..flat import FlatLayout
from .flat_unit import gather_flat

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose state is sharded over ``group``: ``ShardedOptimizer(params,
    optimizer_class, *, group=None, average_gradients=True, **defaults)``; ``params`` are tensors or
    parameter-group dicts, ``defaults`` the keyword arguments of ``optimizer_class``."""

    def __init__(self, params, optimizer_class, *, group=None, average_gradients: bool = True, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), "
                             f"got {optimizer_class!r}")
        probe = torch.nn.Parameter(torch.zeros(1))        # the class's own defaults fill what was not given,
        super().__init__(params, optimizer_class([probe], **defaults).defaults)   # so a scheduler sees 'lr'
        self.group, self.average_gradients = group, average_gradients
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        self.layouts = [self._layout(params) for params in self.trainable]
        self.shards = [self._my_shard([p.detach() for p in params], layout) if layout else None
                       for params, layout in zip(self.trainable, self.layouts)]
        self.pieces = [self._pieces(shard, layout) for shard, layout in zip(self.shards, self.layouts)]
        self.inner = optimizer_class([{**self._options(g), "params": pieces}
                                      for g, pieces in zip(self.param_groups, self.pieces)])

    def _layout(self, params):
        if not params:
            return None                                        # a group of frozen parameters only
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"a parameter group must hold one dtype, got {sorted(map(str, dtypes))}; "
                             f"put each dtype in its own group")
        return FlatLayout([p.shape for p in params], self.n)

    def _bounds(self, layout) -> list:
        return layout.piece_bounds(self.rank)

    def _pieces(self, shard, layout) -> list:
        """One parameter per trainable parameter: a view of my shard (empty where I hold none of it), so
        the inner optimizer keeps per-parameter state and steps only the parameters that have gradients."""
        if layout is None:
            return []
        return [torch.nn.Parameter(shard[lo:hi]) for lo, hi in self._bounds(layout)]

    @staticmethod
    def _options(param_group) -> dict:
        return {k: v for k, v in param_group.items() if k != "params"}

    def _my_shard(self, tensors, layout) -> torch.Tensor:
        """This rank's slice of ``tensors`` flattened and padded (a copy)."""
        return layout.flatten(tensors)[layout.shard(self.rank)].clone()

    def _active(self) -> list:
        """Per group, which trainable parameters have a gradient on some rank (one all-reduce of flags)."""
        trainable = {id(p) for params in self.trainable for p in params}
        if any(p.grad is not None and id(p) not in trainable for g in self.param_groups for p in g["params"]):
            raise ValueError("a parameter that was frozen (requires_grad=False) when the ShardedOptimizer was "
                             "built has a gradient now; build the optimizer after unfreezing it")
        flags = torch.tensor([p.grad is not None for params in self.trainable for p in params], dtype=torch.uint8)
        if self.average_gradients and flags.numel():
            comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)   # used on any rank: stepped
        out, index = [], 0
        for params in self.trainable:
            out.append([bool(f) for f in flags[index:index + len(params)]])
            index += len(params)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter (or slice) the gradients, step my pieces of the active parameters, all-gather."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = self._active()
        for param_group, params, shard, pieces, inner_group, layout, on in zip(
                self.param_groups, self.trainable, self.shards, self.pieces, self.inner.param_groups,
                self.layouts, active):
            inner_group.update(self._options(param_group))          # what a scheduler changed (lr, ...)
            if layout is None or not any(on):
                continue                                            # every rank agrees: no collective
            shard.copy_(layout.flatten([p.detach() for p in params])[layout.shard(self.rank)])
            grads = layout.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
            if self.average_gradients:
                grad_shard = grads.new_empty(layout.shard_numel)
                comm.reduce_scatter_tensor(grad_shard, grads.div_(self.n), group=self.group)  # divide, sum
            else:
                grad_shard = grads[layout.shard(self.rank)].clone()
            for piece, (lo, hi), has_grad in zip(pieces, self._bounds(layout), on):
                piece.grad = grad_shard[lo:hi] if has_grad else None   # as torch skips params without grads
        self.inner.step()
        for piece in (piece for pieces in self.pieces for piece in pieces):
            piece.grad = None                                       # (the gradient shard is not kept)
        for params, shard, layout, on in zip(self.trainable, self.shards, self.layouts, active):
            if layout is None or not any(on):
                continue
            for p, full, has_grad in zip(params, layout.views(gather_flat(layout, shard, self.group)), on):
                if has_grad:
                    p.copy_(full)                                   # every rank's parameters whole again
        return loss

    # --- checkpoints: the single-device format of optimizer_class -------------------------------------
    def state_dict(self) -> dict:
        """Gather the pieces' state (every rank calls this; PyTorch's ZeroRedundancyOptimizer needs
        ``consolidate_state_dict(to)`` first): ``optimizer_class``'s own state_dict for these parameters on
        one device. A tensor state (exp_avg, momentum_buffer, ...) is gathered; a scalar (step) is every
        rank's own, the same everywhere since every rank steps the same parameters."""
        state, groups, index = {}, [], 0
        for param_group, params, pieces, layout in zip(self.param_groups, self.trainable, self.pieces,
                                                       self.layouts):
            position = {id(p): index + k for k, p in enumerate(param_group["params"])}
            held = [self.inner.state.get(piece, {}) for piece in pieces]
            for key in dict.fromkeys(k for s in held for k in s):           # the same keys on every rank
                values = [s.get(key) for s in held]
                sample = next(v for v in values if v is not None)
                if torch.is_tensor(sample) and sample.dim() > 0:           # element-wise: gather and cut
                    flat = torch.cat([v.reshape(-1) if v is not None else sample.new_zeros(piece.numel())
                                      for v, piece in zip(values, pieces)])
                    flat = torch.cat([flat, flat.new_zeros(layout.shard_numel - flat.numel())])
                    values = [v.clone() if value is not None else None
                              for v, value in zip(layout.views(gather_flat(layout, flat, self.group)), values)]
                for p, value in zip(params, values):
                    if value is not None:
                        state.setdefault(position[id(p)], {})[key] = value
            groups.append({**self._options(param_group),
                           "params": list(range(index, index + len(param_group["params"])))})
            index += len(param_group["params"])
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of ``optimizer_class``'s format (from :meth:`state_dict` or from that
        optimizer on one device) for the same parameter groups; every rank keeps its pieces."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state_dict's parameter groups do not match this optimizer's")
        inner_state, inner_groups, inner_index = {}, [], 0
        for saved, param_group, params, pieces, layout in zip(groups, self.param_groups, self.trainable,
                                                              self.pieces, self.layouts):
            param_group.update({k: v for k, v in saved.items() if k != "params"})
            saved_state = {id(p): state_dict["state"].get(i, {}) for p, i in zip(param_group["params"],
                                                                                saved["params"])}
            bounds = self._bounds(layout) if layout else []
            for k, (p, (lo, hi)) in enumerate(zip(params, bounds)):
                start = self.rank * layout.shard_numel + lo - layout.offsets[k]    # my piece, in p's elements
                mine = {key: (v.reshape(-1)[start:start + hi - lo].clone() if hi > lo else v.new_empty(0))
                        if torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape else v
                        for key, v in saved_state[id(p)].items()}
                if mine:
                    inner_state[inner_index + k] = mine
            inner_groups.append({**self._options(param_group),
                                 "params": list(range(inner_index, inner_index + len(pieces)))})
            inner_index += len(pieces)
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
