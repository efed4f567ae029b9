"""Measuring a run on this machine: its steps (traced, timed on the slowest rank) and its links (calls timed,
α-β fitted) — what every chapter that replays a run measures first.

**Steps.** A rank's step ends at a stamp: the wall clock (``time.perf_counter``) and a mark "step" in its trace
(:func:`minipar.observe.tracer.mark`), put there by :meth:`RankSteps.tick` or at every ``step()`` of a recipe's
optimizer (:meth:`RankSteps.stamped`, :func:`minipar.observe.launch_trace.stamped_optimizer`). A **step time**
is the slowest rank's gap from one stamp to the next (:func:`minipar.machine.intervals.slowest_rank_steps`),
as a replay times its steps between marks (:meth:`minipar.machine.replay.ReplayResult.step_gaps`); "the"
step of a run is the fastest of them (:attr:`Steps.fastest`, as ``ReplayResult.step_between``): the first
steps carry set-up, and the machine is shared. :func:`measure_steps` launches one ``parallel_train`` so
measured; :func:`timed_steps` (on a rank) and :func:`gather_steps` (on the caller's side) measure several
configurations inside one launch of the caller's.

**Links.** :func:`time_calls` times gloo's collectives on every rank at once (each call after a barrier, the
first a warm-up), :func:`pingpong` one message between two ranks (a blocking round trip / 2). :class:`Links`
keeps every call's seconds and fits them: each collective by its own ring form
(:func:`minipar.machine.fidelity.fit_link`, gathered in :class:`~minipar.machine.fidelity.OpLinks`), the
ping-pong by t = α + S/β (:func:`fit_p2p`). Which statistic is fitted is the caller's: the **mean** (what a
program pays per call on average: a call's time here has two modes, a few hundred µs or ~2 ms when a rank's
blocked threads are woken late) or the **min** (the link undisturbed). :func:`calibrate_links` launches both.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from minipar import comm
from minipar.launcher import launch
from minipar.machine.fidelity import OpLinks, fit_affine, fit_link
from minipar.machine.intervals import slowest_rank_steps, step_slice
from minipar.observe.launch_trace import stamped_optimizer
from minipar.machine.trace import Compute, Trace
from minipar.observe.tracer import mark, tracing

__all__ = ["RankSteps", "Steps", "timed_steps", "gather_steps", "measure_steps", "step_cpu_seconds", "counted_flops",
           "flops_per_second", "wall_seconds", "LINK_OPS", "LINK_SIZES", "time_calls", "pingpong", "fit_p2p", "fit_links", "Links",
           "calibrate_links"]


# ---------------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------------

class RankSteps:
    """What one rank measured: ``stamps`` (perf_counter at each step's end), its ``trace`` (a RankTrace, None
    when not traced) and ``result`` (what the caller keeps). Plain data: a rank returns it."""

    def __init__(self):
        self.stamps, self.trace, self.result = [], None, None

    def tick(self) -> None:
        """A step ends here: stamp the clock and mark "step" in the trace."""
        self.stamps.append(time.perf_counter())
        mark("step")

    def stamped(self, recipe):
        """``recipe`` with its optimizer stamping every ``step()`` into this rank's stamps (returned, changed)."""
        recipe.optimizer = stamped_optimizer(recipe.optimizer, self.stamps)
        return recipe


@contextlib.contextmanager
def timed_steps(rank: int, traced: bool = True, flops: bool = False, ops: bool = False):
    """On a rank: wait for every rank (a barrier, so that all start the block together), then run the block
    under :func:`minipar.observe.tracer.tracing` (``traced=False``: untraced; ``flops``: FLOPs counted too;
    ``ops``: operators counted, :mod:`minipar.observe.opcount`).
    Yields a :class:`RankSteps`; its ``trace`` is complete when the block ends."""
    run = RankSteps()
    dist.barrier()
    with tracing(rank, flops=flops, ops=ops) if traced else contextlib.nullcontext() as rank_trace:
        run.trace = rank_trace
        yield run


@dataclass
class Steps:
    """A run's steps: ``seconds`` per step (the slowest rank's), the :class:`Trace` of every rank (None when
    untraced), each rank's ``results``."""
    seconds: list
    trace: Trace | None = None
    results: list = field(default_factory=list)

    @property
    def fastest(self) -> float:
        """One step as a run times it: the fastest step (each timed on its slowest rank)."""
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def gather_steps(ranks: list, meta: dict | None = None, skip: int = 0) -> Steps:
    """:class:`Steps` of every rank's :class:`RankSteps`, the first ``skip`` stamps of each left out (steps
    that are not the ones timed: a watched step, say). Step i lasts max over ranks of stamp i+1 − stamp i."""
    seconds = slowest_rank_steps([r.stamps[skip:] for r in ranks], what="steps")
    traced = ranks[0].trace is not None
    return Steps(seconds, Trace([r.trace for r in ranks], dict(meta or {})) if traced else None,
                 [r.result for r in ranks])


class _Stepped:
    """``train(rank, world_size, recipe, ...)`` with the recipe's optimizer stamped, inside :func:`timed_steps`.
    A class, so that the launcher can pickle it."""

    def __init__(self, train, flops: bool, ops: bool = False):
        self.train, self.flops, self.ops = train, flops, ops

    def __call__(self, rank, world_size, recipe, *args, **kwargs) -> RankSteps:
        with timed_steps(rank, flops=self.flops, ops=self.ops) as run:
            run.result = self.train(rank, world_size, run.stamped(recipe), *args, **kwargs)
        return run


def measure_steps(train, world_size: int, recipe, *args, meta: dict | None = None, flops: bool = False,
                  ops: bool = False, timeout: float = 300, **kwargs) -> Steps:
    """Launch ``train(rank, world_size, recipe, *args, **kwargs)`` (a ``parallel_train``) on ``world_size``
    ranks, every rank traced, each optimizer step stamped: :class:`Steps` (seconds per step between optimizer
    steps, the Trace with ``meta``, each rank's result; ``flops``/``ops``: counted in the trace, for a
    replay on a device card). The recipe needs at least 2 steps."""
    if len(recipe.batches) < 2:
        raise ValueError("a step is timed between two optimizer steps: the recipe needs at least 2 steps")
    ranks = launch(_Stepped(train, flops, ops), world_size, recipe, *args, quiet=True, timeout=timeout, **kwargs)
    return gather_steps(ranks, meta)


def step_cpu_seconds(trace: Trace, label: str = "step") -> float:
    """Thread CPU seconds of compute in the last step (between the last two marks ``label``), busiest rank."""
    return max(sum(e.seconds_cpu for e in step_slice(r.events, label, -1) if isinstance(e, Compute))
               for r in trace.ranks)


def counted_flops(fn) -> int:
    """FLOPs ``fn()`` runs (``torch.utils.flop_counter``: matmuls and convolutions), e.g. one forward +
    backward; divided by a step's CPU seconds (:func:`step_cpu_seconds`) it is a rank's FLOP/s here."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def flops_per_second(n: int = 256, repeats: int = 5) -> float:
    """float32 matmul FLOP/s of one thread (ranks run with torch.set_num_threads(1)): 2n³ / the fastest of
    ``repeats`` n×n products, after one warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = min(wall_seconds(lambda: a @ b) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return 2 * n ** 3 / best


def wall_seconds(fn) -> float:
    """Wall-clock seconds of one call ``fn()`` (``time.perf_counter``)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------------------

LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter")      # the collectives time_calls can time
LINK_SIZES = (4, 2 ** 16, 2 ** 19, 2 ** 21)   # bytes timed to fit α and β: three decades, so a busy moment at one
                                              # size cannot hide the bandwidth (two sizes, 4 B and 512 KiB, once did)


def _calls(size: int, n: int) -> dict:
    """{op: a call of ``op`` through minipar.comm on ``size`` bytes of payload S}: all-reduce (S: the tensor),
    all-gather (S: the gathered whole) and reduce-scatter (S: the full input), S rounded to n floats."""
    whole = torch.zeros(max(n, size // 4 // n * n))
    part = torch.zeros(whole.numel() // n)
    one = torch.zeros(max(1, size // 4))
    return {"all_reduce": lambda: comm.all_reduce(one),
            "all_gather": lambda: comm.all_gather_into_tensor(whole, part),
            "reduce_scatter": lambda: comm.reduce_scatter_tensor(part, whole)}


def time_calls(world_size: int, sizes, repeats: int, ops=LINK_OPS) -> dict:
    """On every rank of a launch at once: {op: {bytes: [seconds of each of ``repeats`` calls]}} of ``ops`` at
    each of ``sizes`` bytes, each call after a barrier (all ranks start it together), one warm-up call first
    (not kept)."""
    out = {op: {} for op in ops}
    for size in sizes:
        calls = _calls(size, world_size)
        for op in ops:
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                times.append(wall_seconds(calls[op]))
            out[op][size] = times[1:]
    return out


def _pingpong(rank, world_size, sizes, repeats):
    warm = torch.zeros(1024)
    for _ in range(3):                             # the first messages set up the connection
        comm.send(warm, 1) if rank == 0 else comm.recv(warm, 0)
        comm.recv(warm, 1) if rank == 0 else comm.send(warm, 0)
    times = {}
    for n in sizes:
        buf = torch.zeros(n // 4)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if rank == 0:
                comm.send(buf, 1)
                comm.recv(buf, 1)
            else:
                comm.recv(buf, 0)
                comm.send(buf, 0)
            samples.append((time.perf_counter() - t0) / 2)        # one way
        times[n] = samples[1:]                  # the first is a warm-up
    return times


def pingpong(sizes, repeats: int) -> dict:
    """{bytes: [one-way seconds of each blocking send/recv round trip / 2]} between two ranks here (a launch of
    2), ``repeats`` round trips per size, the first (a warm-up) left out."""
    return launch(_pingpong, 2, list(sizes), repeats, quiet=True)[0]


def fit_p2p(seconds: dict) -> tuple:
    """(β bytes/s, α s) of one message, t = α + S/β fitted to ``seconds`` {S: t} in relative error
    (:func:`minipar.machine.fidelity.fit_affine`); α ≥ 0, β = ∞ when t does not grow with S (small sizes on a
    busy machine)."""
    alpha, per_byte = fit_affine(list(seconds), list(seconds.values()))
    return (1 / per_byte if per_byte > 0 else float("inf")), max(alpha, 0.0)


def fit_links(seconds: dict, world_size: int, p2p: tuple | None = None):
    """:class:`~minipar.machine.fidelity.OpLinks` of ``seconds`` {op: {bytes: s}} on ``world_size`` ranks: each
    op timed at two sizes or more on its own (β, α) (:func:`~minipar.machine.fidelity.fit_link`; an op whose
    time does not grow with size is left to the cluster's link), ``p2p`` (β, α) for send/recv. None when no op
    could be fitted."""
    ops = {}
    for op, samples in seconds.items():
        if len(samples) >= 2:
            try:
                ops[op] = fit_link(op, world_size, samples)
            except ValueError:          # no growth with size (a noisy calibration): the cluster's link
                pass
    return OpLinks(ops, p2p) if ops else None


@dataclass
class Links:
    """Calls timed here: ``calls`` per rank {op: {bytes: [s]}} on ``world_size`` ranks (:func:`time_calls`),
    ``p2p`` {bytes: [one-way s]} between two (:func:`pingpong`). A statistic (``statistics.fmean``, ``min``,
    ``statistics.median``) reduces each rank's calls; the ranks' values are then averaged."""
    world_size: int
    calls: list = field(default_factory=list)
    p2p: dict | None = None

    def seconds(self, op: str, statistic=statistics.fmean) -> dict:
        """{bytes: seconds} of ``op``: ``statistic`` of each rank's calls, mean over ranks."""
        sizes = self.calls[0][op]
        return {s: statistics.fmean(statistic(r[op][s]) for r in self.calls) for s in sizes}

    def p2p_seconds(self, statistic=statistics.fmean) -> dict:
        """{bytes: one-way seconds}: ``statistic`` of the ping-pong's round trips / 2."""
        return {s: statistic(v) for s, v in self.p2p.items()}

    def fit(self, op: str, statistic=statistics.fmean) -> tuple:
        """(β, α) of ``op``'s ring form fitted to :meth:`seconds` (:func:`~minipar.machine.fidelity.fit_link`)."""
        return fit_link(op, self.world_size, self.seconds(op, statistic))

    def fitted(self, statistic=statistics.fmean):
        """:class:`~minipar.machine.fidelity.OpLinks`: every op timed, and send/recv on the ping-pong's
        :func:`fit_p2p`, both of ``statistic`` (:func:`fit_links`)."""
        p2p = fit_p2p(self.p2p_seconds(statistic)) if self.p2p else None
        ops = list(self.calls[0]) if self.calls else []
        return fit_links({op: self.seconds(op, statistic) for op in ops}, self.world_size, p2p)


def _time_calls_on_rank(rank, world_size, sizes, repeats, ops):
    return time_calls(world_size, sizes, repeats, ops)


def calibrate_links(world_size: int, sizes=LINK_SIZES, repeats: int = 60, ops=LINK_OPS,
                    p2p_sizes=(2 ** 10, 2 ** 14, 2 ** 18, 2 ** 20, 2 ** 22)) -> Links:
    """Time this machine's links: ``ops`` (none: skipped) at ``sizes`` bytes on ``world_size`` ranks at once,
    ``repeats`` calls each (:func:`time_calls`, one launch), and a ping-pong of ``p2p_sizes`` (None: skipped)
    between two ranks, ``repeats`` round trips (:func:`pingpong`, a second launch). :meth:`Links.fitted` gives
    the :class:`~minipar.machine.fidelity.OpLinks` a replay takes."""
    calls = launch(_time_calls_on_rank, world_size, tuple(sizes), repeats, tuple(ops), quiet=True) if ops else []
    return Links(world_size, calls, pingpong(p2p_sizes, repeats) if p2p_sizes else None)
