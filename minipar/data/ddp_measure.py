"""Watching DDP's buckets from the outside: when each gradient became ready, when each bucket's all-reduce
was launched and when it completed — the overlap of communication with backward (Li et al. 2020, §3.2.3).

Kept apart from :mod:`minipar.data.ddp` so that the strategy reads as DDP alone. The observer uses the
reducer's two seams: ``Reducer.grad_ready`` (called by every parameter's hook) and ``Reducer.collective``
(the function that launches a bucket's reduction, a constructor argument), both wrapped on one instance.

    model = DistributedDataParallel(net, bucket_bytes=64 * 1024)
    events = watch_buckets(model)          # [(kind, label, start, end)] in time.perf_counter seconds
    loss.backward()                        # ("grad", name, t, t) ... ("comm", "bucket i", launch, done)

    parts = reducer_cpu(model)             # {part: CPU seconds of this thread}, accumulating from now on
    loss.backward(); print(parts)          # bookkeeping, copies into buckets, divide by N, launches, end
"""
from __future__ import annotations

import time

from .ddp import DistributedDataParallel

__all__ = ["watch_buckets", "reducer_cpu", "REDUCER_PARTS"]

# The reducer's parts, as :func:`reducer_cpu` names them (each exclusive of the ones it calls).
REDUCER_PARTS = ("bucket bookkeeping", "copies into buckets", "divide by N", "launching all-reduces",
                 "end of backward")


def watch_buckets(model: DistributedDataParallel, events: list | None = None) -> list:
    """Append to ``events`` (a new list if none; returned) from now on: ``("grad", name, t, t)`` when a
    parameter's gradient reaches the reducer, ``("comm", "bucket i", launch, done)`` when bucket i's
    reduction completes (its work's future, so ``done`` is the completion, not a later ``wait()``)."""
    events = [] if events is None else events
    reducer = model.reducer
    bucket_of_buffer = {id(b.buffer): b.index for b in reducer.buckets}
    grad_ready, collective = reducer.grad_ready, reducer.collective

    def timed_grad_ready(param):
        now = time.perf_counter()
        events.append(("grad", reducer.names.get(id(param), "?"), now, now))
        grad_ready(param)

    def timed_collective(buffer, group):
        start = time.perf_counter()
        work = collective(buffer, group)
        label = f"bucket {bucket_of_buffer[id(buffer)]}"
        work.get_future().add_done_callback(lambda _f: events.append(("comm", label, start, time.perf_counter())))
        return work

    reducer.grad_ready, reducer.collective = timed_grad_ready, timed_collective
    return events


def reducer_cpu(model: DistributedDataParallel, parts: dict | None = None) -> dict:
    """Add to ``parts`` (a new dict if none; returned) from now on the CPU seconds this thread spends
    (``time.thread_time``: waiting costs none) in each part of the reducer's work, each exclusive of the parts
    it calls: ``"bucket bookkeeping"`` (``Reducer.grad_ready``: which slot is filled, is the bucket full),
    ``"copies into buckets"`` (``Bucket.gather``), ``"divide by N"`` (``Bucket.scale``), ``"launching
    all-reduces"`` (``Reducer.collective``: :mod:`minipar.comm`, its hooks and the process group's enqueue) and
    ``"end of backward"`` (``Reducer.finish``: the leftovers, the waits). Not seen here: autograd calling each
    Python hook, and the timers themselves (two ``thread_time`` calls per timed call)."""
    parts = dict.fromkeys(REDUCER_PARTS, 0.0) if parts is None else parts
    open_calls = []                       # per timed call in progress: the time spent in the calls it made

    def timed(fn, part):
        def wrapped(*args):
            open_calls.append(0.0)
            start = time.thread_time()
            try:
                return fn(*args)
            finally:
                took = time.thread_time() - start
                parts[part] += took - open_calls.pop()
                if open_calls:
                    open_calls[-1] += took
        return wrapped

    reducer = model.reducer
    reducer.grad_ready = timed(reducer.grad_ready, "bucket bookkeeping")
    reducer.collective = timed(reducer.collective, "launching all-reduces")
    reducer.finish = timed(reducer.finish, "end of backward")
    for bucket in reducer.buckets:
        bucket.gather = timed(bucket.gather, "copies into buckets")
        bucket.scale = timed(bucket.scale, "divide by N")
    return parts
