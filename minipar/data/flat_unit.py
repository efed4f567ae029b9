"""One ZeRO/FSDP unit: its parameters in one flat buffer, 1/N of it owned here, and the collectives that
move between the shard and the whole (Rajbhandari et al. 2020; FSDP's flat parameter, Zhao et al. 2023).

Padded to a multiple of N so every rank owns an equal shard S = ⌈numel/N⌉:

* :meth:`FlatUnit.gather` — all-gather the shards into the full buffer (ZeRO-3 before forward/backward);
* :meth:`FlatUnit.free` — drop the full buffer (ZeRO-3 after forward, after backward);
* :meth:`FlatUnit.reduce_grads_now` / :meth:`reduce_full_grad` — reduce-scatter the full gradient so each
  rank keeps the (summed, then averaged) gradient of its own shard;
* :meth:`FlatUnit.refresh_full` — after the optimizer updated the shard, all-gather the new parameters
  (stages 1 and 2, whose full parameters persist).

Which collectives move the bytes (``comm.ring_algorithms()``, the one switch, asked per collective):

* outside the switch (default): ``torch.distributed``'s, through :mod:`minipar.comm`. On CPU, gloo has no
  reduce-scatter of its own: PyTorch's gloo backend all-reduces the whole buffer and keeps a chunk, so a
  reduce-scatter puts 2(N-1)/N·S on the wire, twice the ring's (observed with :mod:`minipar.observe.wire`): ZeRO-1/2
  then send 1.5x DDP, ZeRO-3 2.0x. (NCCL has a real reduce-scatter.)
* inside ``with comm.ring_algorithms():``: minipar's own rings from send/recv
  (:func:`minipar.comm.ring_reduce_scatter`, :func:`~minipar.comm.ring_all_gather`,
  :func:`~minipar.comm.ring_all_reduce`), which send exactly (N-1)/N·S per reduce-scatter or all-gather: the
  paper's 1x DDP (ZeRO-1/2) and 1.5x DDP (ZeRO-3) are then what the sockets carry. The rings block, so a
  prefetch gathers at once instead of in the background.

Gradients are divided by N *before* they are summed (as DDP does), so 16-bit gradients overflow no sooner
than one rank's would; with N a power of two that division is exact, the same bits as dividing after.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from .. import comm

__all__ = ["FlatUnit", "FreedParameterError", "FreedGradientWarning", "ShardedParameter"]



class FreedParameterError(RuntimeError):
    """A ZeRO-3/FSDP parameter was read while its unit's full storage is freed (between uses)."""


class FreedGradientWarning(UserWarning):
    """``.grad`` of a ZeRO-3/FSDP parameter was read after its gradient was reduce-scattered into a shard."""


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter: a view into its unit's flat buffer, whose storage is freed between uses.

    Reading freed storage would be a read of released memory (a SIGSEGV that kills the rank), so every
    torch operation on it first checks that its unit is gathered and otherwise raises
    :class:`FreedParameterError` saying what to do. Metadata (shape, dtype, ``.grad``, hooks) stays
    readable. Inside the unit's own forward and backward it is an ordinary parameter."""

    _METADATA = frozenset({
        torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
        torch.Tensor.requires_grad.__get__, torch.Tensor.requires_grad.__set__, torch.Tensor.grad.__get__,
        torch.Tensor.grad.__set__, torch.Tensor.data.__set__, torch.Tensor.is_leaf.__get__,
        torch.Tensor.grad_fn.__get__, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.dim,
        torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.__hash__,
        torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.storage_offset, torch.Tensor.stride,
        torch.Tensor.element_size, torch.Tensor.is_contiguous, torch.Tensor.is_floating_point,
        torch.Tensor.layout.__get__, torch.Tensor.nbytes.__get__, torch.Tensor.itemsize.__get__})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in cls._METADATA:
            for arg in tree_leaves((args, kwargs)):
                if isinstance(arg, ShardedParameter) and not arg.flat_unit.gathered:
                    raise FreedParameterError(
                        f"{arg.sharded_name!r} is sharded over {arg.flat_unit.n} ranks and its full storage is "
                        f"freed between uses (ZeRO-3/FSDP); reading it would read released memory. Gather "
                        f"first, on every rank: `with zero.gathered(): ...`, or take full copies with "
                        f"`zero.full_parameters()` (FSDP: `with model.gathered(): ...`, `model.full_state_dict()`).")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func == torch.Tensor.grad.__get__ and result is None and _reduced_away(args[0]):
            unit = args[0].flat_unit
            warnings.warn(
                f"the gradient of {args[0].sharded_name!r} was reduce-scattered, so its .grad is None: this rank "
                f"keeps its 1/{unit.n} of the unit's flat gradient as the .grad of the flat shard the optimizer "
                f"steps (`fsdp_model.parameters()`, or `zero.units[i].master`); full gradients, on every rank: "
                f"`fsdp_model.full_gradients()`.", FreedGradientWarning, stacklevel=2)
        return result


def _reduced_away(param) -> bool:
    return not param.flat_unit.gathered and param.flat_unit.master.grad is not None


class FlatUnit:
    """One unit's parameters as one padded flat buffer; this rank owns (and the optimizer updates) 1/N."""

    def __init__(self, names, params, group, stage, param_dtype=None, on_alloc=None, on_event=None,
                 reduce_dtype=None):
        self.names, self.params, self.group, self.stage = names, params, group, stage
        self.reduce_dtype = reduce_dtype
        self.label = _common_prefix(names)
        self.on_event = on_event or (lambda kind, unit: None)
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = -(-self.numel // self.n)            # S = ceil(numel / N)
        self.padded_numel = self.shard_numel * self.n          # the last shard carries the padding
        self.on_alloc = on_alloc or (lambda nbytes: None)
        master_dtype = params[0].dtype
        flat = torch.zeros(self.padded_numel, dtype=master_dtype, device=params[0].device)
        flat[: self.numel] = torch.cat([p.detach().reshape(-1) for p in params])
        mine = self.owned()
        compute_dtype = param_dtype or master_dtype
        if compute_dtype == master_dtype and stage < 3:
            self.full = flat                                   # FP32: the master shard is a view of it
            self.master = nn.Parameter(flat[mine])
        else:
            self.full = flat.to(compute_dtype)                 # compute copy; FP32 master kept apart
            self.master = nn.Parameter(flat[mine].clone())
        offset = 0
        for name, p in zip(names, params):                     # the module now computes with views of `full`
            p.data = self.full[offset: offset + p.numel()].view(p.shape)
            offset += p.numel()
            if stage == 3:                                     # reading it while freed raises, not crashes
                p.__class__, p.flat_unit, p.sharded_name = ShardedParameter, self, name
        self.full_grad = torch.zeros_like(self.full) if stage <= 1 else None
        self.gathered, self.work, self.sending, self.grads_ready, self.reduced = True, None, None, 0, False
        if stage == 3:
            self.free()

    def owned(self) -> slice:
        """This rank's elements of the flat buffer (everything under stage 0)."""
        if self.stage == 0:
            return slice(0, self.padded_numel)
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)

    # --- parameters: gather / free (stage 3) and rebuild after the update (stages 0-2) ---------------
    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into the full buffer (re-allocating its storage first)."""
        if self.gathered:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.full.numel() * self.full.element_size())
        self.on_alloc(storage.nbytes())
        self.on_event("all-gather", self)
        self.sending = self.master.detach().to(self.full.dtype)    # (kept alive until the gather is done)
        if comm.rings_selected("all_gather"):                 # blocking: a prefetch gathers right now
            self._all_gather(self.full, self.sending)
            async_op = False
        else:
            work = comm.all_gather_into_tensor(self.full, self.sending, group=self.group, async_op=async_op)
            self.work = work if async_op else None            # (the blocking call returns the tensor)
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

    def refresh_full(self) -> None:
        """After the optimizer step (stages 0-2): put the updated shards back into every rank's full copy."""
        if self.stage == 0:
            if self.full.data_ptr() != self.master.data_ptr():
                self.full.copy_(self.master.detach())
            return
        mine = self.full[self.owned()]
        if mine.data_ptr() != self.master.data_ptr():
            mine.copy_(self.master.detach())                   # cast to the compute dtype
        self._all_gather(self.full, mine)                      # in place: my shard is my piece

    # --- gradients -----------------------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Stages 0-1: the module's .grad are views of one persistent flat gradient buffer."""
        self.full_grad.zero_()
        offset = 0
        for p in self.params:
            p.grad = self.full_grad[offset: offset + p.numel()].view_as(p)
            offset += p.numel()

    def reduce_full_grad(self) -> None:
        """Stage 0: all-reduce the whole buffer. Stage 1: reduce-scatter it, in place, into my shard."""
        self.full_grad.div_(self.n)                            # the mean: divide first, then sum
        if self.stage == 0:
            if comm.rings_selected("all_reduce"):
                comm.ring_all_reduce(self.full_grad, group=self.group)
            else:
                comm.all_reduce(self.full_grad, group=self.group)
            mine = self.full_grad
        else:
            mine = self.full_grad[self.owned()]
            self._reduce_scatter(mine, self.full_grad)
        self._set_master_grad(mine)

    def reduce_grads_now(self) -> None:
        """Stages 2-3, when the unit's backward is done: reduce-scatter its gradients, keep only my shard."""
        pieces = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in self.params]
        pad = self.padded_numel - self.numel
        flat = torch.cat(pieces + [pieces[0].new_zeros(pad)]).to(self.reduce_dtype or pieces[0].dtype)
        flat.div_(self.n)                                      # divide first, then sum
        mine = flat.new_empty(self.shard_numel)
        self._reduce_scatter(mine, flat)
        self.on_event("reduce-scatter", self)
        for p in self.params:
            p.grad = None
        self._set_master_grad(mine)
        self.reduced = True
        if self.stage == 3:
            self.free()

    # --- the two collectives, on gloo's implementation or on minipar's rings --------------------------
    def _all_gather(self, full, mine) -> None:
        if comm.rings_selected("all_gather"):
            full.copy_(comm.ring_all_gather(mine.clone(), group=self.group))
        else:
            comm.all_gather_into_tensor(full, mine, group=self.group)

    def _reduce_scatter(self, mine, flat) -> None:
        if comm.rings_selected("reduce_scatter"):
            mine.copy_(comm.ring_reduce_scatter(flat.view(self.n, -1), group=self.group).reshape(-1))
        else:
            comm.reduce_scatter_tensor(mine, flat, group=self.group)

    def _set_master_grad(self, averaged) -> None:
        grad = averaged.to(self.master.dtype)                  # already the mean over ranks (divided first)
        if self.master.grad is None or self.stage <= 1:
            self.master.grad = grad
        else:
            self.master.grad += grad

    def on_param_grad(self, _param) -> None:
        self.grads_ready += 1
        if self.grads_ready == len(self.params):
            self.reduce_grads_now()


def _common_prefix(names) -> str:
    """'blocks.0' for a block's parameters; '(root)' when they share no module."""
    module_paths = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*module_paths):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) or "(root)"
