"""Watching DDP's buckets from the outside: when each gradient became ready, when each bucket's all-reduce
was launched and when it completed — the overlap of communication with backward (Li et al. 2020, §3.2.3).

Kept apart from :mod:`minipar.data.ddp` so that the strategy reads as DDP alone. The observer uses the
reducer's two seams: ``Reducer.grad_ready`` (called by every parameter's hook) and ``Reducer.collective``
(the function that launches a bucket's reduction, a constructor argument), both wrapped on one instance.

    model = DistributedDataParallel(net, bucket_bytes=64 * 1024)
    events = watch_buckets(model)          # [(kind, label, start, end)] in time.perf_counter seconds
    loss.backward()                        # ("grad", name, t, t) ... ("comm", "bucket i", launch, done)
"""
from __future__ import annotations

import time

from .ddp import DistributedDataParallel

__all__ = ["watch_buckets"]


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
