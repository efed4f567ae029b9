"""The collectives a learner sees, as thin wrappers over ``torch.distributed`` that tell the active hooks.

Every call passes :func:`minipar.calls.call`, which tells each active hook (:mod:`minipar.hooks`) of it; the
comm log (``with comm.recording() as log:``) is one such hook, and holds one
:class:`~minipar.comm_log.CommRecord` per call: the operation, the group size N, the payload S in bytes, and
the bytes this rank sends and receives under the algorithm named in the record, with the wall time and the
bytes the process really wrote to its sockets during a blocking call (:mod:`minipar.wire`).
The traffic model (what a rank puts on the wire) is:

=================  ==================  ========================================================
operation          payload S           bytes sent by this rank
=================  ==================  ========================================================
all_reduce         the tensor          2(N-1)/N · S          (ring: reduce-scatter + all-gather)
all_gather         the gathered whole  (N-1)/N · S           (ring)
reduce_scatter     the full input      (N-1)/N · S           (ring)
all_to_all         this rank's input   (N-1)/N · S           (direct: one chunk to each peer)
broadcast          the tensor          root (N-1) · S, others 0                         (direct)
scatter            all N chunks        root (N-1)/N · S, others 0                       (direct)
gather             all N chunks        non-root S/N, root 0                             (direct)
reduce             the tensor          non-root S, root 0                               (direct)
send / recv        the tensor          S / 0
=================  ==================  ========================================================

The hand-written :func:`ring_all_reduce`, :func:`ring_all_gather`, :func:`ring_reduce_scatter` and
:func:`root_all_reduce` (:mod:`minipar.rings`) use only ``send``/``recv`` (:mod:`minipar.calls`), so their
bytes are counted message by message as they are really sent; :func:`ring_algorithms` is the one switch that
runs the collectives on them. This module names them, and the log's ``recording``, ``CommLog`` and
``CommRecord`` (:mod:`minipar.comm_log`), as its own: a strategy imports ``comm`` alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .calls import call, irecv, isend, recv, send
from .flat import FlatLayout
from .invariant_mode import active as invariant_active
from .tree import tree_sum
from .comm_log import CommLog, CommRecord, recording
from .rings import (on_ring, ring_algorithms, ring_all_gather, ring_all_reduce, ring_exchange, ring_reduce_scatter,
                    ring_reduce_scatter_into, rings_selected, root_all_reduce)

__all__ = [
    "CommRecord", "CommLog", "recording", "predicted_bytes_sent",
    "broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
    "all_to_all_single",
    "send", "recv", "isend", "irecv", "all_reduce_flat",
    "ring_exchange", "ring_all_reduce", "ring_all_gather", "ring_reduce_scatter", "root_all_reduce",
    "ring_algorithms", "rings_selected",
]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases only have the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group) -> int:
    return dist.get_world_size(group)


def _is_root(root: int, group) -> bool:
    return dist.get_rank() == root if group is None else dist.get_rank(group) == dist.get_group_rank(group, root)


def predicted_bytes_sent(op: str, payload_bytes: int, n: int, is_root: bool = False) -> float:
    """Bytes one rank sends for ``op`` on a group of ``n`` ranks with payload S (the table above)."""
    s = payload_bytes
    if n == 1:
        return 0
    return {
        "all_reduce": 2 * (n - 1) / n * s,
        "all_gather": (n - 1) / n * s,
        "reduce_scatter": (n - 1) / n * s,
        "all_to_all": (n - 1) / n * s,
        "broadcast": (n - 1) * s if is_root else 0,
        "scatter": (n - 1) / n * s if is_root else 0,
        "gather": 0 if is_root else s / n,
        "reduce": 0 if is_root else s,
        "send": s,
        "recv": 0,
    }[op]


# ----------------------------------------------------------------------------------------------------
# Collectives (wrappers over torch.distributed); each one records what it moved
# ----------------------------------------------------------------------------------------------------

def _ring_shaped(op, run, s, group, async_op, result, tensor, n=None):
    """An all-reduce, all-gather or reduce-scatter through gloo, recorded with the ring's bytes both ways
    (:func:`predicted_bytes_sent`; N and the bytes worked out by the :class:`~minipar.calls.Call` when a hook
    first reads them)."""
    work = call(run, op, n, s, None, None, "ring", group=group, async_op=async_op, tensor=tensor)
    return work if async_op else result


def _all_gathered(t: torch.Tensor, group) -> torch.Tensor:
    """(ranks, *t.shape): every rank's ``t`` in rank order. The invariant mode's all-reduce is this all-gather
    and then :func:`minipar.tree.tree_sum` over the ranks, the same on every rank — a ring adds in an order that
    depends on the rank and the chunk; it sends (n−1)·|t| bytes per rank, a ring's n/2 times."""
    out = t.new_empty((_size(group) * t.numel(),))
    all_gather_into_tensor(out, t.contiguous().reshape(-1), group=group)
    return out.view((_size(group),) + tuple(t.shape))


class _Completed:
    """The work of a collective that already ran (the invariant mode's tree all-reduce blocks)."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self) -> bool:
        return True


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    if invariant_active() and op == dist.ReduceOp.SUM:   # the invariant mode: a fixed tree in rank order
        if _size(group) > 1:
            t.copy_(tree_sum(_all_gathered(t, group)).view_as(t))
        return _Completed() if async_op else t
    if on_ring("all_reduce", op, async_op):
        return ring_all_reduce(t, group)
    return _ring_shaped("all_reduce", lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op),
                        _nbytes(t), group, async_op, t, t)


def all_reduce_flat(tensors: list, op=dist.ReduceOp.SUM, group=None) -> list:
    """One all-reduce for many tensors: flatten them into one buffer, reduce it, copy the pieces back in
    place (one call pays the latency α once, as a DDP bucket does). Returns ``tensors``."""
    if not tensors:
        return tensors
    layout = FlatLayout([t.shape for t in tensors])
    flat = layout.flatten(tensors)
    all_reduce(flat, op=op, group=group)
    return layout.unflatten(flat, tensors)


def all_gather(out: list, t: torch.Tensor, group=None, async_op: bool = False):
    """``out[i]`` receives rank i's ``t``. Payload S = the gathered whole, N · |t|."""
    if on_ring("all_gather", async_op=async_op):
        return [o.copy_(g.view_as(o)) for o, g in zip(out, ring_all_gather(t.reshape(1, -1), group))]
    n = _size(group)
    return _ring_shaped("all_gather", lambda: dist.all_gather(out, t, group=group, async_op=async_op),
                        n * _nbytes(t), group, async_op, out, t, n)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
    """Like :func:`all_gather`, into one flat tensor (rank i's piece at ``out[i*len(t):(i+1)*len(t)]``)."""
    if on_ring("all_gather", async_op=async_op):     # the ring's concatenation, copied into ``out``
        return out.copy_(ring_all_gather(t.reshape(1, -1), group).view_as(out))
    return _ring_shaped("all_gather", lambda: _all_gather_flat(out, t, group=group, async_op=async_op),
                        _nbytes(out), group, async_op, out, t)


def reduce_scatter(out: torch.Tensor, inputs: list, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``out`` on rank i receives the reduction of every rank's ``inputs[i]``. Payload S = all inputs."""
    if on_ring("reduce_scatter", op, async_op):
        return ring_reduce_scatter_into(out, torch.stack([x.reshape(-1) for x in inputs]), group)
    return _ring_shaped("reduce_scatter", lambda: dist.reduce_scatter(out, inputs, op=op, group=group,
                                                                      async_op=async_op),
                        sum(_nbytes(x) for x in inputs), group, async_op, out, out)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Like :func:`reduce_scatter`, from one flat tensor split into N equal pieces."""
    if invariant_active() and op == dist.ReduceOp.SUM:   # the invariant mode: a fixed tree in rank order
        total = tree_sum(_all_gathered(t, group)).reshape(-1)
        out.copy_(total.chunk(_size(group))[dist.get_rank(group)].view_as(out))
        return _Completed() if async_op else out
    if on_ring("reduce_scatter", op, async_op):
        return ring_reduce_scatter_into(out, t, group)
    return _ring_shaped("reduce_scatter", lambda: _reduce_scatter_flat(out, t, op=op, group=group,
                                                                       async_op=async_op),
                        _nbytes(t), group, async_op, out, t)


def all_to_all(out: list, inputs: list, group=None):
    """Rank i sends ``inputs[j]`` to rank j and receives rank j's ``inputs[i]`` into ``out[j]``."""
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    sent = sum(_nbytes(x) for x in inputs) - _nbytes(inputs[me])
    recv = sum(_nbytes(x) for x in out) - _nbytes(out[me])
    call(lambda: dist.all_to_all(out, inputs, group=group), "all_to_all", _size(group),
         sum(_nbytes(x) for x in inputs), sent, recv, "direct", group=group, tensor=inputs[me])
    return out


def all_to_all_single(out: torch.Tensor, x: torch.Tensor, out_splits: list, in_splits: list, group=None):
    """Uneven all-to-all (alltoallv): rows ``in_splits[j]`` of ``x`` (dim 0, in rank order) go to rank j, rank j's
    rows for me land in ``out`` in rank order, ``out_splits[j]`` of them (gloo's list ``all_to_all`` wants equal
    chunks; this one does not). Payload S = this rank's input; sent = the rows for the other ranks."""
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    row = x.shape[1:].numel() * x.element_size()                  # bytes per row
    call(lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group), "all_to_all", _size(group),
         _nbytes(x), (sum(in_splits) - in_splits[me]) * row, (sum(out_splits) - out_splits[me]) * row, "direct",
         group=group, tensor=x)
    return out


def broadcast(t: torch.Tensor, src: int, group=None):
    n, s, root = _size(group), _nbytes(t), _is_root(src, group)
    call(lambda: dist.broadcast(t, src=src, group=group), "broadcast", n, s,
         predicted_bytes_sent("broadcast", s, n, root), 0 if root else s, "direct", group=group, tensor=t)
    return t


def scatter(out: torch.Tensor, chunks: list | None, src: int, group=None):
    n, root = _size(group), _is_root(src, group)
    s = n * _nbytes(out)
    call(lambda: dist.scatter(out, chunks if root else None, src=src, group=group), "scatter", n, s,
         predicted_bytes_sent("scatter", s, n, root), 0 if root else _nbytes(out), "direct", group=group,
         tensor=out)
    return out


def gather(t: torch.Tensor, out: list | None, dst: int, group=None):
    n, root = _size(group), _is_root(dst, group)
    s = n * _nbytes(t)
    call(lambda: dist.gather(t, out if root else None, dst=dst, group=group), "gather", n, s,
         predicted_bytes_sent("gather", s, n, root), (n - 1) * _nbytes(t) if root else 0, "direct", group=group,
         tensor=t)
    return out


def reduce(t: torch.Tensor, dst: int, op=dist.ReduceOp.SUM, group=None):
    n, s, root = _size(group), _nbytes(t), _is_root(dst, group)
    call(lambda: dist.reduce(t, dst=dst, op=op, group=group), "reduce", n, s,
         predicted_bytes_sent("reduce", s, n, root), (n - 1) * s if root else 0, "direct", group=group, tensor=t)
    return t
