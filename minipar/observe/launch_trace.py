"""Every rank of a launch traced (:func:`minipar.observe.tracer.tracing`), no strategy changed.

Two ways in, both around :func:`minipar.launch`:

    results, trace = traced_launch(fn, 4, *args)            # this launch: (results, Trace)

    with recording_launches() as traces:                    # every launch inside the block, however deep
        row = some_strategy.run(recipe, world_size=4)       # (a strategy's run() calls launch itself)
    traces[-1].save("row.json")

The launcher knows nothing of tracing: it keeps a list of hooks (``minipar.launcher.launch_hooks``), each
``wrap(fn, world_size) -> (fn, finish)``. While a :func:`recording_launches` block is open, this module's
hook wraps each rank's function in :class:`minipar.observe.tracer.Traced` (a picklable class, so spawned
ranks get it too), which returns (the function's result, the rank's :class:`~minipar.observe.trace.RankTrace`);
its ``finish`` splits the pairs again, so the caller's results are exactly the untraced ones, and hands one
:class:`~minipar.observe.trace.Trace` to every open block. The recording itself is an observer of
:mod:`minipar.comm`: strategy files hold no tracing code. Outside such a block the launcher wraps nothing.

A step's time in such a trace is read between marks: :func:`stamped_optimizer` wraps a recipe's optimizer so
that every ``step()`` appends its wall time and marks "step" in the rank's trace.
"""
from __future__ import annotations

import contextlib
import time

from minipar import launcher

from .trace import Trace
from .tracer import Traced, mark

__all__ = ["traced_launch", "recording_launches", "stamped_optimizer"]

_recorders: list = []          # (list, ops wanted) of each open recording_launches() block, innermost last


def _trace_each_rank(fn, world_size: int):
    """The launch hook: (``fn`` traced on every rank, ``finish(pairs)`` -> the results, with one Trace
    (``meta``: the function's name and the world size) handed to every open recorder). Operators are
    counted (:mod:`minipar.observe.opcount`) when any open recorder asked for them."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    ops = any(counted for _, counted in _recorders)

    def finish(pairs):
        run = Trace([rank_trace for _, rank_trace in pairs], {"function": name, "world_size": world_size})
        for traces, _ in _recorders:
            traces.append(run)
        return [result for result, _ in pairs]
    return Traced(fn, ops=ops), finish


@contextlib.contextmanager
def recording_launches(ops: bool = False):
    """Collect a :class:`minipar.observe.trace.Trace` of every :func:`minipar.launch` inside the block, in order
    (``meta``: the function's name and the world size). Yields the list, filled as launches end. ``ops``:
    count each compute segment's operators too (for a replay on a device card; it slows every operator)."""
    traces: list = []
    if not _recorders:
        launcher.launch_hooks.append(_trace_each_rank)
    _recorders.append((traces, ops))
    try:
        yield traces
    finally:
        del _recorders[next(i for i, (r, _) in enumerate(_recorders) if r is traces)]   # by identity
        if not _recorders:
            launcher.launch_hooks.remove(_trace_each_rank)


def traced_launch(fn, world_size: int, *args, meta: dict | None = None, ops: bool = False, **kwargs):
    """``minipar.launch(fn, world_size, *args, **kwargs)`` with every rank traced: (the results, exactly the
    untraced ones, and the launch's :class:`~minipar.observe.trace.Trace`, ``meta`` added to its own);
    ``ops``: each compute segment's operators counted too."""
    with recording_launches(ops) as traces:
        results = launcher.launch(fn, world_size, *args, **kwargs)
    run = traces[-1]
    run.meta.update(meta or {})
    return results, run


def stamped_optimizer(factory, stamps: list):
    """A recipe's optimizer factory whose optimizers, after each ``step()``, append ``time.perf_counter()`` to
    ``stamps`` and :func:`minipar.observe.tracer.mark` "step" (a no-op when no trace is recording). A training
    step is then the gap between two stamps, or between two marks of a replay (``ReplayResult.step_between``)."""

    def build(params):
        opt = factory(params)
        step = opt.step

        def stamped_step(*args, **kwargs):
            out = step(*args, **kwargs)
            stamps.append(time.perf_counter())
            mark("step")
            return out
        opt.step = stamped_step
        return opt
    return build
