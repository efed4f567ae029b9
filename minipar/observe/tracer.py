"""The tracer: record a :mod:`minipar.machine.trace` of this rank while the program runs, no strategy changed.

``with tracing() as rank_trace:`` installs a tracer as a hook (:mod:`minipar.hooks`): before each call it
closes the compute segment that ran since the last one (thread CPU seconds, wall seconds, the CPU seconds of
the rank's other threads, FLOPs if counted), and for each record it appends the :class:`~.trace.Comm` (an
async call's work is wrapped so that its ``wait()`` becomes a :class:`~.trace.Wait`). :func:`mark` labels a
point (a step's end); :func:`position` says where the trace is now. :class:`Traced` is a rank's function run
under :func:`tracing` — what :func:`minipar.observe.launch_trace.traced_launch` hands the launcher.
"""
from __future__ import annotations

import contextlib
import time

import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from minipar import hooks

from .opcount import OperatorCounter
from minipar.machine.trace import Comm, Compute, Mark, RankTrace, Wait

__all__ = ["tracing", "mark", "position", "Traced"]


class _Tracer:
    """A hook on :mod:`minipar.comm`'s calls (installed while its :func:`tracing` block runs): before each call
    it closes the compute segment, after it appends the call."""

    def __init__(self, rank: int, counter=None):
        self.trace, self._counter, self._flops = RankTrace(rank), counter, 0
        self._mark()

    def _mark(self) -> None:
        self._cpu, self._wall, self._process = time.thread_time(), time.perf_counter(), time.process_time()

    def before_call(self) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        flops = ops = None
        if isinstance(self._counter, OperatorCounter):     # the operators run since the segment began
            flops = float(self._counter.total_flops())
            ops = self._counter.take()
        elif self._counter is not None:                     # FLOPs counted since the segment began
            total = self._counter.get_total_flops()
            flops, self._flops = float(total - self._flops), total
        others = max(0.0, time.process_time() - self._process - (cpu - self._cpu))
        self.trace.events.append(Compute(cpu - self._cpu, wall - self._wall, flops, seconds_other_threads=others,
                                         ops=ops))
        self._wall = wall

    def around_call(self, call, proceed):
        """The hook: close the compute segment, run the call, append it (an async work handed back watched)."""
        self.before_call()
        result = proceed()
        work = self.on_record(call.record, result if call.async_op else None)
        return work if call.async_op else result

    def on_record(self, rec, work):
        """Append the call; wrap an async work so its ``wait()`` is seen. Returns the work to hand back."""
        events = self.trace.events
        events.append(Comm(rec.op, rec.ranks, rec.payload_bytes, work is not None, None,
                           time.perf_counter() - self._wall))
        index = len(events) - 1
        self._mark()
        return work if work is None else _WaitSeen(work, self, index)

    def waited(self, index: int) -> None:
        self.trace.events.append(Wait(index))
        self.trace.events[index].waited_at = len(self.trace.events) - 1
        self._mark()

    def mark(self, label: str) -> None:
        self.before_call()
        self.trace.events.append(Mark(label))
        self._mark()

    def finish(self) -> RankTrace:
        self.before_call()                   # the work after the last call
        return self.trace


class _WaitSeen:
    """An async work whose first ``wait()`` adds a :class:`Wait` event; everything else is the work's."""

    def __init__(self, work, tracer: _Tracer, index: int):
        self._work, self._tracer, self._index, self._seen = work, tracer, index, False

    def wait(self, *args, **kwargs):
        if self._seen:
            return self._work.wait(*args, **kwargs)
        self._tracer.before_call()
        out = self._work.wait(*args, **kwargs)
        self._seen = True
        self._tracer.waited(self._index)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def tracing(rank: int | None = None, flops: bool = False, ops: bool = False):
    """Trace this rank's communication calls and the compute between them inside the block; yields the
    :class:`~.trace.RankTrace`, complete when the block ends. ``flops=True``: each segment's matmul FLOPs
    too (``torch.utils.flop_counter.FlopCounterMode``); ``ops=True``: each segment's operators, and their
    FLOPs (:class:`~.opcount.OperatorCounter`). Either slows every op: time such a run for what it counts,
    not its seconds."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    counter = OperatorCounter() if ops else FlopCounterMode(display=False) if flops else None
    tracer = _Tracer(rank, counter)
    try:
        with hooks.installed(tracer), counter if counter is not None else contextlib.nullcontext():
            yield tracer.trace
    finally:
        tracer.finish()


def _tracers() -> list:
    return [h for h in hooks.active() if isinstance(h, _Tracer)]


def mark(label: str) -> None:
    """Put a :class:`~.trace.Mark` into every trace recording on this rank (nothing when none is)."""
    for tracer in _tracers():
        tracer.mark(label)


def position():
    """Where this rank is in its innermost trace: (the index its open compute segment will take, the thread
    CPU seconds that segment has run so far) — to place an observation (live memory, say) on a replay's time
    axis; None when no trace is recording."""
    tracers = _tracers()
    if not tracers:
        return None
    return len(tracers[-1].trace.events), time.thread_time() - tracers[-1]._cpu


class Traced:
    """``fn`` (a ``parallel_train``) run under :func:`tracing`: returns ``(fn's result, RankTrace)``.
    A class, not a closure, so that the launcher can pickle it for spawned ranks."""

    def __init__(self, fn, flops: bool = False, ops: bool = False):
        self.fn, self.flops, self.ops = fn, flops, ops

    def __call__(self, rank: int, world_size: int, *args, **kwargs):
        with tracing(rank, flops=self.flops, ops=self.ops) as rank_trace:
            result = self.fn(rank, world_size, *args, **kwargs)
        return result, rank_trace
