"""What a pipeline rank did and when: a timeline recorded *beside* the runtime, fed by its seams.

:class:`~minipar.pipeline.runtime.PipelineRank` executes a schedule and knows nothing of timing. :func:`timed`
mixes :class:`TimedRank` into any rank class (the runtime's, PipeDream's, a test's), which records, on the
run's synchronised clock (``runner.clock()``, rank 0's ``perf_counter`` broadcast at start):

* ``timeline`` rows ``(step, kind, stage, microbatch, start, end)``: kind F / B / W / BW for an action, whose
  span starts once its input is there (``max(action began, input_arrived)``: waiting in a receive is idle, not
  work); ``wait`` for the time blocked in a receive; ``send`` for posting a message;
* ``memory`` rows ``(step, time, live bytes)`` after each action, when ``run`` is given a
  :class:`~minipar.memory.LiveTensorTracker`.

The seams it fills are the runtime's: ``begin_action``, ``post``, ``wait_for``, ``action_done``. Paced mode
(:func:`minipar.pipeline.paced.paced`) goes on top (``paced(timed(cls))``): its deferred sends pass through
``post`` here when its slot ends, and its ``input_arrived`` (the sender's slot end) is the one a span starts
from. The readers of these rows (:func:`step_rows`, :func:`measured_idle_fraction`, :func:`typical_step`) take
any objects with a ``timeline``: a :class:`~minipar.pipeline.runtime.PipelineRun`, a PipeDream or 3D run.
"""
from __future__ import annotations

import functools

__all__ = ["TimedRank", "timed", "step_rows", "measured_idle_fraction", "typical_step", "COMPUTE"]

COMPUTE = ("F", "B", "W", "BW")      # the kinds of row that are work


class TimedRank:
    """Mixed in before a rank class by :func:`timed`: ``self.timeline`` and ``self.memory`` rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeline, self.memory, self.tracker = [], [], None

    def run(self, inputs: list, targets: list, step_index: int = 0, tracker=None):
        """The runtime's step; ``tracker`` (a LiveTensorTracker, or None) gives the memory rows."""
        self.tracker = tracker
        return super().run(inputs, targets, step_index)

    def begin_action(self, action) -> None:
        super().begin_action(action)
        self.action_start = self.clock()

    def post(self, t, dst: int, tag: int, to_stage: int, microbatch: int) -> None:
        start = self.clock()
        super().post(t, dst, tag, to_stage, microbatch)
        self.timeline.append((self.step_index, "send", to_stage, microbatch, start, self.clock()))

    def wait_for(self, buf, src: int, tag: int, stage: int, microbatch: int) -> None:
        start = self.clock()
        super().wait_for(buf, src, tag, stage, microbatch)
        self.timeline.append((self.step_index, "wait", stage, microbatch, start, self.input_arrived))

    def action_done(self, kind: str) -> None:
        super().action_done(kind)
        a, now = self.action, self.clock()
        self.timeline.append((self.step_index, kind, a.stage, a.microbatch,
                              max(self.action_start, self.input_arrived), now))
        if self.tracker is not None:
            self.memory.append((self.step_index, now, self.tracker.current))


@functools.cache
def timed(rank_class: type) -> type:
    """``rank_class`` with :class:`TimedRank` mixed in (one class per rank class; already timed: itself)."""
    if issubclass(rank_class, TimedRank):
        return rank_class
    return type(f"Timed{rank_class.__name__}", (TimedRank, rank_class), {})


def step_rows(runs: list, step: int = -1, kinds=COMPUTE) -> list:
    """[(rank, kind, stage, microbatch, start, end)] of one step from every rank's timeline, the clock
    shifted so that the step starts at 0 (``step=-1``: the last step)."""
    if step < 0:
        step = max(row[0] for run in runs for row in run.timeline) + 1 + step
    rows = [(rank, k, s, i, t0, t1) for rank, run in enumerate(runs)
            for (st, k, s, i, t0, t1) in run.timeline if st == step]
    origin = min(r[4] for r in rows if r[1] in COMPUTE)    # the step's first action starts
    rows = [r for r in rows if r[1] in kinds]
    return [(rank, k, s, i, t0 - origin, t1 - origin) for rank, k, s, i, t0, t1 in rows]


def measured_idle_fraction(runs: list, step: int = -1) -> float:
    """1 - (time spent in F/B/W/BW over all ranks) / (p · the step's wall time), from a real run. An
    action's span starts once its input has arrived (waiting in a receive is idle)."""
    rows = step_rows(runs, step)
    makespan = max(r[5] for r in rows)
    return 1 - sum(r[5] - r[4] for r in rows) / (len(runs) * makespan)


def typical_step(runs: list) -> int:
    """The step whose wall time is the median over the steps after the first (which also allocates): on a
    shared machine one step can be stretched by other processes, so draw and measure a typical one."""
    steps = sorted({row[0] for run in runs for row in run.timeline})
    candidates = steps[1:] or steps
    spans = {s: max(r[5] for r in step_rows(runs, s)) for s in candidates}
    ordered = sorted(candidates, key=spans.get)
    return ordered[len(ordered) // 2]
