"""Cut the wire: run a real training step with every :mod:`minipar.comm` transfer made free and instant.

Inside ``with cut_wire():`` each collective and each send/recv of :mod:`minipar.comm` returns at once,
having moved nothing, with outputs of the right shape (an all-gather fills every slot with this rank's
piece, a reduce-scatter keeps this rank's own chunk, a receive gets zeros, an all-reduce leaves the tensor
as it is). Everything else runs for real: every matmul, element-wise op, copy into a bucket and optimizer
step of this rank's share of the work. The values are wrong (nothing was summed), the shapes and the work
are right, and no rank ever waits for another — so a pipeline has no bubble either.

What the step takes then is its **compute**, measured, in the shapes the strategy really gives each rank
(tensor parallelism's LayerNorms on the whole batch, a pipeline's small micro-batches, ZeRO's flattening):
the term a FLOP count only estimates. A cost model can take it instead of FLOPs / peak and model only
what is left — communication and idle time. FlexFlow's simulator does the same per operator (Jia et al.
2019, "Beyond Data and Model Parallelism for Deep Neural Networks", §5: each operator's time measured once
per configuration, the transfers between them simulated).

Collectives called straight through ``torch.distributed`` (around minipar.comm) are not cut.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from minipar import calls, comm

__all__ = ["cut_wire"]


class _Done:
    """A work handle that has already finished."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future


def _work(async_op=False, **_):
    return _Done() if async_op else None


class _CutDist:
    """Stands in for ``torch.distributed`` inside :mod:`minipar.comm`: transfers are local no-ops with
    right-shaped outputs; every other attribute (ranks, group sizes, ReduceOp, ...) is the real one."""

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, t, **kw):
        return _work(**kw)

    def broadcast(self, t, **kw):
        return _work(**kw)

    def reduce(self, t, **kw):
        return _work(**kw)

    def all_gather(self, out, t, **kw):
        for o in out:
            if o.data_ptr() != t.data_ptr():
                o.copy_(t)
        return _work(**kw)

    def all_gather_flat(self, out, t, **kw):
        out.view(-1, t.numel()).copy_(t.reshape(1, -1).clone())   # t may live inside out
        return _work(**kw)

    def reduce_scatter(self, out, inputs, **kw):
        out.copy_(inputs[dist.get_rank(kw.get("group"))].clone())
        return _work(**kw)

    def reduce_scatter_flat(self, out, t, **kw):
        me = dist.get_rank(kw.get("group"))
        out.copy_(t.reshape(-1)[me * out.numel():(me + 1) * out.numel()].clone().view_as(out))
        return _work(**kw)

    def all_to_all(self, out, inputs, **kw):
        for o, i in zip(out, inputs):
            o.copy_(i)
        return _work(**kw)

    def scatter(self, out, chunks=None, **kw):
        return _work(**kw)

    def gather(self, t, out=None, **kw):
        for o in out or []:
            o.copy_(t)
        return _work(**kw)

    def send(self, t, **kw):
        return None

    def recv(self, t, **kw):
        t.zero_()           # not the buffer's old bytes: NaNs or denormals would change the compute's speed
        return None

    def isend(self, t, **kw):
        return _Done()

    def irecv(self, t, **kw):
        t.zero_()
        return _Done()


@contextlib.contextmanager
def cut_wire():
    """Inside the block, :mod:`minipar.comm` moves nothing and never waits (see the module docstring). The
    calls are still logged, with the bytes they would have sent, and ``seconds`` ≈ 0."""
    cut = _CutDist()
    saved = comm.dist, comm._all_gather_flat, comm._reduce_scatter_flat, calls.dist
    comm.dist, comm._all_gather_flat, comm._reduce_scatter_flat = cut, cut.all_gather_flat, cut.reduce_scatter_flat
    calls.dist = cut                     # send / recv (and the rings built on them) live in minipar.calls
    try:
        yield
    finally:
        comm.dist, comm._all_gather_flat, comm._reduce_scatter_flat, calls.dist = saved
