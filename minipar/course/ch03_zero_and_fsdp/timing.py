"""Chapter 03's time: ZeRO-3 with and without prefetch, measured here and replayed on a named cluster.

One launch trains the tiny GPT with ZeRO-3 (one unit per block, :func:`minipar.data.zero.parallel_train`)
twice, ``prefetch=True`` and ``False``, under :func:`minipar.observe.tracer.tracing`, each optimizer step marked.
Per run, measured as :mod:`minipar.observe.measure` measures every run: the wall seconds between optimizer
steps (**measured on this machine**: the fastest step, each on its slowest rank) and the trace, which
:func:`minipar.course.replays.replays` plays on declared clusters (**model**). With
prefetch the next unit's all-gather is issued before the current unit computes and waited for when it is
needed; without, each gather is issued and waited for right where the unit starts.

The memory timeline: in one step (the second; the steps timed are the ones after it, without the watch's
overhead) a :class:`minipar.memory.LiveTensorTracker` and ZeRO's ``on_alloc`` (gathered parameters) count
the live bytes at every allocation and free, each sample stamped with :func:`minipar.observe.tracer.position`, so that
:func:`memory_on_replay` can put it on any replay's time axis: a sample taken c CPU seconds into compute
segment i sits at that segment's replayed start + c × its replayed length / its CPU seconds.
"""
from __future__ import annotations

import torch

from minipar.check import gpt_recipe
from minipar.course.replays import draw_replays
from minipar.data import zero
from minipar.data.zero_measure import measured_zero_state_bytes
from minipar.launcher import launch
from minipar.loop import shard_batch
from minipar.memory import LiveTensorTracker
from minipar.observe.measure import LINK_SIZES, Links, counted_flops, gather_steps, step_cpu_seconds, time_calls, \
    timed_steps
from minipar.machine.trace import Compute
from minipar.observe.tracer import position

__all__ = ["traced_rank", "measure", "measure_counted", "measure_memory", "MemoryWatch", "memory_on_replay", "draw_step_and_memory"]

STEP_RECIPE = dict(batch_size=16, seq_len=32, n_layer=4, n_embd=64)   # 4 blocks: 4 units (+ the root)


class _Sampling(LiveTensorTracker):
    """A live-tensor tracker that appends (trace position, live bytes) to ``samples`` at every change."""

    def __init__(self, samples: list, base: int):
        super().__init__()
        self.samples, self.base, self.active = samples, base, True

    def sample(self) -> None:
        where = position() if self.active else None       # (frees seen after the step are not its own)
        if where is not None:
            self.samples.append((where[0], where[1], self.base + self.current))

    def _freed(self, ptr: int, nbytes: int) -> None:
        super()._freed(ptr, nbytes)
        self.sample()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.sample()
        return out


class MemoryWatch:
    """``observe(zero, step)`` for :func:`minipar.data.zero.parallel_train`: step number ``at`` (1-based) runs
    with its live bytes sampled (model states at its start + what it allocates, gathered parameters
    included); ``samples``: [(trace event index, CPU seconds into that segment, live bytes)]."""

    def __init__(self, at: int):
        self.at, self.count, self.samples = at, 0, []

    def __call__(self, zero, step):
        self.count += 1
        if self.count != self.at:
            return step()
        tracker = _Sampling(self.samples, sum(measured_zero_state_bytes(zero).values()))

        def allocated(nbytes):
            tracker.current += nbytes
            tracker.sample()
        zero.on_alloc = allocated
        try:
            with tracker:
                return step()
        finally:
            zero.on_alloc, tracker.active = None, False


def memory_on_replay(samples, trace_rank, result, rank: int = 0) -> list:
    """[(replayed seconds, live bytes)] of a :class:`MemoryWatch`'s samples on ``result``'s time axis. A
    sample inside a compute segment is placed by its CPU share of the segment; one taken inside a
    communication call (its buffers) at the replayed start of that call."""
    spans = {s.index: s for s in result.timelines[rank]}
    out = []
    for index, cpu, live in samples:
        span = spans.get(index)
        if span is None:
            continue
        event = trace_rank.events[index]
        if isinstance(event, Compute) and event.seconds_cpu > 0:
            out.append((span.start + min(1.0, cpu / event.seconds_cpu) * (span.end - span.start), live))
        else:
            out.append((span.start, live))
    return sorted(out)


LINK_REPEATS = 20      # gloo's all-reduce timed as chapter 02 times it, at measure.LINK_SIZES


def _watched(rank, world_size, steps):
    """{prefetch: (RankSteps, rank's MemoryWatch samples of step 2)}: ZeRO-3 traced for ``steps`` steps with and
    without prefetch (step 1 records the unit order; step 2 is watched)."""
    torch.set_num_threads(1)
    out = {}
    for prefetch in (True, False):
        recipe = gpt_recipe(steps=steps, optimizer="sgd", **STEP_RECIPE)   # step 1 records the unit order
        watch = MemoryWatch(at=2)
        with timed_steps(rank) as run:
            zero.parallel_train(rank, world_size, run.stamped(recipe), stage=3, prefetch=prefetch, observe=watch)
        out[prefetch] = (run, watch.samples)
    return out


def memory_rank(rank, world_size):
    """{prefetch: this rank's MemoryWatch samples of step 2}: :func:`traced_rank`'s watched runs alone."""
    return {prefetch: samples for prefetch, (_, samples) in _watched(rank, world_size, 2).items()}


def measure_memory(world_size: int = 4) -> dict:
    """{"memory": {"prefetch" | "no prefetch": rank 0's MemoryWatch samples of step 2}}: the part of
    :func:`measure` that chapter 03's memory table reads, the same runs stopped after the watched step (2
    steps: step 1 records the unit order, step 2 is watched; the steps after it are only timed, and the
    step count changes no allocation in step 2), without the timed steps, the counted replay and the link
    timings."""
    ranks = launch(memory_rank, world_size, quiet=True, timeout=300)
    return {"memory": {name: ranks[0][p] for p, name in ((True, "prefetch"), (False, "no prefetch"))}}


COUNTED_STEPS = 2     # step 1 records the unit order; a replay reads step 2, between the last two marks


def counted_rank(rank, world_size):
    """{prefetch: RankSteps}: the program once more, traced with each compute segment's operators counted (what a
    device card prices), ``COUNTED_STEPS`` steps."""
    torch.set_num_threads(1)
    counted = {}
    for prefetch in (True, False):
        recipe = gpt_recipe(steps=COUNTED_STEPS, optimizer="sgd", **STEP_RECIPE)
        with timed_steps(rank, ops=True) as run:
            zero.parallel_train(rank, world_size, run.stamped(recipe), stage=3, prefetch=prefetch)
        counted[prefetch] = run
    return counted


def _param_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in gpt_recipe(steps=1, **STEP_RECIPE).model().parameters())


def measure_counted(world_size: int = 4) -> dict:
    """{"counted": {"prefetch" | "no prefetch": Trace with each compute segment's operators}, "param_bytes",
    "world_size"}: the part of :func:`measure` that a replay on a device card reads (chapter 03b's DGX-A100
    model, :func:`minipar.course.ch03_zero_and_fsdp.report.prefetch`), one launch, without the timed and watched
    steps, the FLOP count and the link timings, which only a replay "here" or on a cluster without a card reads."""
    ranks = launch(counted_rank, world_size, quiet=True, timeout=300)
    names = {True: "prefetch", False: "no prefetch"}
    counted = {names[p]: gather_steps([r[p] for r in ranks], {"strategy": f"ZeRO-3, {names[p]}"}).trace
               for p in names}
    return {"counted": counted, "param_bytes": _param_bytes(), "world_size": world_size}


def traced_rank(rank, world_size, steps):
    """({prefetch: (RankSteps, memory samples)}, the step's FLOPs per rank, gloo's all-reduce times
    (:func:`minipar.observe.measure.time_calls`), the model's parameter bytes)."""
    out = _watched(rank, world_size, steps + 1)
    out["counted"] = counted_rank(rank, world_size)
    recipe = gpt_recipe(steps=1, **STEP_RECIPE)
    x, y = shard_batch(recipe.batches[0], rank, world_size)
    flops = counted_flops(lambda: recipe.loss(recipe.model(), x, y).backward())
    param_bytes = sum(p.numel() * p.element_size() for p in recipe.model().parameters())
    links = time_calls(world_size, LINK_SIZES, LINK_REPEATS, ops=("all_reduce",))
    return out, flops, links, param_bytes


def measure(world_size: int = 4, steps: int = 3) -> dict:
    """{"traces": {"prefetch" | "no prefetch": Trace}, "counted": {…: Trace of :data:`COUNTED_STEPS` more steps
    with each compute segment's operators, for a replay on a device card}, "measured": {…: s}, "memory": {…: rank 0's
    MemoryWatch samples of step 2}, "flops_here", "flops_per_step", "steps", "alpha", "beta" (gloo's
    all-reduce here, fitted), "param_bytes" (the model's parameters)} — the shape
    :func:`minipar.course.replays.replays` reads. The first optimizer step (the unit order being recorded, no
    prefetch yet) stays in the trace, so a replay's step is read between later marks (``step_between``);
    the steps measured are those after the watched one."""
    if steps < 3:
        raise ValueError(f"steps must be at least 3 (step 2 is watched; a step is the gap between two later "
                         f"optimizer steps), got {steps}")
    ranks = launch(traced_rank, world_size, steps, quiet=True, timeout=300)
    names = {True: "prefetch", False: "no prefetch"}
    runs = {names[p]: gather_steps([r[0][p][0] for r in ranks], {"strategy": f"ZeRO-3, {names[p]}"}, skip=2)
            for p in names}
    traces = {name: run.trace for name, run in runs.items()}
    flops = ranks[0][1]
    beta, alpha = Links(world_size, [r[2] for r in ranks]).fit("all_reduce", min)
    counted = {names[p]: gather_steps([r[0]["counted"][p] for r in ranks], {"strategy": f"ZeRO-3, {names[p]}"}).trace
               for p in names}
    return {"traces": traces, "counted": counted, "measured": {name: run.fastest for name, run in runs.items()},
            "memory": {names[p]: ranks[0][0][p][1] for p in names},
            "flops_per_step": flops, "flops_here": flops / step_cpu_seconds(traces["prefetch"]), "steps": steps + 1,
            "world_size": world_size, "alpha": alpha, "beta": beta, "param_bytes": ranks[0][3]}


def draw_step_and_memory(axes, title: str, result, samples, trace_rank, p: int, unit: float = 1e-3):
    """On two axes: the watched step (step 2) of ``result`` as a Gantt, and rank 0's live bytes on the same
    time axis (``unit`` seconds per tick)."""
    draw_replays(axes[:1], {title: result}, p, unit=unit, gap=1)
    start = [t for label, t in result.marks[0] if label == "step"][0]
    points = memory_on_replay(samples, trace_rank, result)
    axes[1].step([(t - start) / unit for t, _ in points], [b / 2 ** 20 for _, b in points], where="post", lw=0.8)
    axes[1].set_xlim(axes[0].get_xlim())
    axes[1].set_ylabel("rank 0 live MiB", fontsize=7)
    axes[1].tick_params(labelsize=7)
