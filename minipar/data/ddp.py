"""Distributed data parallelism from scratch: one process per device, gradients averaged during backward.

Every rank holds a full replica and a different shard of the global batch B (B/N rows each). Replicas
start equal (parameters broadcast from the group's first rank) and stay equal because every rank applies
the same averaged gradient::

    g = (1/N) · Σ_r g_r,   g_r = ∇ mean-loss over rank r's B/N rows  ==  ∇ mean-loss over all B rows

so N ranks take exactly the step one device takes on the global batch (up to the order in which floats
are summed). The average is one all-reduce of every gradient: 2(N-1)/N · (gradient bytes) sent per rank.

To hide that traffic, a hook on each parameter fires as soon as its gradient is accumulated; gradients
are packed into *buckets* of about ``bucket_bytes`` (filled in reverse registration order, which is
roughly the order backward produces them) and each bucket's all-reduce is launched asynchronously the
moment it is full, while backward goes on computing the earlier layers' gradients. Each ``.grad`` then
*is* its slot in the bucket (a view, as PyTorch's ``gradient_as_bucket_view=True``): the all-reduce
averages the gradients in place, with no copy back. Buckets are launched
strictly in index order, so every rank issues the same collectives in the same order even when a
parameter gets no gradient on some rank (its slot is filled with zeros at the end of backward). The end
of backward is hooked on the model's output, so a rank whose backward reaches no parameter at all still
takes part in every bucket's all-reduce instead of leaving the others waiting.

Parameters without a gradient, as PyTorch's DDP treats them: with ``find_unused_parameters=True`` a
parameter used on some rank gets the average (the others count zero), one used on no rank keeps
``grad=None`` (Adam then leaves it alone, as on one device); without it, a parameter that got no gradient is
an error (PyTorch raises at the next forward; here at the end of that backward, naming rank and parameter).

Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB).

    model = DistributedDataParallel(TinyGPT(cfg), group=None, bucket_bytes=64 * 1024)
    loss = ...; loss.backward()          # buckets all-reduced while backward runs
    opt.step()
    with model.no_sync(): ...            # accumulate locally, sync on the next backward outside
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..recipe import RunResult
from ..launcher import launch
from ..loop import mean_over_ranks, shard_batch
from .buckets import Bucket, assign_buckets

__all__ = ["Bucket", "Reducer", "DistributedDataParallel", "assign_buckets", "replicas_in_sync",
           "DEFAULT_BUCKET_BYTES", "validate", "parallel_train", "run"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch's default bucket_cap_mb = 25


class Reducer:
    """Averages gradients over ``group`` bucket by bucket, launching each bucket as soon as it is full.

    ``collective(buffer, group)`` launches the reduction and returns an async work handle; the default is
    ``comm.all_reduce(..., async_op=True)`` (a sharded strategy can pass a reduce-scatter instead).
    ``average=True`` divides each bucket by the group size before the sum (keeps 16-bit buffers from
    overflowing), once per bucket, just before it is sent.
    Its timeline (gradients ready, buckets launched and done) is observed from outside:
    :func:`minipar.data.ddp_measure.watch_buckets`.
    """

    def __init__(self, params: list, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 comm_dtype: torch.dtype | None = None, average: bool = True, collective=None,
                 names: dict | None = None):
        self.group = group
        self.collective = collective or (lambda buf, g: comm.all_reduce(buf, group=g, async_op=True))
        element_size = torch.empty(0, dtype=comm_dtype).element_size() if comm_dtype else None
        # Reverse registration order: the last layers' gradients are ready first in backward.
        ordered = list(reversed(params))
        divisor = dist.get_world_size(group) if average else 1
        self.buckets = [Bucket(i, ps, comm_dtype, divisor)
                        for i, ps in enumerate(assign_buckets(ordered, bucket_bytes, element_size))]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.names = names or {}
        self.next_to_launch = 0

    def grad_ready(self, param) -> None:
        """Called by a parameter's hook once its gradient is accumulated."""
        if self.bucket_of[id(param)].fill(param):        # its bucket is full now: maybe launch it
            self.launch_ready()

    def launch_ready(self) -> None:
        """Launch every full bucket, in index order only: a full bucket waits for the earlier ones, so all
        ranks issue the same collectives in the same order."""
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].is_full:
            self.launch(self.buckets[self.next_to_launch])
            self.next_to_launch += 1

    def launch(self, bucket: Bucket) -> None:
        """Divide ``bucket`` by N (its slots then hold g_r / N: the sum is the mean) and start its reduction
        asynchronously."""
        bucket.scale()
        bucket.work = self.collective(bucket.buffer, self.group)

    def finish(self) -> list:
        """End of backward: fill the slots of parameters that got no gradient, launch what is left, wait
        for every bucket; the averages are in ``.grad`` (its bucket slot; cast back from another
        ``comm_dtype``). Returns the parameters that had no gradient on this rank."""
        absent = []
        for bucket in self.buckets[self.next_to_launch:]:
            absent += bucket.fill_missing()
        self.launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.copy_out()
            bucket.reset()
        self.next_to_launch = 0
        return absent


class DistributedDataParallel(nn.Module):
    """Wrap ``module``: broadcast its state from the group's first rank, then average gradients over
    ``group`` during every backward (see the module docstring).

    ``bucket_bytes``: bucket capacity. ``comm_dtype``: dtype on the wire (e.g. ``torch.bfloat16``).
    ``find_unused_parameters``: also all-reduce a 0/1 mask of which parameters got a gradient, so that a
    parameter no rank used keeps ``grad=None`` as on one device (costs one small extra all-reduce).
    Frozen parameters (``requires_grad=False``) are never bucketed nor reduced.
    """

    def __init__(self, module: nn.Module, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 comm_dtype: torch.dtype | None = None, find_unused_parameters: bool = False):
        super().__init__()
        if comm_dtype is not None and not comm_dtype.is_floating_point:
            raise ValueError(f"comm_dtype must be a floating-point dtype, got {comm_dtype}")
        self.module, self.group = module, group
        self.find_unused_parameters = find_unused_parameters
        self.require_sync = True
        # Decided by forward, as in torch: a backward syncs only if its forward ran through this wrapper
        # outside no_sync() (a backward through the bare module must not start collectives on one rank).
        self._sync_this_backward = False
        self._broadcast_state()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.reducer = Reducer([p for _, p in named], group, bucket_bytes, comm_dtype,
                               names={id(p): n for n, p in named})
        self._finish_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self.on_grad) for _, p in named]

    def _broadcast_state(self) -> None:
        """Every replica starts from the first rank's weights (and buffers)."""
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                comm.broadcast(t.data, src=src, group=self.group)

    def forward(self, *args, **kwargs):
        self._sync_this_backward = self.require_sync and torch.is_grad_enabled()
        out = self.module(*args, **kwargs)
        if self._sync_this_backward:
            for t in _tensors(out):
                if t.requires_grad:   # backward starts here: finish even if it reaches no parameter
                    t.register_hook(self._on_output_grad)
        return out

    def _on_output_grad(self, grad):
        if self._sync_this_backward:
            self._queue_finish()
        return grad

    def _queue_finish(self) -> None:
        if not self._finish_queued:
            # Runs once when this backward pass is complete: reduce whatever is left and wait.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._finish_queued = True

    def on_grad(self, param) -> None:
        """The hook on every parameter: its gradient is ready, hand it to the reducer (which may launch a
        bucket now, while backward goes on)."""
        if not self._sync_this_backward:
            return  # no_sync (or a forward that bypassed the wrapper): the gradient just accumulates
        self._queue_finish()
        self.reducer.grad_ready(param)

    def _finish(self) -> None:
        self._finish_queued = self._sync_this_backward = False
        absent = self.reducer.finish()       # every bucket all-reduced: no peer is left waiting
        if self.find_unused_parameters:
            self._drop_unused(absent)
        elif absent:
            names = sorted(self.reducer.names.get(id(p), "?") for p in absent)
            raise RuntimeError(f"rank {dist.get_rank()}: parameter(s) {names} got no gradient in this backward; "
                               f"PyTorch's DDP fails on that too (at the next forward). Pass "
                               f"find_unused_parameters=True if some parameters may go unused")

    def _drop_unused(self, absent: list) -> None:
        """A parameter no rank used has no gradient on one device either: give it back grad=None."""
        params = [p for b in self.reducer.buckets for p in b.params]
        used = torch.tensor([0.0 if any(p is a for a in absent) else 1.0 for p in params])
        comm.all_reduce(used, group=self.group)
        for p, count in zip(params, used.tolist()):
            if count == 0:
                p.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Forward (and backward) passes inside this block only accumulate into ``.grad``; the first
        backward of a forward run outside it averages the accumulated sum. Step the optimizer only after
        that synced backward."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


def _tensors(out) -> list:
    """The tensors in a forward's output (a tensor, or tuples / lists / dicts of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def replicas_in_sync(module: nn.Module, group=None, atol: float = 0.0) -> bool:
    """True when every rank's parameters equal the first rank's (within ``atol``): the check that catches
    replicas drifting apart, e.g. after an optimizer step taken on un-synced gradients."""
    flat = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    reference = flat.clone()
    src = 0 if group is None else dist.get_global_rank(group, 0)
    comm.broadcast(reference, src=src, group=group)
    worst = torch.tensor([(flat - reference).abs().max().item() if flat.numel() else 0.0])
    comm.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return worst.item() <= atol


# ----------------------------------------------------------------------------------------------------
# Training a Recipe with it (what the tests, the tour and the chapter run)
# ----------------------------------------------------------------------------------------------------

def validate(recipe, *, world_size: int, accum_steps: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             **_) -> None:
    """Raise ValueError, before any process starts, when the global batch cannot be split evenly."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    for step, (inputs, _) in enumerate(recipe.batches):
        if inputs.shape[0] % (world_size * accum_steps):
            raise ValueError(f"global batch {step} has {inputs.shape[0]} rows: not divisible by "
                             f"{world_size} ranks x {accum_steps} accumulation steps")


def parallel_train(rank: int, world_size: int, recipe, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   comm_dtype=None, accum_steps: int = 1, find_unused_parameters: bool = False,
                   step_log: "comm.CommLog | None" = None, group=None):
    """Train ``recipe`` with DDP; each rank takes its 1/N of every global batch, split into
    ``accum_steps`` micro-batches of which all but the last run under ``no_sync()``.

    The communication of the training steps is recorded into ``step_log`` (the initial broadcast and the
    all-reduce of the loss for reporting are not). Returns a :class:`minipar.recipe.RunResult`."""
    validate(recipe, world_size=world_size, accum_steps=accum_steps, bucket_bytes=bucket_bytes)
    model = recipe.model().to(recipe.dtype)
    ddp = DistributedDataParallel(model, group, bucket_bytes, comm_dtype, find_unused_parameters)
    opt = recipe.optimizer(model.parameters())
    losses = []
    for batch in recipe.batches:
        inputs, targets = shard_batch(batch, rank, world_size)
        with comm.recording(step_log if step_log is not None else comm.CommLog()):
            opt.zero_grad(set_to_none=True)
            local = torch.zeros((), dtype=torch.float64)
            for i, (x, y) in enumerate(zip(inputs.chunk(accum_steps), targets.chunk(accum_steps))):
                last = i == accum_steps - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = recipe.loss(ddp, x, y) / accum_steps
                    loss.backward()
                local += loss.detach().double()
            opt.step()
        losses.append(mean_over_ranks(local, group))   # equal shards: the global batch's mean loss
    return RunResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def run(recipe, *, world_size: int, quiet: bool = True, **config) -> list:
    """Check the inputs, then run :func:`parallel_train` on ``world_size`` ranks; per-rank RunResults."""
    validate(recipe, world_size=world_size, **config)
    return launch(parallel_train, world_size, recipe, quiet=quiet, **config)
