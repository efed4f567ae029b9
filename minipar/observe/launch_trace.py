"""Every rank of a launch traced (:func:`minipar.observe.tracer.tracing`), no strategy changed.

Two ways in, both around :func:`minipar.launch`:

    results, trace = traced_launch(fn, 4, *args)            # this launch: (results, Trace)

    with recording_launches() as traces:                    # every launch inside the block, however deep
        row = some_strategy.run(recipe, world_size=4)       # (a strategy's run() calls launch itself)
    traces[-1].save("row.json")

The launcher knows nothing of tracing: it asks the active hooks (:mod:`minipar.hooks`) with an
``around_launch(fn, world_size) -> (fn, finish)``. A :func:`recording_launches` block installs this module's
hook, which wraps each rank's function in :class:`minipar.observe.tracer.Traced` (a picklable class, so spawned
ranks get it too), which returns (the function's result, the rank's :class:`~minipar.machine.trace.RankTrace`);
its ``finish`` splits the pairs again, so the caller's results are exactly the untraced ones, and hands one
:class:`~minipar.machine.trace.Trace` to every open block (a block inside another joins the outer one's hook:
each rank is traced once). The recording itself is a hook on :mod:`minipar.comm`'s calls: strategy files hold
no tracing code. Outside such a block the launcher wraps nothing.

A step's time in such a trace is read between marks: :func:`stamped_optimizer` wraps a recipe's optimizer so
that every ``step()`` appends its wall time and marks "step" in the rank's trace.
"""
from __future__ import annotations

import contextlib
import time

from minipar import hooks, launcher

from minipar.machine.trace import Trace
from .tracer import Traced, mark

__all__ = ["traced_launch", "recording_launches", "stamped_optimizer"]

class _LaunchTracer:
    """The launch hook: every rank of a launch traced. ``recorders``: (list, ops wanted) of each open
    :func:`recording_launches` block it serves, innermost last."""

    def __init__(self):
        self.recorders: list = []

    def around_launch(self, fn, world_size: int):
        """(``fn`` traced on every rank, ``finish(pairs)`` -> the results, with one Trace (``meta``: the
        function's name and the world size) handed to every open recorder). Operators are counted
        (:mod:`minipar.observe.opcount`) when any open recorder asked for them."""
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        recorders = list(self.recorders)
        ops = any(counted for _, counted in recorders)

        def finish(pairs):
            run = Trace([rank_trace for _, rank_trace in pairs], {"function": name, "world_size": world_size})
            for traces, _ in recorders:
                traces.append(run)
            return [result for result, _ in pairs]
        return Traced(fn, ops=ops), finish


@contextlib.contextmanager
def recording_launches(ops: bool = False):
    """Collect a :class:`minipar.machine.trace.Trace` of every :func:`minipar.launch` inside the block, in order
    (``meta``: the function's name and the world size). Yields the list, filled as launches end. ``ops``:
    count each compute segment's operators too (for a replay on a device card; it slows every operator)."""
    traces: list = []
    outer = [h for h in hooks.active() if isinstance(h, _LaunchTracer)]
    tracer = outer[0] if outer else _LaunchTracer()
    tracer.recorders.append((traces, ops))
    try:
        with contextlib.nullcontext() if outer else hooks.installed(tracer):
            yield traces
    finally:
        del tracer.recorders[next(i for i, (r, _) in enumerate(tracer.recorders) if r is traces)]   # by identity


def traced_launch(fn, world_size: int, *args, meta: dict | None = None, ops: bool = False, **kwargs):
    """``minipar.launch(fn, world_size, *args, **kwargs)`` with every rank traced: (the results, exactly the
    untraced ones, and the launch's :class:`~minipar.machine.trace.Trace`, ``meta`` added to its own);
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
