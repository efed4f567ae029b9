"""The collectives a learner sees, as thin wrappers over ``torch.distributed`` that tell their observers.

Every call is told to the observers in :data:`observers` — while one is watching — as one
:class:`~minipar.observe.log.CommRecord`: the operation, the group size N, the payload S in bytes, and the
bytes this rank sends and receives under the algorithm named in the record, with the wall time and the
bytes the process really wrote to its sockets during a blocking call (:func:`minipar.observe.wire.written`).
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
:func:`root_all_reduce` use only ``send``/``recv``, so their bytes are counted message by message as they
are really sent; :func:`ring_algorithms` is the one switch that runs the collectives on them.

The observers: :mod:`minipar.observe.log`'s recorder first (``with comm.recording() as log:``; the log's
``recording``, ``CommLog``, ``CommRecord`` are named here too), then any :mod:`minipar.observe.tracer`. Each
has ``watching``, ``before_call()`` and ``on_record(record, work) -> work`` (it may wrap an async work).
"""
from __future__ import annotations

import contextlib
import contextvars
import time

import torch
import torch.distributed as dist

from . import flight
from .flat import FlatLayout
from .observe import wire
from .observe.log import RECORDER, CommLog, CommRecord, recording   # the log's names, for comm.recording() etc.

__all__ = [
    "CommRecord", "CommLog", "recording", "observers", "checks", "predicted_bytes_sent",
    "broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
    "send", "recv", "isend", "irecv", "all_reduce_flat",
    "ring_exchange", "ring_all_reduce", "ring_all_gather", "ring_reduce_scatter", "root_all_reduce",
    "ring_algorithms", "rings_selected",
]

observers: list = [RECORDER]   # told of every call: the open logs (observe.log), then tracers (observe.tracer)
checks: list = []   # run before every call: check(op, group, peer, tensor) may raise (minipar.debug.desync)


def _group_ranks(group, peer) -> tuple:
    if peer is not None:
        return tuple(sorted({dist.get_rank(), peer}))
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _call(run, op, n, payload, sent, recv, algorithm, *, group=None, peer=None, async_op=False, tensor=None, tag=0):
    """Run ``run`` (the ``torch.distributed`` call), telling the watching observers before it and of its record
    after it (group: ``group``, or the pair with ``peer``; a blocking call's wire bytes). Returns ``run``'s
    result — an async call's work as the observers hand it back (timed to completion, its wait seen).
    The rank's :mod:`minipar.flight` recorder, when started, writes the call (``tensor``'s shape and dtype,
    ``tag`` for a send/recv) as issued before ``run`` and completed after it (an async one: after its wait)."""
    for check in checks:
        check(op, group, peer, tensor)
    recorder = flight.recorder
    flight_seq = None if recorder is None else recorder.issued(op, group, peer, tag, tensor)
    watching = [o for o in observers if o.watching]
    before = wire.written() if watching else None
    for observer in watching:
        observer.before_call()
    t0 = time.perf_counter()
    work = run()
    seconds = time.perf_counter() - t0
    if flight_seq is not None:
        if not async_op:
            recorder.completed(flight_seq)
        elif not watching:
            return recorder.until_done(work, flight_seq)
    if not watching:
        return work
    observed = None if before is None or async_op else wire.written() - before
    rec = CommRecord(op, n, int(payload), int(sent), int(recv), seconds, algorithm, ranks=_group_ranks(group, peer),
                     observed_sent=observed)
    handle = work if async_op else None
    for observer in watching:
        handle = observer.on_record(rec, handle)
    if async_op and flight_seq is not None:
        handle = recorder.until_done(handle, flight_seq)
    return handle if async_op else work


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

def _ring_shaped(op, run, n, s, group, async_op, result, tensor):
    """An all-reduce, all-gather or reduce-scatter through gloo, recorded with the ring's bytes both ways."""
    moved = predicted_bytes_sent(op, s, n)
    work = _call(run, op, n, s, moved, moved, "ring", group=group, async_op=async_op, tensor=tensor)
    return work if async_op else result


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    if _on_ring("all_reduce", op, async_op):
        return ring_all_reduce(t, group)
    return _ring_shaped("all_reduce", lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op),
                        _size(group), _nbytes(t), group, async_op, t, t)


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
    if _on_ring("all_gather", async_op=async_op):
        return [o.copy_(g.view_as(o)) for o, g in zip(out, ring_all_gather(t.reshape(1, -1), group))]
    n = _size(group)
    return _ring_shaped("all_gather", lambda: dist.all_gather(out, t, group=group, async_op=async_op),
                        n, n * _nbytes(t), group, async_op, out, t)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
    """Like :func:`all_gather`, into one flat tensor (rank i's piece at ``out[i*len(t):(i+1)*len(t)]``)."""
    if _on_ring("all_gather", async_op=async_op):     # the ring's concatenation, copied into ``out``
        return out.copy_(ring_all_gather(t.reshape(1, -1), group).view_as(out))
    return _ring_shaped("all_gather", lambda: _all_gather_flat(out, t, group=group, async_op=async_op),
                        _size(group), _nbytes(out), group, async_op, out, t)


def reduce_scatter(out: torch.Tensor, inputs: list, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``out`` on rank i receives the reduction of every rank's ``inputs[i]``. Payload S = all inputs."""
    if _on_ring("reduce_scatter", op, async_op):
        return _ring_reduce_scatter_into(out, torch.stack([x.reshape(-1) for x in inputs]), group)
    return _ring_shaped("reduce_scatter", lambda: dist.reduce_scatter(out, inputs, op=op, group=group,
                                                                      async_op=async_op),
                        _size(group), sum(_nbytes(x) for x in inputs), group, async_op, out, out)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Like :func:`reduce_scatter`, from one flat tensor split into N equal pieces."""
    if _on_ring("reduce_scatter", op, async_op):
        return _ring_reduce_scatter_into(out, t, group)
    return _ring_shaped("reduce_scatter", lambda: _reduce_scatter_flat(out, t, op=op, group=group,
                                                                       async_op=async_op),
                        _size(group), _nbytes(t), group, async_op, out, t)


def all_to_all(out: list, inputs: list, group=None):
    """Rank i sends ``inputs[j]`` to rank j and receives rank j's ``inputs[i]`` into ``out[j]``."""
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    sent = sum(_nbytes(x) for x in inputs) - _nbytes(inputs[me])
    recv = sum(_nbytes(x) for x in out) - _nbytes(out[me])
    _call(lambda: dist.all_to_all(out, inputs, group=group), "all_to_all", _size(group),
          sum(_nbytes(x) for x in inputs), sent, recv, "direct", group=group, tensor=inputs[me])
    return out


def broadcast(t: torch.Tensor, src: int, group=None):
    n, s, root = _size(group), _nbytes(t), _is_root(src, group)
    _call(lambda: dist.broadcast(t, src=src, group=group), "broadcast", n, s,
          predicted_bytes_sent("broadcast", s, n, root), 0 if root else s, "direct", group=group, tensor=t)
    return t


def scatter(out: torch.Tensor, chunks: list | None, src: int, group=None):
    n, root = _size(group), _is_root(src, group)
    s = n * _nbytes(out)
    _call(lambda: dist.scatter(out, chunks if root else None, src=src, group=group), "scatter", n, s,
          predicted_bytes_sent("scatter", s, n, root), 0 if root else _nbytes(out), "direct", group=group,
          tensor=out)
    return out


def gather(t: torch.Tensor, out: list | None, dst: int, group=None):
    n, root = _size(group), _is_root(dst, group)
    s = n * _nbytes(t)
    _call(lambda: dist.gather(t, out if root else None, dst=dst, group=group), "gather", n, s,
          predicted_bytes_sent("gather", s, n, root), (n - 1) * _nbytes(t) if root else 0, "direct", group=group,
          tensor=t)
    return out


def reduce(t: torch.Tensor, dst: int, op=dist.ReduceOp.SUM, group=None):
    n, s, root = _size(group), _nbytes(t), _is_root(dst, group)
    _call(lambda: dist.reduce(t, dst=dst, op=op, group=group), "reduce", n, s,
          predicted_bytes_sent("reduce", s, n, root), (n - 1) * s if root else 0, "direct", group=group, tensor=t)
    return t


def send(t: torch.Tensor, dst: int, group=None, tag: int = 0):
    _call(lambda: dist.send(t, dst=dst, group=group, tag=tag), "send", 2, _nbytes(t), _nbytes(t), 0, "direct",
          peer=dst, tensor=t, tag=tag)


def recv(t: torch.Tensor, src: int, group=None, tag: int = 0):
    _call(lambda: dist.recv(t, src=src, group=group, tag=tag), "recv", 2, _nbytes(t), 0, _nbytes(t), "direct",
          peer=src, tensor=t, tag=tag)
    return t


def isend(t: torch.Tensor, dst: int, group=None, tag: int = 0):
    """``tag`` tells messages between the same two ranks apart (a pipeline's activations vs gradients)."""
    return _call(lambda: dist.isend(t, dst=dst, group=group, tag=tag), "send", 2, _nbytes(t), _nbytes(t), 0,
                 "direct", peer=dst, async_op=True, tensor=t, tag=tag)


def irecv(t: torch.Tensor, src: int, group=None, tag: int = 0):
    return _call(lambda: dist.irecv(t, src=src, group=group, tag=tag), "recv", 2, _nbytes(t), 0, _nbytes(t),
                 "direct", peer=src, async_op=True, tensor=t, tag=tag)


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


def _on_ring(op: str, reduce_op=dist.ReduceOp.SUM, async_op: bool = False) -> bool:
    """True when ``op`` runs on minipar's ring here: inside :func:`ring_algorithms`, a sum, blocking."""
    return op in _rings_on.get() and not async_op and reduce_op == dist.ReduceOp.SUM


def _ring_reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group) -> torch.Tensor:
    """``out`` = this rank's 1/N of Σ ``t`` (``t`` cut into N equal pieces along dim 0), on the ring."""
    if out.is_contiguous():
        ring_reduce_scatter(t.reshape(_size(group), -1), group, out=out)    # sums in place in ``out``
    else:
        out.copy_(ring_reduce_scatter(t.reshape(_size(group), -1), group).view_as(out))
    return out
