"""The launcher's tracing: every rank of a launch run under :func:`minipar.observe.trace.tracing`, no strategy changed.

Two ways in, both through :func:`minipar.launch`:

    results, trace = launch(fn, 4, *args, trace=True)      # this launch: (results, Trace)

    with recording_launches() as traces:                    # every launch inside the block, however deep
        row = some_strategy.run(recipe, world_size=4)       # (a strategy's run() calls launch itself)
    traces[-1].save("row.json")

Each rank's function is wrapped in :class:`minipar.observe.trace.Traced` (a picklable class, so spawned ranks get it
too); the wrapper returns (the function's result, the rank's :class:`~minipar.observe.trace.RankTrace`), which the
launcher splits again, so the caller's results are exactly the untraced ones. The recording itself is
:mod:`minipar.comm`'s (two hooks: before each call and on each record): strategy files hold no tracing code.
Outside a ``recording_launches`` block and without ``trace=True`` the launcher wraps nothing.

A step's time in such a trace is read between marks: :func:`stamped_optimizer` wraps a recipe's optimizer so
that every ``step()`` appends its wall time and marks "step" in the rank's trace.
"""
from __future__ import annotations

import contextlib
import time

__all__ = ["recording_launches", "prepare", "stamped_optimizer"]

_recorders: list = []          # the lists of open recording_launches() blocks, innermost last


@contextlib.contextmanager
def recording_launches():
    """Collect a :class:`minipar.observe.trace.Trace` of every :func:`minipar.launch` inside the block, in order
    (``meta``: the function's name and the world size). Yields the list, filled as launches end."""
    traces: list = []
    _recorders.append(traces)
    try:
        yield traces
    finally:
        del _recorders[next(i for i, r in enumerate(_recorders) if r is traces)]   # by identity: lists compare equal


def prepare(fn, world_size: int, trace: bool):
    """(the function each rank runs, ``finish(results)``): with ``trace`` or inside
    :func:`recording_launches`, ``fn`` traced and ``finish`` splitting (result, RankTrace) pairs into the
    results and one :class:`~minipar.observe.trace.Trace` (handed to every open recorder; returned beside the
    results when ``trace``); else ``fn`` itself and the identity."""
    if not trace and not _recorders:
        return fn, lambda results: results
    from .trace import Trace, Traced
    name = getattr(fn, "__qualname__", None) or type(fn).__name__

    def finish(pairs):
        run = Trace([rank_trace for _, rank_trace in pairs], {"function": name, "world_size": world_size})
        for traces in _recorders:
            traces.append(run)
        results = [result for result, _ in pairs]
        return (results, run) if trace else results
    return Traced(fn), finish


def stamped_optimizer(factory, stamps: list):
    """A recipe's optimizer factory whose optimizers, after each ``step()``, append ``time.perf_counter()`` to
    ``stamps`` and :func:`minipar.observe.trace.mark` "step" (a no-op when no trace is recording). A training step is
    then the gap between two stamps, or between two marks of a replay (``ReplayResult.step_between``)."""
    from .trace import mark

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
