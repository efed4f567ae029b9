"""The one path every :mod:`minipar.comm` call takes, and the point-to-point wrappers built on it.

:func:`call` runs a ``torch.distributed`` call inside the active hooks (:mod:`minipar.hooks`, outermost first)
and times it; it knows no instrument: the comm log, the wire counter, the tracer, the flight recorder and the
desync check are hooks, each told of the call as a :class:`Call`. With no hook active it only runs the call.

``send``, ``recv``, ``isend`` and ``irecv`` live here, below :mod:`minipar.rings` (which builds algorithms
from them) and :mod:`minipar.comm` (which names them as its own): a send's payload S is the tensor, S bytes
sent, 0 received; a receive the other way round.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import hooks
from .comm_log import CommRecord

__all__ = ["Call", "call", "RING_SHARE", "send", "recv", "isend", "irecv"]


def _group_ranks(group, peer) -> tuple:
    if peer is not None:
        return tuple(sorted({dist.get_rank(), peer}))
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


RING_SHARE = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}   # bytes each way: share · (N-1)/N · S


class Call:
    """One call, as the hooks see it: ``op``, ``group`` (None: the world) or ``peer`` (a send/recv's other
    rank) and ``tag``, the call's ``tensor`` (for its shape and dtype), ``async_op``, the traffic model
    (``group_size`` N, ``payload_bytes`` S, ``sent_bytes``, ``recv_bytes`` under ``algorithm``), and, once the
    call has run, ``seconds`` (its duration; an async call's: its launch) and :attr:`record`.

    A ring-shaped call (``algorithm="ring"``, op in :data:`RING_SHARE`) may leave ``group_size`` (None: asked
    of torch), ``sent_bytes`` and ``recv_bytes`` (None: the ring's share · (N-1)/N · S each way) to be worked
    out when first read: only the comm log, the tracer and the wire counter read them, and a rank's usual
    hook, the flight recorder, does not (asking torch for a group's size costs more than the record)."""

    __slots__ = ("op", "group", "peer", "tag", "tensor", "async_op", "_group_size", "payload_bytes", "_sent",
                 "_recv", "algorithm", "seconds", "_record", "_run")

    def __init__(self, op, group_size, payload, sent, recv, algorithm, *, group=None, peer=None, tag=0,
                 tensor=None, async_op=False, run=None):
        self.op, self.group, self.peer, self.tag, self.tensor, self.async_op = op, group, peer, tag, tensor, async_op
        self._group_size, self.payload_bytes, self._sent, self._recv = group_size, payload, sent, recv
        self.algorithm, self.seconds, self._record, self._run = algorithm, None, None, run

    @property
    def group_size(self) -> int:
        if self._group_size is None:
            self._group_size = dist.get_world_size(self.group)
        return self._group_size

    @property
    def sent_bytes(self):
        if self._sent is None:
            n = self.group_size
            self._sent = RING_SHARE[self.op] * (n - 1) / n * self.payload_bytes
        return self._sent

    @property
    def recv_bytes(self):
        return self.sent_bytes if self._recv is None else self._recv     # a ring receives what it sends

    def run_timed(self):
        """The innermost ``proceed``: run the call itself, its duration in :attr:`seconds`."""
        t0 = time.perf_counter()
        result = self._run()
        self.seconds = time.perf_counter() - t0
        return result

    @property
    def record(self) -> CommRecord:
        """The call's one :class:`~minipar.comm_log.CommRecord` (built when first asked for, after the call
        ran, and shared by every hook: each open log appends the same record)."""
        if self._record is None:
            if self.seconds is None:
                raise RuntimeError("a call's record exists once the call has run (ask after proceed())")
            self._record = CommRecord(self.op, self.group_size, int(self.payload_bytes), int(self.sent_bytes),
                                      int(self.recv_bytes), self.seconds, self.algorithm,
                                      ranks=_group_ranks(self.group, self.peer))
        return self._record


def call(run, op, n, payload, sent, recv, algorithm, *, group=None, peer=None, async_op=False, tensor=None, tag=0):
    """Run ``run`` (the ``torch.distributed`` call) inside every active hook's ``around_call``, the outermost
    first, and return what the outermost hands back: ``run``'s result, an async call's work possibly wrapped
    (timed to completion, its wait seen)."""
    active = hooks.active("around_call")
    if not active:
        return run()
    this = Call(op, n, payload, sent, recv, algorithm, group=group, peer=peer, tag=tag, tensor=tensor,
                async_op=async_op, run=run)
    if len(active) == 1:                            # a rank's usual case (its flight recorder): no closures
        return active[0].around_call(this, this.run_timed)
    proceed = this.run_timed
    for hook in reversed(active):                   # the innermost wraps the call itself
        proceed = _around(hook, this, proceed)
    return proceed()


def _around(hook, this: Call, inner):
    return lambda: hook.around_call(this, inner)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def send(t: torch.Tensor, dst: int, group=None, tag: int = 0):
    call(lambda: dist.send(t, dst=dst, group=group, tag=tag), "send", 2, _nbytes(t), _nbytes(t), 0, "direct",
         peer=dst, tensor=t, tag=tag)


def recv(t: torch.Tensor, src: int, group=None, tag: int = 0):
    call(lambda: dist.recv(t, src=src, group=group, tag=tag), "recv", 2, _nbytes(t), 0, _nbytes(t), "direct",
         peer=src, tensor=t, tag=tag)
    return t


def isend(t: torch.Tensor, dst: int, group=None, tag: int = 0):
    """``tag`` tells messages between the same two ranks apart (a pipeline's activations vs gradients)."""
    return call(lambda: dist.isend(t, dst=dst, group=group, tag=tag), "send", 2, _nbytes(t), _nbytes(t), 0,
                "direct", peer=dst, async_op=True, tensor=t, tag=tag)


def irecv(t: torch.Tensor, src: int, group=None, tag: int = 0):
    return call(lambda: dist.irecv(t, src=src, group=group, tag=tag), "recv", 2, _nbytes(t), 0, _nbytes(t),
                "direct", peer=src, async_op=True, tensor=t, tag=tag)
