"""Collective algorithms built from send/recv only, and the one switch that runs the collectives on them.

:func:`ring_all_reduce`, :func:`ring_all_gather` and :func:`ring_reduce_scatter` (Patarasuk & Yuan 2009; the
"ring all-reduce" of Baidu/Horovod) and :func:`root_all_reduce` (a parameter server) use only
:func:`minipar.calls.send` / ``recv``, so their bytes are counted message by message as they are really
sent. :func:`ring_algorithms` makes :mod:`minipar.comm`'s all_reduce / all_gather / reduce_scatter run on
these rings; :mod:`minipar.comm` names everything here as its own (``comm.ring_all_reduce``, ...).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

from .calls import isend, recv, send
from .flat import FlatLayout

__all__ = ["ring_exchange", "ring_all_reduce", "ring_all_gather", "ring_reduce_scatter", "root_all_reduce",
           "ring_algorithms", "rings_selected", "on_ring", "ring_reduce_scatter_into"]


def _size(group) -> int:
    return dist.get_world_size(group)


# ----------------------------------------------------------------------------------------------------
# Ring algorithms from send/recv only (Patarasuk & Yuan 2009; the "ring all-reduce" of Baidu/Horovod)
# ----------------------------------------------------------------------------------------------------

def _ring_ranks(group):
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    return ranks, me


def ring_exchange(send_buf, recv_buf, to_rank, from_rank, group=None):
    """Send to the right neighbour and receive from the left one at the same time (no deadlock:
    every rank posts its send asynchronously before blocking on its receive)."""
    req = isend(send_buf.contiguous(), to_rank, group)
    recv(recv_buf, from_rank, group)
    req.wait()


def ring_reduce_scatter(t: torch.Tensor, group=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``t`` over the ring; return this rank's chunk ``i`` of the sum (t split into N chunks on dim 0).

    N-1 steps; in step k rank i sends its running sum of chunk (i-k-1) mod N to rank i+1 and adds what it
    receives from rank i-1 into chunk (i-k-2) mod N. Each rank sends (N-1) chunks: (N-1)/N · S bytes.
    After the last step rank i holds the complete sum of chunk i — in ``out`` if given (a contiguous
    tensor of the chunk's size, which then serves as chunk i's running sum: no extra copy).
    """
    ranks, me = _ring_ranks(group)
    n = len(ranks)
    chunks = [c.clone() for c in t.chunk(n)] if out is None else \
        [out.view(c.shape).copy_(c) if i == me else c.clone() for i, c in enumerate(t.chunk(n))]
    if len(chunks) != n:
        raise ValueError(f"ring_reduce_scatter needs at least {n} rows on dim 0, got {t.shape[0]}")
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for k in range(n - 1):
        send_idx, recv_idx = (me - k - 1) % n, (me - k - 2) % n
        incoming = torch.empty_like(chunks[recv_idx])
        ring_exchange(chunks[send_idx], incoming, right, left, group)
        chunks[recv_idx] += incoming
    return chunks[me]


def ring_all_gather(chunk: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank contributes ``chunk``; return the concatenation over ranks in rank order (dim 0).

    N-1 steps; in step k rank i forwards chunk (i-k) mod N to rank i+1. (N-1)/N · S bytes sent per rank.
    """
    ranks, me = _ring_ranks(group)
    n = len(ranks)
    chunks = [None] * n
    chunks[me] = chunk.clone()
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for k in range(n - 1):
        send_idx, recv_idx = (me - k) % n, (me - k - 1) % n
        chunks[recv_idx] = torch.empty_like(chunk)
        ring_exchange(chunks[send_idx], chunks[recv_idx], right, left, group)
    return torch.cat(chunks)


def ring_all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) = ring reduce-scatter then ring all-gather: 2(N-1)/N · S bytes sent per rank,
    independent of N. Works in place on ``t`` (flattened; any shape, padded to a multiple of N)."""
    n = _size(group)
    layout = FlatLayout([t.shape], n)
    mine = ring_reduce_scatter(layout.flatten([t]).view(n, -1), group)
    return layout.unflatten(ring_all_gather(mine, group).reshape(-1), [t])[0]


def root_all_reduce(t: torch.Tensor, root: int = 0) -> torch.Tensor:
    """All-reduce through one root, from send/recv (a parameter server; DataParallel's "gather to
    device 0"): every other rank sends ``t`` to the root, the root sums and sends the sum to each of them.
    The root sends (N-1) · S bytes and receives (N-1) · S; every other rank sends S."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank != root:
        send(t, dst=root)
        return recv(t, src=root)
    incoming = torch.empty_like(t)
    for peer in (r for r in range(n) if r != root):
        t += recv(incoming, src=peer)
    for peer in (r for r in range(n) if r != root):
        send(t, dst=peer)
    return t


# ----------------------------------------------------------------------------------------------------
# The one switch: gloo's collectives or minipar's rings
# ----------------------------------------------------------------------------------------------------

_RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")
_rings_on: contextvars.ContextVar = contextvars.ContextVar("minipar_ring_algorithms", default=frozenset())


@contextlib.contextmanager
def ring_algorithms(*ops: str, enabled: bool = True):
    """Inside this block, :func:`all_reduce`, :func:`all_gather` / :func:`all_gather_into_tensor` and
    :func:`reduce_scatter` / :func:`reduce_scatter_tensor` run minipar's rings (:func:`ring_all_reduce`,
    :func:`ring_all_gather`, :func:`ring_reduce_scatter`) instead of gloo's own algorithms, so the wire
    carries the textbook bytes (gloo's reduce-scatter all-reduces: 2x). The log then holds the rings'
    send/recv messages. ``ops`` picks some of ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``;
    none means all three. Sums only, and blocking only: another ``op`` or ``async_op=True`` stays on gloo.
    The choice is scoped (a ``ContextVar``): it ends with the block, and nested blocks replace it;
    ``enabled=False`` changes nothing (the one switch, for a caller that takes a flag).

        with comm.ring_algorithms("reduce_scatter"):
            loss.backward()           # every reduce-scatter in here on the send/recv ring
    """
    unknown = [op for op in ops if op not in _RING_OPS]
    if unknown:
        raise ValueError(f"ring_algorithms knows {_RING_OPS}, got {unknown}")
    if not enabled:
        yield
        return
    token = _rings_on.set(frozenset(ops or _RING_OPS))
    try:
        yield
    finally:
        _rings_on.reset(token)


def rings_selected(op: str) -> bool:
    """True inside ``ring_algorithms(...)`` naming ``op`` (or all): for a caller that must know whether an
    async call would block on the rings (the flat units' prefetch gathers at once there), not take a flag."""
    return op in _rings_on.get()


def on_ring(op: str, reduce_op=dist.ReduceOp.SUM, async_op: bool = False) -> bool:
    """True when ``op`` runs on minipar's ring here: inside :func:`ring_algorithms`, a sum, blocking."""
    return op in _rings_on.get() and not async_op and reduce_op == dist.ReduceOp.SUM


def ring_reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group) -> torch.Tensor:
    """``out`` = this rank's 1/N of Σ ``t`` (``t`` cut into N equal pieces along dim 0), on the ring."""
    if out.is_contiguous():
        ring_reduce_scatter(t.reshape(_size(group), -1), group, out=out)    # sums in place in ``out``
    else:
        out.copy_(ring_reduce_scatter(t.reshape(_size(group), -1), group).view_as(out))
    return out
