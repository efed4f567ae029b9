"""Chapter 04b in the tour: the zero-bubble and V schedules on 4 ranks.

Each row (:func:`minipar.course.pipeline_views.schedule_row`) trains the tiny GPT (8 layers, hidden 16, 2 heads,
sequence 8, global batch 16 cut into m = 8 micro-batches of 2, Adam, 2 steps, float64) with
:func:`minipar.pipeline.runtime.parallel_train` and compares the loss at every step and every parameter with one
device (harness float64 tolerance). Bytes: what one rank sends per step (mean over ranks, from the communication
log) next to the formula 2 · c · m · A / p, A = one micro-batch's activation (2 · 8 · 16 · 8 B), c the stage
boundaries that cross ranks (p - 1 for ZB-H1; 2p - 2 in the V of ZB-V and DualPipeV, whose turn stays on rank
p-1); beside it, what the sockets carried in one step (:mod:`minipar.wire`: a run of 2 steps minus a run
of 1, so that setup cancels). Peak: live bytes created during a step, max over ranks
(:class:`minipar.memory.LiveTensorTracker`).
"""
from __future__ import annotations

import functools

from minipar.course.pipeline_views import schedule_row

STRATEGIES = [
    ("pipeline zero bubble ZB-H1", functools.partial(schedule_row, "zb-h1")),
    ("pipeline ZB-V", functools.partial(schedule_row, "zb-v", 2)),
    ("pipeline DualPipeV", functools.partial(schedule_row, "dualpipev", 2)),
]
