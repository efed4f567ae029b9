"""One flat buffer: how ZeRO, FSDP, the sharded optimizer, the parameter server and resharding lay tensors
out, and the collectives that move between a rank's shard and the whole (Rajbhandari et al. 2020, "ZeRO";
FSDP1's flat parameter, Zhao et al. 2023). Read top to bottom, a unit's life::

  1. flatten         its parameters, one after another: tensor i at [o_i, o_i + numel_i)     FlatLayout
  2. pad             to N·S elements, S = ⌈numel/N⌉ (the last shard carries the padding)   FlatLayout
  3. shard           rank r owns [r·S, (r+1)·S): its ``master``, all the optimizer sees    FlatUnit.__init__
  4. all-gather      the shards into the full buffer (stage 3: before forward/backward)    FlatUnit.gather
  5. compute         the module's parameters are views of the full buffer                  FlatUnit.__init__
  6. free            the full buffer's storage (stage 3: after forward, after backward)    FlatUnit.free
  7. reduce-scatter  the flat gradient: each rank keeps its shard's mean                   FlatUnit.reduce_*
  8. all-gather      the updated shards (stages 1-2, whose full parameters persist)        FlatUnit.refresh_full

:class:`~minipar.flat.FlatLayout` is that arithmetic alone (offsets, padding, shard bounds, cutting a flat
tensor into named views), written once on the ground floor; :class:`~minipar.data.sharded_optimizer.ShardedOptimizer`,
the parameter server, FSDP's state dicts and :mod:`minipar.hybrid.reshard` use it too. :meth:`FlatUnit.full_tensors` and
:meth:`FlatUnit.my_shard` are the two moves a checkpoint needs: every rank's shard to named full tensors
(an all-gather) and back (each rank cuts its own).

Which collectives move the bytes: every collective here is a :mod:`minipar.comm` wrapper, and
``comm.ring_algorithms()`` is the one switch.

* outside it (default): ``torch.distributed``'s. On CPU, gloo has no reduce-scatter of its own: PyTorch's
  gloo backend all-reduces the whole buffer and keeps a chunk, so a reduce-scatter puts 2(N-1)/N·S on the
  wire, twice the ring's (observed with :mod:`minipar.wire`): ZeRO-1/2 then send 1.5x DDP, ZeRO-3
  2.0x. (NCCL has a real reduce-scatter.)
* inside ``with comm.ring_algorithms():``: minipar's own rings from send/recv, which send exactly (N-1)/N·S
  per reduce-scatter or all-gather: the paper's 1x DDP (ZeRO-1/2) and 1.5x DDP (ZeRO-3) are then what the
  sockets carry. The rings block, so a prefetch gathers at once instead of in the background.

Gradients are divided by N *before* they are summed (as DDP does), so 16-bit gradients overflow no sooner
than one rank's would; with N a power of two that division is exact, the same bits as dividing after.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..flat import FlatLayout
from .sharded_parameter import ShardedParameter

__all__ = ["FlatUnit", "gather_flat", "call_when_gradient_reaches", "WhenGradientReaches"]


def gather_flat(layout: FlatLayout, shard: torch.Tensor, group=None) -> torch.Tensor:
    """4. The full flat buffer of ``layout`` from every rank's ``shard``: an all-gather (every rank calls it)."""
    full = shard.new_empty(layout.padded_numel)
    comm.all_gather_into_tensor(full, shard.detach().contiguous(), group=group)
    return full


class FlatUnit:
    """One unit's parameters as one padded flat buffer; this rank owns (and the optimizer updates) 1/N.
    ``stage`` 0 owns the whole buffer (DDP); 1-2 keep the full parameters; 3 frees them between uses."""

    def __init__(self, names, params, group, stage, param_dtype=None, on_alloc=None, on_event=None,
                 reduce_dtype=None, accumulate: bool = False, replicate_group=None, async_reduce: bool = False):
        self.names, self.params, self.group, self.stage = names, params, group, stage
        self.replicate_group = replicate_group       # HSDP: the same shard on other nodes (minipar.data.hsdp)
        # stages 2-3: post the reduce-scatter and return, so that it runs under the next unit's backward
        # (PyTorch FSDP's way); its result is taken by wait_reduce, before the optimizer step
        self.async_reduce, self.pending = async_reduce, None
        # accumulate: the gradients of every micro-batch add up in one full flat buffer, reduce-scattered once
        # per step whatever the stage (a pipeline's ZeRO-2/3); stages 2-3 free that buffer between steps
        self.accumulate = accumulate or stage <= 1
        self.reduce_dtype = reduce_dtype
        self.label = _common_prefix(names)
        self.on_event = on_event or (lambda kind, unit: None)
        self.on_alloc = on_alloc or (lambda nbytes: None)
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = FlatLayout([p.shape for p in params], self.n)
        self.numel, self.padded_numel = self.layout.numel, self.layout.padded_numel
        master_dtype = params[0].dtype
        flat = self.layout.flatten([p.detach() for p in params]).to(master_dtype)     # 1-2. flatten, pad
        compute_dtype = param_dtype or master_dtype
        if compute_dtype == master_dtype and stage < 3:
            self.full = flat                                   # FP32: the master shard is a view of it
            self.master = nn.Parameter(flat[self.owned()])     # 3. shard
        else:
            self.full = flat.to(compute_dtype)                 # compute copy; FP32 master kept apart
            self.master = nn.Parameter(flat[self.owned()].clone())
        for name, p, view in zip(names, params, self.layout.views(self.full)):
            p.data = view                                      # 5. the module computes with views of `full`
            if stage == 3:                                     # reading it while freed raises, not crashes
                p.__class__, p.flat_unit, p.sharded_name = ShardedParameter, self, name
        self.full_grad = torch.zeros_like(self.full) if self.accumulate else None
        self.gathered, self.work, self.sending, self.reduced = True, None, None, False
        if self.accumulate and stage >= 2:
            self._resize(self.full_grad, 0)
        if stage == 3:
            self.free()

    def _resize(self, tensor, numel: int) -> None:
        """Give ``tensor``'s storage ``numel`` elements (0: free it), telling the memory observer."""
        storage = tensor.untyped_storage()
        self.on_alloc(numel * tensor.element_size() - storage.nbytes())
        storage.resize_(numel * tensor.element_size())

    def owned(self) -> slice:
        """This rank's elements of the flat buffer (everything under stage 0)."""
        return slice(0, self.padded_numel) if self.stage == 0 else self.layout.shard(self.rank)

    # --- 4-6. parameters: gather, compute, free (stage 3) ------------------------------------------------
    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into the full buffer (re-allocating its storage first)."""
        if self.gathered:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.full.numel() * self.full.element_size())
        self.on_alloc(storage.nbytes())
        self.on_event("all-gather", self)
        self.sending = self.master.detach().to(self.full.dtype)    # (kept alive until the gather is done)
        async_op = async_op and not comm.rings_selected("all_gather")   # the rings block: gather right now
        work = comm.all_gather_into_tensor(self.full, self.sending, group=self.group, async_op=async_op)
        self.work = work if async_op else None                 # (the blocking call returns the tensor)
        self.gathered = True
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work = self.sending = None

    def free(self) -> None:
        """Give the full parameters' memory back; the views (and autograd's saved ones) stay, storage-less."""
        if not self.gathered:
            return
        self.wait()
        storage = self.full.untyped_storage()
        self.on_alloc(-storage.nbytes())
        self.on_event("free", self)
        storage.resize_(0)
        self.gathered = False

    # --- 7. gradients: reduce-scatter into my shard --------------------------------------------------------
    def attach_grads(self) -> None:
        """Stages 0-1 (and ``accumulate``): the module's .grad are views of one flat gradient buffer, persistent
        under stages 0-1, allocated again here under 2-3."""
        if self.full_grad.untyped_storage().nbytes() == 0:
            self._resize(self.full_grad, self.full_grad.numel())
        self.full_grad.zero_()
        for p, view in zip(self.params, self.layout.views(self.full_grad)):
            p.grad = view

    def reduce_full_grad(self) -> None:
        """Stage 0: all-reduce the whole buffer. Stage 1: reduce-scatter it, in place, into my shard. Stages 2-3
        with ``accumulate``: the same, then keep my shard's gradient and free the buffer."""
        self.full_grad.div_(self.n)                            # the mean: divide first, then sum
        if self.stage == 0:
            comm.all_reduce(self.full_grad, group=self.group)
            mine = self.full_grad
        else:
            mine = self.full_grad[self.owned()]
            comm.reduce_scatter_tensor(mine, self.full_grad, group=self.group)
        if self.stage >= 2:                                    # only my shard's gradient survives the step
            self._set_master_grad(mine.clone())
            for p in self.params:
                p.grad = None
            self._resize(self.full_grad, 0)
            self.reduced = True
            return
        self._set_master_grad(mine)

    def reduce_at_inputs(self, args):
        """Stages 2-3 (a forward pre-hook): reduce-scatter when the gradient reaches the unit's inputs, one place in
        every rank's backward, after every parameter's gradient (autograd runs later nodes and AccumulateGrad
        first). Counting gradients fires on a rank that used every parameter, not on one that left some unused (an
        MoE expert): collectives out of order, a deadlock. Every rank runs every unit; the root (inputs needing no
        gradient) is reduced by ``ZeRO.finish_gradients``."""
        self.reduced = False                                   # a forward: this unit's backward is to come
        return call_when_gradient_reaches(args, lambda: None if self.reduced else self.reduce_grads_now())

    def on_param_grad(self, param) -> None:
        if self.reduced:                                       # after the reduce-scatter it would be lost
            name = next(n for n, p in zip(self.names, self.params) if p is param)
            raise RuntimeError(f"{name}: its gradient arrived after unit {self.label} "
                               f"was reduce-scattered: a parameter used outside its unit belongs in the root")

    def reduce_grads_now(self) -> None:
        """Stages 2-3, when the unit's backward is done: reduce-scatter its gradients, keep only my shard."""
        pieces = [p.grad if p.grad is not None else p.new_zeros(p.numel()) for p in self.params]
        flat = self.layout.flatten(pieces).to(self.reduce_dtype or pieces[0].dtype)
        flat.div_(self.n)                                      # divide first, then sum
        mine = flat.new_empty(self.layout.shard_numel)
        async_op = self.async_reduce and not comm.rings_selected("reduce_scatter")   # the rings block
        self.on_event("reduce-scatter", self)                  # (before it: ZeRO checks the ranks agree)
        work = comm.reduce_scatter_tensor(mine, flat, group=self.group, async_op=async_op)
        for p in self.params:
            p.grad = None
        self.reduced = True
        if self.stage == 3:
            self.free()                                        # the reduce-scatter reads the gradients only
        self.pending = (work if async_op else None, mine, flat)    # flat: kept alive until the work is done
        if not async_op:
            self.wait_reduce()

    def wait_reduce(self) -> None:
        """Take a posted reduce-scatter's result: my shard's mean gradient (a no-op when none is pending)."""
        if self.pending is None:
            return
        work, mine, _ = self.pending
        if work is not None:
            work.wait()
        self.pending = None
        self._set_master_grad(mine)

    def _set_master_grad(self, averaged) -> None:
        if self.replicate_group is not None:                   # HSDP: average my shard over its replicas too
            averaged = averaged / dist.get_world_size(self.replicate_group)
            comm.all_reduce(averaged, group=self.replicate_group)
        grad = averaged.to(self.master.dtype)                  # already the mean over ranks (divided first)
        if self.master.grad is None or self.stage <= 1:
            self.master.grad = grad
        else:
            self.master.grad += grad

    # --- 8. after the optimizer step ---------------------------------------------------------------------
    def refresh_full(self) -> None:
        """After the optimizer step (stages 0-2): put the updated shards back into every rank's full copy."""
        if self.stage == 0:
            if self.full.data_ptr() != self.master.data_ptr():
                self.full.copy_(self.master.detach())
            return
        mine = self.full[self.owned()]
        if mine.data_ptr() != self.master.data_ptr():
            mine.copy_(self.master.detach())                   # cast to the compute dtype
        comm.all_gather_into_tensor(self.full, mine, group=self.group)    # in place: my shard is my piece

    # --- checkpoints: shard <-> named full tensors ------------------------------------------------------
    def full_tensors(self, shard: torch.Tensor) -> list:
        """Every rank's ``shard`` of this unit's buffer (the master, its gradient, an Adam moment) as full
        tensors, one per parameter in order, copies: an all-gather (every rank calls it) under stages 1-3."""
        full = shard.detach() if self.stage == 0 else gather_flat(self.layout, shard, self.group)
        return [view.clone() for view in self.layout.views(full)]

    def my_shard(self, tensors) -> torch.Tensor:
        """This rank's shard of ``tensors`` (full-size, one per parameter): flatten, pad, cut; no collective."""
        return self.layout.flatten(tensors)[self.owned()].clone()


def call_when_gradient_reaches(args: tuple, reached):
    """``args`` with an identity put on each tensor that needs a gradient, whose backward calls ``reached()`` (a
    unit's reduce-scatter: ZeRO-2/3's flat units, per-parameter FSDP); None when no input needs a gradient or
    autograd is off (that unit then reduces at the end of the backward)."""
    marked = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
    if not marked or not torch.is_grad_enabled():
        return None
    outs = iter(WhenGradientReaches.apply(reached, *(args[i] for i in marked)))
    return tuple(next(outs) if i in marked else a for i, a in enumerate(args))


class WhenGradientReaches(torch.autograd.Function):
    """Identity on a unit's inputs; its backward calls ``reached()`` before passing the gradients on."""
    @staticmethod
    def forward(ctx, reached, *inputs):
        ctx.reached = reached
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.reached()
        return (None, *grads)


def _common_prefix(names) -> str:
    """'blocks.0' for a block's parameters; '(root)' when they share no module."""
    module_paths = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*module_paths):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) or "(root)"
