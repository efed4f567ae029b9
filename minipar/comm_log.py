"""The communication log: one :class:`CommRecord` per :mod:`minipar.comm` call, collected by ``recording()``.

A record holds the operation, the group size N, the payload S in bytes, the bytes this rank sends and
receives under the algorithm named in the record (:func:`minipar.comm.predicted_bytes_sent`'s table; the
rings' send/recv message by message), the wall time, and the bytes the process really wrote to its
sockets meanwhile (:mod:`minipar.wire`).

Logs are scoped: ``with recording() as log:`` collects the calls made inside the block on this rank. The
block is also watched by :mod:`minipar.wire`: ``log.observed_bytes_sent`` is what this process really
wrote to its sockets meanwhile (the transport's truth, beside the model — and it sees collectives called
around :mod:`minipar.comm`, straight through ``torch.distributed``, which the records cannot).

Every record names its group: ``ranks`` (global; a send or recv: the pair) and, when the log records with a
mesh (``recording(mesh=rank_mesh)``), ``dims``, the mesh dimensions those ranks span. Bytes per dimension
are then a group-by over the log, whatever the strategy: ``log.bytes_by_dims()`` →
``{("tp",): .., ("pp",): .., ("dp",): ..}``; ``log.select(op="all_to_all", dims=("ep",))`` is a sub-log.

How records reach the logs: a ``recording()`` block installs its log as a hook (:mod:`minipar.hooks`), with a
:class:`minipar.wire.CallCounter` inside it; :mod:`minipar.comm` tells every active hook of every call and
knows no log. Each call has one record (:attr:`minipar.calls.Call.record`), which every open log appends. This
module sits on the ground floor beside :mod:`minipar.comm` (which names ``recording``, ``CommLog`` and
``CommRecord`` as its own) and imports only the hook interface and the wire counter.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from . import hooks, wire

__all__ = ["CommRecord", "CommLog", "recording"]


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
    ran (:mod:`minipar.wire`; None for async calls, whose bytes leave after they return)."""
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


# Point-to-point messages one rank sends per call, by op: a ring step is one message to the next rank.
_RING_MESSAGES = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}   # × (N − 1)


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

    def messages(self) -> int:
        """Point-to-point messages this rank sent under each record's algorithm: a ring all-reduce 2(N−1), a
        ring all-gather or reduce-scatter N−1, a direct all-to-all N−1 (one to each peer), a broadcast's root
        N−1, a send 1; a receive and the other direct calls none."""
        return sum(_RING_MESSAGES[r.op] * (r.group_size - 1) if r.op in _RING_MESSAGES else
                   (r.group_size - 1 if r.op == "broadcast" and r.sent_bytes else int(r.op == "send"))
                   for r in self.records)

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


class _Logging:
    """One open log as a hook: each call's record appended, its dims named by the innermost log given a mesh
    (the innermost hook sees the record first); an async call's work comes back timed to its completion."""

    def __init__(self, log: CommLog):
        self.log = log

    def around_call(self, call, proceed):
        result = proceed()
        rec = call.record
        if rec.dims is None and self.log.mesh is not None:
            rec.dims = self.log.mesh.dims_spanned(rec.ranks)
        self.log.records.append(rec)
        return _until_done(rec, result, time.perf_counter() - rec.seconds) if call.async_op else result


@contextlib.contextmanager
def recording(log: CommLog | None = None, mesh=None):
    """Record every minipar.comm call on this rank inside the block into ``log`` (a new one by default).
    With ``mesh`` (a :class:`minipar.mesh.Mesh` or ``RankMesh``) each record also names the dims it spans."""
    log = log if log is not None else CommLog()
    if mesh is not None:
        log.mesh = getattr(mesh, "mesh", mesh)
    seen = wire.Observed()
    try:
        with wire.observing() as seen, wire.counting_calls() as counter, hooks.installed(_Logging(log), counter):
            yield log
    finally:
        if seen.bytes_sent is not None:
            log.observed_bytes_sent = (log.observed_bytes_sent or 0) + seen.bytes_sent


def _until_done(rec: CommRecord, work, t0: float):
    """``work``, setting ``rec.seconds`` to launch -> completion when the call completes (once, however many
    logs hold the record: an inner log's wrapping already times it)."""
    if rec.pending:
        return work
    rec.pending = True

    def done(*_):
        if rec.pending:
            rec.seconds, rec.pending = time.perf_counter() - t0, False
    try:
        work.get_future().add_done_callback(done)
        return work
    except RuntimeError:                       # "Work::getFuture not implemented" (gloo send / recv)
        return hooks.WorkDone(work, done)
