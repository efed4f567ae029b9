"""Which gradient hooks DDP puts on the parameters: one per parameter until it knows the order gradients arrive
in, then one per bucket.

A Python hook costs a call into the interpreter between two backward kernels, with cold caches. Measured on this
CPU (bench ddp's TinyGPT, 53 parameters in 4 buckets, 2 ranks): one hook per parameter costs 0.2-0.3 ms more CPU
per step than one per bucket. PyTorch's reducer marks each gradient ready in C++ and pays almost nothing per
parameter. So, like PyTorch's reducer, which rebuilds its buckets in the order gradients arrived in the first
iteration, :class:`GradHooks` watches the first synced backward in which every parameter gets a gradient, with a
hook on every parameter, and then keeps one hook per bucket, on the parameter whose gradient arrived last. The
bucket is launched from that hook, as soon as its last gradient lands.

The order can change (a forward that takes another branch, a parameter left unused): a bucket's hook checks that
every gradient of its bucket has arrived in this backward — ``.grad`` is set, and is not the tensor, unmodified,
that was there when backward started (a snapshot taken by DDP's hook on the output, before any gradient). If one
has not, the bucket is left to the end of backward (DDP's ``finish`` gathers and launches it, the gradient then
surely there), and from the next backward on every parameter has its own hook again, for good. A gradient that was
already a view when backward started (a bucket slot kept by ``zero_grad(set_to_none=False)``: all slots of a bucket
share one version counter) cannot be checked so, and counts as not arrived: such loops fall back the same way.
"""
from __future__ import annotations

import functools

__all__ = ["GradHooks"]


class GradHooks:
    """The hooks of ``ddp`` (a :class:`minipar.data.ddp.DistributedDataParallel`) on ``params``."""

    def __init__(self, ddp, params: list):
        self.ddp, self.params = ddp, params
        self.learning, self.per_bucket, self.deferred = True, False, False
        self.order: list = []                  # arrival order in the synced backward being learned from
        self.before: dict | None = None        # id(p) -> (its .grad when backward started, its version or None)
        self.handles = [p.register_post_accumulate_grad_hook(self._learn) for p in params]

    def _learn(self, param) -> None:
        if self.ddp._sync_this_backward:
            self.order.append(param)
        self.ddp.on_grad(param)

    def backward_starts(self) -> None:
        """DDP's hook on the output: the snapshot each bucket's hook compares with (once per backward)."""
        if self.per_bucket and self.before is None:
            self.before = {id(p): (g, None if g._is_view() else g._version)
                           for p in self.params if (g := p.grad) is not None}

    def _on_bucket(self, bucket, param) -> None:
        """The one hook of ``bucket``, on the parameter whose gradient came last: launch it if it is complete."""
        ddp = self.ddp
        if not ddp._sync_this_backward:
            return                             # no_sync: the gradients just accumulate
        ddp._queue_finish()
        if self._arrived(bucket):
            ddp.reducer.bucket_ready(bucket)
        else:
            self.deferred = True               # finish() gathers and launches it; per-parameter hooks from now on

    def _arrived(self, bucket) -> bool:
        before = self.before
        if before is None:
            return False
        for p in bucket.params:
            g = p.grad
            if g is None:
                return False
            old = before.get(id(p))
            if old is not None and (old[1] is None or (g is old[0] and g._version == old[1])):
                return False
        return True

    def backward_done(self, every_bucket_full: bool) -> None:
        """End of a synced backward: ``every_bucket_full`` when every parameter's gradient reached its bucket
        through a hook (none left to the end of backward)."""
        self.before = None
        if self.learning and every_bucket_full:
            self._hook_buckets()
        elif self.per_bucket and self.deferred:
            self._hook_parameters()
        self.order = []

    def _hook_buckets(self) -> None:
        last = {}
        for p in self.order:
            last[id(self.ddp.reducer.bucket_of[id(p)])] = p
        self._remove()
        for bucket in self.ddp.reducer.buckets:
            hook = functools.partial(self._on_bucket, bucket)
            self.handles.append(last[id(bucket)].register_post_accumulate_grad_hook(hook))
        self.learning, self.per_bucket = False, True

    def _hook_parameters(self) -> None:
        self._remove()
        self.handles = [p.register_post_accumulate_grad_hook(self.ddp.on_grad) for p in self.params]
        self.learning = self.per_bucket = self.deferred = False

    def _remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
