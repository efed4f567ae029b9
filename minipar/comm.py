"""The collectives a learner sees, as thin wrappers over ``torch.distributed`` that keep a log.

Every call records, on the calling rank, one :class:`CommRecord`: the operation, the group size N, the
payload S in bytes, and the bytes this rank sends and receives under the algorithm named in the record,
with the wall time. The traffic model (what a rank puts on the wire) is:

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
:func:`root_all_reduce` use only ``send``/``recv``, so their bytes are counted message by message as they are really sent.

Logs are scoped: ``with recording() as log:`` collects the calls made inside the block on this rank. The
block is also watched by :mod:`minipar.observe.wire`: ``log.observed_bytes_sent`` is what this process really
wrote to its sockets meanwhile (the transport's truth, beside the model above — and it sees collectives
called around this module, straight through ``torch.distributed``, which the records cannot).

Every record names its group: ``ranks`` (global; a send or recv: the pair) and, when the log records with a
mesh (``recording(mesh=rank_mesh)``), ``dims``, the mesh dimensions those ranks span. Bytes per dimension
are then a group-by over the log, whatever the strategy: ``log.bytes_by_dims()`` →
``{("tp",): .., ("pp",): .., ("dp",): ..}``; ``log.select(op="all_to_all", dims=("ep",))`` is a sub-log.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CommRecord", "CommLog", "recording", "predicted_bytes_sent",
    "broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all",
    "send", "recv", "isend", "irecv", "all_reduce_flat",
    "ring_exchange", "ring_all_reduce", "ring_all_gather", "ring_reduce_scatter", "root_all_reduce",
    "ring_algorithms", "rings_selected",
]


@dataclass
class CommRecord:
    """One call. ``seconds``: a blocking call's duration; an async one's (``async_op=True``, ``isend``,
    ``irecv``) from its launch to its completion, filled in when the work completes — until then it holds
    the launch (enqueue) time only and ``pending`` is True. Completion is seen by the work's future for
    collectives; for gloo's send/recv, which have none, by the first ``wait()`` or ``is_completed()`` that
    finds it done (so at most that late).

    ``ranks``: the global ranks of the group the call used (a send or recv: the pair {me, peer}); ``dims``:
    the mesh dimensions they span (:meth:`minipar.mesh.Mesh.dims_spanned`), when the log recording it was
    given a mesh, else None. ``observed_sent``: bytes this process wrote to its sockets while a blocking call
    ran (:mod:`minipar.observe.wire`; None for async calls, whose bytes leave after they return)."""
    op: str
    group_size: int
    payload_bytes: int
    sent_bytes: int
    recv_bytes: int
    seconds: float
    algorithm: str
    pending: bool = False
    ranks: tuple = ()
    dims: tuple | None = None
    observed_sent: int | None = None


@dataclass(eq=False)   # logs are told apart by identity (nested recordings may hold equal records)
class CommLog:
    """The calls one rank made while this log was recording. ``mesh`` (a Mesh or RankMesh, optional) names
    the dimensions each record's group spans."""
    records: list = field(default_factory=list)
    observed_bytes_sent: int | None = None   # wire.observing() over the recording block(s); None: unknown
    mesh: object = None

    def reset(self) -> None:
        self.records.clear()
        self.observed_bytes_sent = None

    @property
    def bytes_sent(self) -> int:
        return sum(r.sent_bytes for r in self.records)

    @property
    def bytes_received(self) -> int:
        return sum(r.recv_bytes for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def count(self, op: str | None = None) -> int:
        return sum(1 for r in self.records if op is None or r.op == op)

    def by_op(self) -> dict:
        """{op: (calls, bytes sent)}, for a quick table."""
        table: dict = {}
        for r in self.records:
            calls, sent = table.get(r.op, (0, 0))
            table[r.op] = (calls + 1, sent + r.sent_bytes)
        return table

    def dims_of(self, record: CommRecord, mesh=None) -> tuple:
        """The mesh dims ``record``'s group spans: from ``mesh`` if given, else as recorded."""
        mesh = getattr(mesh, "mesh", mesh)
        if mesh is not None:
            return mesh.dims_spanned(record.ranks)
        if record.dims is None:
            raise ValueError("this record was made without a mesh: record with comm.recording(mesh=...) or "
                             "pass mesh= here")
        return record.dims

    def bytes_by_dims(self, mesh=None) -> dict:
        """{dims spanned: bytes sent}, a group-by over the records: ``{("tp",): .., ("pp",): .., ("dp",): ..}``
        for a 3D step; ``()`` holds calls within one rank (a group of one)."""
        table: dict = {}
        for r in self.records:
            key = self.dims_of(r, mesh)
            table[key] = table.get(key, 0) + r.sent_bytes
        return table

    def select(self, op: str | None = None, dims=None, mesh=None) -> "CommLog":
        """A log of the records of ``op`` (if given) over exactly ``dims`` (if given, a tuple in mesh order);
        its ``observed_bytes_sent`` is the sum of their ``observed_sent`` (None if any is unknown)."""
        records = [r for r in self.records if (op is None or r.op == op)
                   and (dims is None or self.dims_of(r, mesh) == tuple(dims))]
        seen = [r.observed_sent for r in records]
        return CommLog(records, None if None in seen else sum(seen), mesh if mesh is not None else self.mesh)


_active: list[CommLog] = []  # the logs recording on this process (innermost last)
_tracers: list = []          # minipar.observe.trace tracers: told before each call (_timed) and of each record (_record)


@contextlib.contextmanager
def recording(log: CommLog | None = None, mesh=None):
    """Record every minipar.comm call on this rank inside the block into ``log`` (a new one by default).
    With ``mesh`` (a :class:`minipar.mesh.Mesh` or ``RankMesh``) each record also names the dims it spans."""
    from .observe import wire
    log = log if log is not None else CommLog()
    if mesh is not None:
        log.mesh = getattr(mesh, "mesh", mesh)
    _active.append(log)
    try:
        with wire.observing() as seen:
            yield log
    finally:
        _active.remove(log)
        if seen.bytes_sent is not None:
            log.observed_bytes_sent = (log.observed_bytes_sent or 0) + seen.bytes_sent


def _group_ranks(group, peer) -> tuple:
    if peer is not None:
        return tuple(sorted({dist.get_rank(), peer}))
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _record(op, n, payload, sent, recv, seconds, algorithm, work=None, group=None, peer=None):
    """Log one call (its group: ``group``, or the pair with ``peer`` for a send/recv); for an async call
    (``work`` given) return the work, timed to its completion."""
    if not _active:
        return work
    ranks = _group_ranks(group, peer)
    meshes = [log.mesh for log in _active if log.mesh is not None]
    dims = meshes[-1].dims_spanned(ranks) if meshes else None
    observed = _last_observed if work is None else None
    rec = CommRecord(op, n, int(payload), int(sent), int(recv), seconds, algorithm, ranks=ranks, dims=dims,
                     observed_sent=observed)
    for log in _active:
        log.records.append(rec)
    work = work if work is None else _until_done(rec, work, time.perf_counter() - seconds)
    for tracer in _tracers:
        work = tracer.on_record(rec, work)
    return work


class _TimedWork:
    """A work handle that sets its record's ``seconds`` to launch → completion when it sees completion
    (send/recv works of gloo have no future to call back). Everything else is the work's own."""

    def __init__(self, work, done):
        self._work, self._done = work, done

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._done()
        return out

    def is_completed(self) -> bool:
        finished = self._work.is_completed()
        if finished:
            self._done()
        return finished

    def __getattr__(self, name):
        return getattr(self._work, name)


def _until_done(rec: CommRecord, work, t0: float):
    rec.pending = True

    def done(*_):
        if rec.pending:
            rec.seconds, rec.pending = time.perf_counter() - t0, False
    try:
        work.get_future().add_done_callback(done)
        return work
    except RuntimeError:                       # "Work::getFuture not implemented" (gloo send / recv)
        return _TimedWork(work, done)


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


_last_observed: int | None = None   # wire bytes of the last _timed call (while recording), for its record
_io_fds: dict = {}                  # pid -> open /proc/<pid>/io (per process: forked ranks open their own)


def _wchar() -> int | None:
    """Bytes this process has written (``wchar``, as :mod:`minipar.observe.wire` reads it), with one ``pread`` of a
    kept-open file (~7 µs, against ~40 µs to open and parse it each call); None off Linux."""
    pid = os.getpid()
    if pid not in _io_fds:
        try:
            _io_fds[pid] = os.open(f"/proc/{pid}/io", os.O_RDONLY)
        except OSError:
            _io_fds[pid] = None
    if _io_fds[pid] is None:
        return None
    data = os.pread(_io_fds[pid], 1024, 0)
    start = data.index(b"wchar:") + 6
    return int(data[start: data.index(b"\n", start)])


def _timed(fn):
    global _last_observed
    before = _wchar() if _active else None
    for tracer in _tracers:
        tracer.before_call()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    _last_observed = None if before is None else _wchar() - before
    return out, seconds


# ----------------------------------------------------------------------------------------------------
# Collectives (wrappers over torch.distributed); each one records what it moved
# ----------------------------------------------------------------------------------------------------

def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    if _on_ring("all_reduce", op, async_op):
        return ring_all_reduce(t, group)
    n, s = _size(group), _nbytes(t)
    work, sec = _timed(lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op))
    moved = predicted_bytes_sent("all_reduce", s, n)
    work = _record("all_reduce", n, s, moved, moved, sec, "ring", work if async_op else None, group)
    return work if async_op else t


def all_reduce_flat(tensors: list, op=dist.ReduceOp.SUM, group=None) -> list:
    """One all-reduce for many tensors: flatten them into one buffer, reduce it, copy the pieces back in
    place (one call pays the latency α once, as a DDP bucket does). Returns ``tensors``."""
    if not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, op=op, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
    return tensors


def all_gather(out: list, t: torch.Tensor, group=None, async_op: bool = False):
    """``out[i]`` receives rank i's ``t``. Payload S = the gathered whole, N · |t|."""
    if _on_ring("all_gather", async_op=async_op):
        return [o.copy_(g.view_as(o)) for o, g in zip(out, ring_all_gather(t.reshape(1, -1), group))]
    n = _size(group)
    s = n * _nbytes(t)
    work, sec = _timed(lambda: dist.all_gather(out, t, group=group, async_op=async_op))
    moved = predicted_bytes_sent("all_gather", s, n)
    work = _record("all_gather", n, s, moved, moved, sec, "ring", work if async_op else None, group)
    return work if async_op else out


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
    """Like :func:`all_gather`, into one flat tensor (rank i's piece at ``out[i*len(t):(i+1)*len(t)]``)."""
    if _on_ring("all_gather", async_op=async_op):
        return _ring_all_gather_into(out, t, group)
    n, s = _size(group), _nbytes(out)
    work, sec = _timed(lambda: _all_gather_flat(out, t, group=group, async_op=async_op))
    moved = predicted_bytes_sent("all_gather", s, n)
    work = _record("all_gather", n, s, moved, moved, sec, "ring", work if async_op else None, group)
    return work if async_op else out


def reduce_scatter(out: torch.Tensor, inputs: list, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``out`` on rank i receives the reduction of every rank's ``inputs[i]``. Payload S = all inputs."""
    if _on_ring("reduce_scatter", op, async_op):
        return _ring_reduce_scatter_into(out, torch.stack([x.reshape(-1) for x in inputs]), group)
    n = _size(group)
    s = sum(_nbytes(x) for x in inputs)
    work, sec = _timed(lambda: dist.reduce_scatter(out, inputs, op=op, group=group, async_op=async_op))
    moved = predicted_bytes_sent("reduce_scatter", s, n)
    work = _record("reduce_scatter", n, s, moved, moved, sec, "ring", work if async_op else None, group)
    return work if async_op else out


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Like :func:`reduce_scatter`, from one flat tensor split into N equal pieces."""
    if _on_ring("reduce_scatter", op, async_op):
        return _ring_reduce_scatter_into(out, t, group)
    n, s = _size(group), _nbytes(t)
    work, sec = _timed(lambda: _reduce_scatter_flat(out, t, op=op, group=group, async_op=async_op))
    moved = predicted_bytes_sent("reduce_scatter", s, n)
    work = _record("reduce_scatter", n, s, moved, moved, sec, "ring", work if async_op else None, group)
    return work if async_op else out


def all_to_all(out: list, inputs: list, group=None):
    """Rank i sends ``inputs[j]`` to rank j and receives rank j's ``inputs[i]`` into ``out[j]``."""
    n = _size(group)
    s = sum(_nbytes(x) for x in inputs)
    _, sec = _timed(lambda: dist.all_to_all(out, inputs, group=group))
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    sent = s - _nbytes(inputs[me])
    recv = sum(_nbytes(x) for x in out) - _nbytes(out[me])
    _record("all_to_all", n, s, sent, recv, sec, "direct", group=group)
    return out


def broadcast(t: torch.Tensor, src: int, group=None):
    n, s = _size(group), _nbytes(t)
    _, sec = _timed(lambda: dist.broadcast(t, src=src, group=group))
    root = _is_root(src, group)
    _record("broadcast", n, s, predicted_bytes_sent("broadcast", s, n, root), 0 if root else s, sec, "direct",
            group=group)
    return t


def scatter(out: torch.Tensor, chunks: list | None, src: int, group=None):
    n = _size(group)
    s = n * _nbytes(out)
    root = _is_root(src, group)
    _, sec = _timed(lambda: dist.scatter(out, chunks if root else None, src=src, group=group))
    _record("scatter", n, s, predicted_bytes_sent("scatter", s, n, root), 0 if root else _nbytes(out), sec,
            "direct", group=group)
    return out


def gather(t: torch.Tensor, out: list | None, dst: int, group=None):
    n = _size(group)
    s = n * _nbytes(t)
    root = _is_root(dst, group)
    _, sec = _timed(lambda: dist.gather(t, out if root else None, dst=dst, group=group))
    _record("gather", n, s, predicted_bytes_sent("gather", s, n, root), (n - 1) * _nbytes(t) if root else 0,
            sec, "direct", group=group)
    return out


def reduce(t: torch.Tensor, dst: int, op=dist.ReduceOp.SUM, group=None):
    n, s = _size(group), _nbytes(t)
    root = _is_root(dst, group)
    _, sec = _timed(lambda: dist.reduce(t, dst=dst, op=op, group=group))
    _record("reduce", n, s, predicted_bytes_sent("reduce", s, n, root), (n - 1) * s if root else 0, sec, "direct",
            group=group)
    return t


def send(t: torch.Tensor, dst: int, group=None, tag: int = 0):
    _, sec = _timed(lambda: dist.send(t, dst=dst, group=group, tag=tag))
    _record("send", 2, _nbytes(t), _nbytes(t), 0, sec, "direct", peer=dst)


def recv(t: torch.Tensor, src: int, group=None, tag: int = 0):
    _, sec = _timed(lambda: dist.recv(t, src=src, group=group, tag=tag))
    _record("recv", 2, _nbytes(t), 0, _nbytes(t), sec, "direct", peer=src)
    return t


def isend(t: torch.Tensor, dst: int, group=None, tag: int = 0):
    """``tag`` tells messages between the same two ranks apart (a pipeline's activations vs gradients)."""
    work, sec = _timed(lambda: dist.isend(t, dst=dst, group=group, tag=tag))
    return _record("send", 2, _nbytes(t), _nbytes(t), 0, sec, "direct", work, peer=dst)


def irecv(t: torch.Tensor, src: int, group=None, tag: int = 0):
    work, sec = _timed(lambda: dist.irecv(t, src=src, group=group, tag=tag))
    return _record("recv", 2, _nbytes(t), 0, _nbytes(t), sec, "direct", work, peer=src)


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
    flat = t.reshape(-1)
    pad = (-flat.numel()) % n
    padded = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    mine = ring_reduce_scatter(padded.view(n, -1), group)
    total = ring_all_gather(mine, group).reshape(-1)
    t.copy_(total[: flat.numel()].view_as(t))
    return t


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
def ring_algorithms(*ops: str):
    """Inside this block, :func:`all_reduce`, :func:`all_gather` / :func:`all_gather_into_tensor` and
    :func:`reduce_scatter` / :func:`reduce_scatter_tensor` run minipar's rings (:func:`ring_all_reduce`,
    :func:`ring_all_gather`, :func:`ring_reduce_scatter`) instead of gloo's own algorithms, so the wire
    carries the textbook bytes (gloo's reduce-scatter all-reduces: 2x). The log then holds the rings'
    send/recv messages. ``ops`` picks some of ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``;
    none means all three. Sums only, and blocking only: another ``op`` or ``async_op=True`` stays on gloo.
    The choice is scoped (a ``ContextVar``): it ends with the block, and nested blocks replace it.

        with comm.ring_algorithms("reduce_scatter"):
            loss.backward()           # every reduce-scatter in here on the send/recv ring
    """
    unknown = [op for op in ops if op not in _RING_OPS]
    if unknown:
        raise ValueError(f"ring_algorithms knows {_RING_OPS}, got {unknown}")
    token = _rings_on.set(frozenset(ops or _RING_OPS))
    try:
        yield
    finally:
        _rings_on.reset(token)


def rings_selected(op: str) -> bool:
    """True inside ``ring_algorithms(...)`` naming ``op`` (or all): a strategy that drives the rings itself
    (ZeRO's flat units, to keep their own buffers) asks this instead of taking a flag."""
    return op in _rings_on.get()


def _on_ring(op: str, reduce_op=dist.ReduceOp.SUM, async_op: bool = False) -> bool:
    """True when ``op`` runs on minipar's ring here: inside :func:`ring_algorithms`, a sum, blocking."""
    return op in _rings_on.get() and not async_op and reduce_op == dist.ReduceOp.SUM


def _ring_all_gather_into(out: torch.Tensor, t: torch.Tensor, group) -> torch.Tensor:
    """``out`` (flat concatenation along dim 0) from :func:`ring_all_gather` of every rank's ``t``."""
    out.copy_(ring_all_gather(t.reshape(1, -1), group).view_as(out))
    return out


def _ring_reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group) -> torch.Tensor:
    """``out`` = this rank's 1/N of Σ ``t`` (``t`` cut into N equal pieces along dim 0), on the ring."""
    if out.is_contiguous():
        ring_reduce_scatter(t.reshape(_size(group), -1), group, out=out)    # sums in place in ``out``
    else:
        out.copy_(ring_reduce_scatter(t.reshape(_size(group), -1), group).view_as(out))
    return out
