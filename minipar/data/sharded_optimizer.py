"""ZeRO-1 as a drop-in ``torch.optim.Optimizer``: each of N ranks keeps the optimizer state of 1/N of the
parameters (Rajbhandari et al. 2020, "ZeRO", arXiv:1910.02054, stage P_os; PyTorch's
``torch.distributed.optim.ZeroRedundancyOptimizer`` is the same idea with whole parameters per rank).

Use it in your own loop where you would build an optimizer::

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)      # an Optimizer: schedulers work
    loss.backward(); opt.step(); opt.zero_grad(); sched.step()

Each parameter group is concatenated into one flat buffer padded to a multiple of N, S = ⌈numel/N⌉; rank r
owns elements ``[r·S, (r+1)·S)`` (:class:`minipar.data.flat_unit.FlatLayout`, the layout of ZeRO's units):
a flat shard that the inner optimizer (``optimizer_class`` with the group's options) updates, so its state is
K·Ψ/N bytes per rank instead of K·Ψ. One step::

    g_r = reduce-scatter(g / N)[r]        (skipped with average_gradients=False: the model, e.g. DDP, averaged)
    w_r ← inner step on (w_r, g_r)         element-wise optimizers: the same arithmetic as on whole tensors
    w   = all-gather(w_r)                  every rank's parameters are whole again

Bytes per rank per step: (N-1)/N·bΨ for the reduce-scatter + (N-1)/N·bΨ for the all-gather = DDP's
all-reduce. Only element-wise optimizers (SGD, Adam, AdamW, ...) give single-device results on a flat shard;
one that looks at a whole tensor (LAMB's trust ratio, Adafactor, Muon) does not.

``state_dict()`` gathers the shards into the format of ``optimizer_class`` on one device (keyed by parameter
index, tensors of the parameters' shapes), so a checkpoint loads into either; every rank must call it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .flat_unit import FlatLayout

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
        self.layouts = [self._layout(g) for g in self.param_groups]
        self.shards = [torch.nn.Parameter(self._my_shard([p.detach() for p in g["params"]], layout))
                       for g, layout in zip(self.param_groups, self.layouts)]
        self.inner = optimizer_class([{**self._options(g), "params": [shard]}
                                      for g, shard in zip(self.param_groups, self.shards)])

    def _layout(self, param_group) -> FlatLayout:
        dtypes = {p.dtype for p in param_group["params"]}
        if len(dtypes) != 1:
            raise ValueError(f"a parameter group must hold one dtype, got {sorted(map(str, dtypes))}; "
                             f"put each dtype in its own group")
        return FlatLayout([p.shape for p in param_group["params"]], self.n)

    @staticmethod
    def _options(param_group) -> dict:
        return {k: v for k, v in param_group.items() if k != "params"}

    def _my_shard(self, tensors, layout) -> torch.Tensor:
        """This rank's slice of ``tensors`` flattened and padded (a copy)."""
        return layout.flatten(tensors)[layout.shard(self.rank)].clone()

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter (or slice) the gradients, step my shard, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param_group, shard, inner_group, layout in zip(self.param_groups, self.shards, self.inner.param_groups,
                                                           self.layouts):
            inner_group.update(self._options(param_group))          # what a scheduler changed (lr, ...)
            params = param_group["params"]
            shard.copy_(layout.flatten([p.detach() for p in params])[layout.shard(self.rank)])
            grads = layout.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
            if self.average_gradients:
                shard.grad = grads.new_empty(shard.numel())
                comm.reduce_scatter_tensor(shard.grad, grads.div_(self.n), group=self.group)  # divide, then sum
            else:
                shard.grad = grads[layout.shard(self.rank)].clone()
            if all(p.grad is None for p in params):
                shard.grad = None                                   # as torch skips params without grads
        self.inner.step()
        for param_group, shard, layout in zip(self.param_groups, self.shards, self.layouts):
            for p, full in zip(param_group["params"], layout.views(layout.gather(shard, self.group))):
                p.copy_(full)                                       # every rank's parameters whole again
        return loss

    # --- checkpoints: the single-device format of optimizer_class -------------------------------------
    def state_dict(self) -> dict:
        """Gather the shards' state (every rank calls this; PyTorch's ZeroRedundancyOptimizer needs
        ``consolidate_state_dict(to)`` first): ``optimizer_class``'s own state_dict for these parameters on
        one device."""
        inner = self.inner.state_dict()
        state, index = {}, 0
        for g, (param_group, layout) in enumerate(zip(self.param_groups, self.layouts)):
            shard_state = inner["state"].get(g, {})
            for i in range(len(param_group["params"])):
                state[index + i] = {}
            for key, value in shard_state.items():              # an element-wise moment: gather and cut
                pieces = [v.clone() for v in layout.views(layout.gather(value, self.group))] \
                    if _is_flat(value, self.shards[g]) else [value] * len(param_group["params"])
                for i, piece in enumerate(pieces):
                    state[index + i][key] = piece
            index += len(param_group["params"])
        groups, index = [], 0
        for param_group in self.param_groups:
            ids = list(range(index, index + len(param_group["params"])))
            groups.append({**self._options(param_group), "params": ids})
            index += len(ids)
        return {"state": {k: v for k, v in state.items() if v}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict of ``optimizer_class``'s format (from :meth:`state_dict` or from that
        optimizer on one device) for the same parameter groups; every rank keeps its shard."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the state_dict's parameter groups do not match this optimizer's")
        inner_state = {}
        for g, (saved, param_group) in enumerate(zip(groups, self.param_groups)):
            param_group.update({k: v for k, v in saved.items() if k != "params"})
            per_param = [state_dict["state"].get(i, {}) for i in saved["params"]]
            for key in per_param[0] if per_param else ():
                values = [s[key] for s in per_param]
                if all(torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape
                       for v, p in zip(values, param_group["params"])):
                    inner_state.setdefault(g, {})[key] = self._my_shard(values, self.layouts[g])
                else:
                    inner_state.setdefault(g, {})[key] = values[0]
        self.inner.load_state_dict({"state": inner_state, "param_groups": [
            {**self._options(pg), "params": [g]} for g, pg in enumerate(self.param_groups)]})


def _is_flat(value, shard) -> bool:
    """An element-wise state tensor (exp_avg, momentum_buffer, ...) rather than a scalar (step)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == shard.numel()
