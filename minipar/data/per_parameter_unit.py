"""One unit of per-parameter FSDP (:mod:`minipar.data.fsdp2`): its parameters, each sharded on dim 0, and the
collectives that move between this rank's shards and the full parameters.

A parameter of shape (d₀, …) is padded to N·c rows, c = ⌈d₀/N⌉; rank r holds rows [r·c, (r+1)·c) as a
parameter of shape (c, …) (zeros past d₀). A unit (a module gathered together) moves its parameters in
one collective each way, through staging buffers::

    copy-in     my shards, one after another, into a flat send buffer        T = Σ c_p·(rest of p) elements
    all-gather  N·T elements: row r of the (N, T) result is rank r's buffer
    copy-out    each parameter's column block of it, (N·c_p, …), cut to d₀ rows: the full parameter
    ... forward / backward with the full parameters ...
    copy-in     each full gradient padded to N·c_p rows, as (N, c_p·rest), into its column block
    reduce-scatter  (÷N first) row r, T elements, to rank r; copy-out: each parameter's piece is its ``.grad``
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..flat import FlatLayout

__all__ = ["ShardedParam", "PerParameterUnit"]


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
        self.in_flight, self.posted = None, None       # a posted all-gather, a posted reduce-scatter
        self.reduced, self.used_here = False, [False] * len(params)

    def gather(self, async_op: bool = False) -> None:
        """Copy-in and all-gather (``async_op``: posted, a prefetch); :meth:`wait` copies out, so that every
        parameter's full tensor is there (storage re-allocated)."""
        if self.gathered:
            return
        send = self.copy_in(self.params[0].full.dtype)
        received = send.new_empty(self.n * self.total)
        async_op = async_op and not comm.rings_selected("all_gather")       # the rings block: gather now
        work = comm.all_gather_into_tensor(received, send, group=self.group, async_op=async_op)
        self.gathered, self.in_flight = True, (work if async_op else None, send, received)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish a posted all-gather: wait for it, copy each parameter's full tensor out (a no-op if none)."""
        if self.in_flight is None:
            return
        work, _, received = self.in_flight
        if work is not None:
            work.wait()
        self.in_flight = None
        for p, full in zip(self.params, self.copy_out(received)):
            p.full.data.untyped_storage().resize_(full.numel() * full.element_size())
            p.full.data.copy_(full)                     # .data: refilling it is no autograd in-place write

    def full_tensors(self, dtype) -> list:
        """Every rank's shards, all-gathered in ``dtype`` (the shards' own for a state dict: a 16-bit compute
        copy would round FP32 masters): each parameter's full tensor, one per parameter."""
        send = self.copy_in(dtype)
        received = send.new_empty(self.n * self.total)
        comm.all_gather_into_tensor(received, send, group=self.group)
        return self.copy_out(received)

    def copy_in(self, dtype) -> torch.Tensor:
        """My shards in ``dtype``, one after another: the all-gather's send buffer (T elements)."""
        return self.layout.flatten([p.shard.detach().to(dtype) for p in self.params])

    def copy_out(self, received: torch.Tensor) -> list:
        """Row r of the (N, T) result is rank r's buffer: each parameter's column block, cut to d₀ rows."""
        table = received.view(self.n, self.total)
        return [table[:, offset:offset + p.numel].reshape(self.n * p.c, p.rest)[:p.d0].reshape(p.shape)
                for p, offset in zip(self.params, self.offsets)]

    def free(self) -> None:
        self.wait()                                     # a prefetch still in flight writes into `received`
        for p in self.params:
            p.full.data.untyped_storage().resize_(0)
        self.gathered = False

    def reduce(self, async_op: bool = False) -> None:
        """Copy-in the full gradients (zeros for a parameter this rank did not use; ``used_here`` says which),
        reduce-scatter their mean (``async_op``: posted, :meth:`finish_reduce` takes it)."""
        dtype = self.reduce_dtype or self.params[0].full.dtype
        table = torch.zeros(self.n, self.total, dtype=dtype)
        self.used_here = [p.full.grad is not None for p in self.params]
        for p, offset in zip(self.params, self.offsets):
            if p.full.grad is not None:
                rows = p.full.grad.reshape(p.d0, p.rest).to(dtype)
                padded = torch.cat([rows, rows.new_zeros(self.n * p.c - p.d0, p.rest)])
                table[:, offset:offset + p.numel] = padded.view(self.n, p.numel)
            p.full.grad = None
        table.div_(self.n)                                                  # the mean: divide, then sum
        mine = table.new_empty(self.total)
        async_op = async_op and not comm.rings_selected("reduce_scatter")
        work = comm.reduce_scatter_tensor(mine, table.view(-1), group=self.group, async_op=async_op)
        self.posted, self.reduced = (work if async_op else None, mine, table), True   # table: alive until done

    def finish_reduce(self, active) -> None:
        """Wait for the reduce-scatter; copy-out each piece into ``shard.grad`` (added, as torch accumulates)
        for the parameters some rank used (``active``); the others keep their ``.grad``."""
        if self.posted is None:
            return
        work, mine, _ = self.posted
        if work is not None:
            work.wait()
        self.posted = None
        for p, offset, used in zip(self.params, self.offsets, active):
            if used:
                piece = mine[offset:offset + p.numel].view_as(p.shard).to(p.shard.dtype)
                p.shard.grad = piece.clone() if p.shard.grad is None else p.shard.grad + piece
