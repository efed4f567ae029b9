"""Chapter 04 in the tour: pipeline schedules on 4 ranks (GPipe, 1F1B, interleaved; PipeDream).

Each schedule row (:func:`minipar.course.pipeline_views.schedule_row`) trains the tiny GPT (8 layers, hidden
16, 2 heads, sequence 8, global batch 16 cut into m = 8 micro-batches of 2, Adam, 2 steps, float64) with
:func:`minipar.pipeline.runtime.parallel_train` and compares the loss at every step and every parameter with
one device (harness float64 tolerance: the micro-batch gradients are summed in another order, which Adam in
float32 can amplify for weights whose gradient is nearly zero). Bytes: what one rank sends per step (mean over
ranks, from the communication log) next to the formula 2 · c · m · A / p, A = one micro-batch's activation
(2 · 8 · 16 · 8 B), c = p·v - 1 the stage boundaries that cross ranks: each carries each micro-batch's
activation forward and its gradient back; beside it, what the sockets carried in one step
(:mod:`minipar.wire`: a run of 2 steps minus a run of 1, so that setup cancels). Peak: live bytes
created during a step (activations, gradients, buffers), max over ranks, measured with
:class:`minipar.memory.LiveTensorTracker`. The PipeDream rows are compared with their own update rules (they
are not synchronous training) and train with SGD for 6 steps. The zero-bubble and V schedules are chapter
04b's rows.
"""
from __future__ import annotations

import functools

from minipar import comm
from minipar.check import compare
from minipar.launcher import launch
from minipar.pipeline import pipedream
from minipar.pipeline.pipedream import reference_2bw, reference_async
from minipar.course.pipeline_views import BATCH, HIDDEN, M, SEQ, schedule_row, tour_recipe
from minipar.course.tour import WORLD_SIZE, TourRow


def _pipedream_rank(rank, world_size, recipe, short, **config):
    """The run, and one batch's bytes (log and wire): the run minus a run of one batch fewer."""
    seen = []
    for r in (short, recipe):
        with comm.recording() as log:
            run = pipedream.parallel_train(rank, world_size, r, **config)
        seen.append((log.bytes_sent, log.observed_bytes_sent, log.count()))
    (m0, o0, c0), (m1, o1, c1) = seen
    return run, m1 - m0, None if None in (o0, o1) else o1 - o0, c1 - c0


def _pipedream_row(mode: str) -> TourRow:
    recipe, short = tour_recipe("sgd", steps=6), tour_recipe("sgd", steps=5)
    pipedream.validate(recipe, world_size=WORLD_SIZE, mode=mode, m=M)
    pipedream.validate(short, world_size=WORLD_SIZE, mode=mode, m=M)
    out = launch(_pipedream_rank, WORLD_SIZE, recipe, short, mode=mode, m=M, lr=0.1, quiet=True)
    runs = [o[0] for o in out]
    rule = reference_2bw(recipe, 0.1) if mode == "2bw" else reference_async(recipe, WORLD_SIZE, 0.1)
    cmp = compare(rule, runs, dtype=recipe.dtype)
    name = "PipeDream-2BW" if mode == "2bw" else "PipeDream async + weight stashing"
    versions = [r.most_versions for r in runs]
    m = M if mode == "2bw" else 1                       # async: every batch is one input
    formula = 2 * (WORLD_SIZE - 1) * m * (BATCH // m) * SEQ * HIDDEN * 8 / WORLD_SIZE
    mean = lambda i: sum(o[i] for o in out) / len(out)  # noqa: E731
    observed = None if any(o[2] is None for o in out) else mean(2)
    return TourRow(strategy=f"pipeline {name}, pp={WORLD_SIZE}", world_size=WORLD_SIZE, matches=cmp.matches,
                   max_abs_diff=cmp.max_abs_diff, bytes_sent_per_rank=mean(1), bytes_formula=formula,
                   peak_bytes_per_rank=None,
                   note=f"compared with its update rule, not with synchronous training; weight versions "
                        f"held per rank {versions}; bytes per batch (a 6-batch run minus a 5-batch run), "
                        f"formula 2(p-1)·(batch activation)/p as for 1F1B",
                   kind="update rule", bytes_observed_per_rank=observed, calls_per_rank=mean(3))


STRATEGIES = [
    ("pipeline GPipe", functools.partial(schedule_row, "gpipe")),
    ("pipeline GPipe + recompute", functools.partial(schedule_row, "gpipe", recompute=True)),
    ("pipeline 1F1B", functools.partial(schedule_row, "1f1b")),
    ("pipeline interleaved 1F1B", functools.partial(schedule_row, "interleaved", 2)),
    ("pipeline PipeDream-2BW", functools.partial(_pipedream_row, "2bw")),
    ("pipeline PipeDream async", functools.partial(_pipedream_row, "async")),
]
