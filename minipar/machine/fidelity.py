"""A replay against the run it was traced from: links per kind of call, per-step times, and what to compare.

:mod:`minipar.machine.replay` plays a :mod:`minipar.machine.trace` on a
:class:`~minipar.machine.cluster.Cluster`, every call on the cluster's α-β links. Measured here, one α-β pair does not fit every call (ASTRA-sim, Rashidi et al.
2020, and Calculon, Isaev et al. 2023, likewise time each collective by its own algorithm):

* a **message** (send / recv between two ranks) costs the ping-pong's α + S/β: one rendezvous, one copy;
* a **collective** costs what gloo's own algorithm for *that op* costs, each fitted to its own timings at a
  few sizes — ``t = k·α + f·S/β`` with k, f the ring's steps and share of S (all-reduce 2(n-1), 2(n-1)/n;
  all-gather and reduce-scatter n-1, (n-1)/n), so an op whose algorithm is not the ring (gloo's
  reduce-scatter is an all-reduce that keeps one chunk) shows up as a lower fitted β, not as a miss.

:class:`OpLinks` is that choice, passed to ``replay(..., comm_time=OpLinks(...))``; :func:`fit_link` fits one
op's pair. To compare a replay with the run, step by step: the replay's step times
(:meth:`minipar.machine.replay.ReplayResult.step_gaps`) against the run's, both by
:func:`minipar.machine.intervals.slowest_rank_steps` (per step, the slowest rank's time from one step to the next);
:func:`with_other_threads` (each segment also pays the CPU seconds the rank's other threads — gloo's, moving
and summing bytes — used meanwhile: on a CPU, communication "hidden" under compute takes the compute's core)
and :func:`wall_compute` (each segment's wall seconds in place of its thread CPU seconds: time lost to other
processes too). Replayed side by side they separate the causes of a miss: the rank's own communication
threads, other processes on shared cores, and what the replay's model of the communication leaves out.
:func:`with_flops` copies the FLOPs counted in one run (counting slows every op, so not in the timed run)
onto the segments of another with the same events. :func:`observed_calls` is the check of the engine
itself: each blocking collective lasts what it lasted in the run (no link model at all), so what is left of
a miss is the replay's composition — compute, waits, overlap — not the calibration.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from minipar.machine.cluster import Cluster, alpha_beta_terms, collective_seconds, comm_seconds
from minipar.machine.trace import Comm, Compute, RankTrace, Trace

__all__ = ["OpLinks", "fit_affine", "fit_link", "observed_calls", "ring_terms", "wall_compute",
           "with_other_threads", "with_flops", "with_ops"]


_ERRORS = ("relative", "absolute")   # what a fit's least squares minimises: t's relative or absolute error
_RING_FORM = ("all_gather", "all_reduce", "reduce_scatter", "send")   # the ops fitted in the ring's form


def ring_terms(op: str, n: int) -> tuple:
    """(k, f) of ``op`` on n ranks in ``t = k·α + f·S/β`` (:func:`minipar.machine.cluster.alpha_beta_terms`),
    for the ops fitted here: the rings and a send."""
    if op not in _RING_FORM:
        raise ValueError(f"no ring form for {op!r}: one of {list(_RING_FORM)}")
    return alpha_beta_terms(op, n)


def fit_affine(xs, ys, error: str = "relative") -> tuple:
    """(a, s) of y = a + x·s by weighted least squares. ``error="relative"`` (weights 1/y²): small sizes fix a,
    large ones s — a latency and a bandwidth from timings over three decades of sizes. ``error="absolute"``
    (weights 1, plain least squares in seconds): the largest times dominate, so a is poorly fixed when y spans
    decades."""
    if error not in _ERRORS:
        raise ValueError(f"error must be one of {list(_ERRORS)}, got {error!r}")
    w = [1 / y ** 2 for y in ys] if error == "relative" else [1.0 for _ in ys]
    s0, s1, s2 = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * x * x for wi, x in zip(w, xs))
    t0, t1 = sum(wi * y for wi, y in zip(w, ys)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = (s0 * t1 - s1 * t0) / (s0 * s2 - s1 * s1)
    return (t0 - slope * s1) / s0, slope


def fit_link(op: str, n: int, samples: dict, error: str = "relative") -> tuple:
    """(β bytes/s, α s) that make ``t = k·α + f·S/β`` (:func:`ring_terms`) fit ``samples`` {S bytes: t s} of
    ``op`` on n ranks, in ``error`` (:func:`fit_affine`: "relative", the default, or "absolute" seconds).
    α is kept ≥ 0.1 µs (a fit may cross zero), β > 0."""
    if len(samples) < 2:
        raise ValueError(f"fitting {op} needs at least two sizes, got {len(samples)}")
    k, f = ring_terms(op, n)
    a, slope = fit_affine(list(samples), list(samples.values()), error)
    if slope <= 0:
        raise ValueError(f"{op}: time does not grow with size in {samples}; no bandwidth to fit")
    return f / slope, max(a / k, 1e-7)


@dataclass(frozen=True)
class OpLinks:
    """Seconds of one call by its kind: ``ops`` {op: (β, α)} for the collectives timed one by one, ``p2p``
    (β, α) for send/recv, the cluster's own links for anything else. Each in the α-β form of
    :func:`minipar.machine.cluster.collective_seconds`. A replay's ``comm_time``."""
    ops: dict = field(default_factory=dict)
    p2p: tuple | None = None

    def link(self, op: str):
        return self.p2p if op in ("send", "recv") else self.ops.get(op)

    def __call__(self, op: str, ranks, payload: float, cluster: Cluster) -> float:
        found = self.link(op)
        if found is None:
            return comm_seconds(op, ranks, payload, cluster)
        bw, latency = found
        return collective_seconds("send" if op in ("send", "recv") else op, payload, len(ranks), bw, latency)


def wall_compute(trace: Trace) -> Trace:
    """The trace with every :class:`~minipar.machine.trace.Compute`'s thread CPU seconds replaced by its wall
    seconds (what the segment took on the clock, time lost to other processes included)."""
    def swap(e):
        return dataclasses.replace(e, seconds_cpu=e.seconds_wall) if isinstance(e, Compute) else e
    return Trace([RankTrace(r.rank, [swap(e) for e in r.events]) for r in trace.ranks],
                 {**trace.meta, "compute": "wall"})


def with_other_threads(trace: Trace) -> Trace:
    """The trace with every :class:`~minipar.machine.trace.Compute` lasting its thread CPU seconds plus the CPU
    seconds the rank's other threads used meanwhile (``seconds_other_threads``): one core per rank runs both."""
    def add(e):
        return dataclasses.replace(e, seconds_cpu=e.seconds_cpu + e.seconds_other_threads) \
            if isinstance(e, Compute) else e
    return Trace([RankTrace(r.rank, [add(e) for e in r.events]) for r in trace.ranks],
                 {**trace.meta, "compute": "cpu + other threads"})


def _shape(events) -> list:
    return [(e.kind, e.op if isinstance(e, Comm) else None) for e in events]


def with_flops(trace: Trace, counted: Trace) -> Trace:
    """``trace`` with each compute segment's ``flops`` taken from the same segment of ``counted`` (a run of
    the same program traced with ``tracing(flops=True)``). ValueError if their events differ."""
    return _copy_counts(trace, counted, "flops")


def with_ops(trace: Trace, counted: Trace) -> Trace:
    """``trace`` (timed, nothing counted: counting slows every op) with each compute segment's operators,
    ``ops`` and ``flops``, taken from the same segment of ``counted`` (a run of the same program traced with
    ``tracing(ops=True)``): its times stay the timed run's, a replay on a device card prices the ops."""
    return _copy_counts(trace, counted, "ops", "flops")


def _copy_counts(trace: Trace, counted: Trace, *fields) -> Trace:
    if trace.world_size != counted.world_size:
        raise ValueError(f"{trace.world_size} ranks against {counted.world_size}")
    ranks = []
    for mine, theirs in zip(trace.ranks, counted.ranks):
        if _shape(mine.events) != _shape(theirs.events):
            raise ValueError(f"rank {mine.rank}: the two runs' events differ ({len(mine.events)} against "
                             f"{len(theirs.events)}); counts can only be copied between runs of one program")
        ranks.append(RankTrace(mine.rank, [dataclasses.replace(e, **{f: getattr(c, f) for f in fields})
                                           if isinstance(e, Compute) else e
                                           for e, c in zip(mine.events, theirs.events)]))
    return Trace(ranks, {**trace.meta, "flops": "counted"})


def observed_calls(trace: Trace, fallback):
    """A replay's ``comm_time`` under which every blocking collective lasts what it lasted in ``trace``'s own
    run: the k-th call of an op on a group takes the shortest of its members' wall seconds for their k-th
    such call (the last to arrive waited only for the call itself). Async calls (their seconds are the issue
    alone) and send/recv (a receive is posted early, its seconds are mostly waiting) take ``fallback``'s
    time (an :class:`OpLinks`, say). One callable per replay: it hands out each call's time once, in order."""
    seen: dict = {}
    for r in trace.ranks:
        count: dict = {}
        for e in r.comms():
            key = (e.op, tuple(sorted(e.ranks)))
            k = count.get(key, 0)
            count[key] = k + 1
            if e.async_ or e.op in ("send", "recv"):
                continue
            times = seen.setdefault(key, {})
            times[k] = min(times.get(k, e.seconds_wall), e.seconds_wall)
    issued: dict = {}

    def comm_time(op, ranks, payload, cluster):
        key = (op, tuple(sorted(ranks)))
        k = issued.get(key, 0)
        issued[key] = k + 1
        found = seen.get(key, {}).get(k)
        return found if found is not None else fallback(op, ranks, payload, cluster)
    return comm_time
